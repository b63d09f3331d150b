package orca

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"math"
	"strings"
)

// Protobuf wire types used by OrcaLoadReport, and the ones skipped.
const (
	wireVarint  = 0
	wireFixed64 = 1
	wireBytes   = 2
	wireFixed32 = 5
)

// binScalar returns the scalar an OrcaLoadReport field number fills.
// Field 3 (rps, a deprecated integer) is skipped like any unknown field.
func binScalar(num uint64) (scalar, bool) {
	switch num {
	case 1:
		return scalarFor("cpu_utilization")
	case 2:
		return scalarFor("mem_utilization")
	case 6:
		return scalarFor("rps_fractional")
	case 7:
		return scalarFor("eps")
	case 9:
		return scalarFor("application_utilization")
	}
	return scalar{}, false
}

// binMap returns the map an OrcaLoadReport map<string, double> field
// number fills.
func binMap(num uint64) (int, bool) {
	switch num {
	case 4:
		return mapCost, true
	case 5:
		return mapUtil, true
	case 8:
		return mapNamed, true
	}
	return 0, false
}

// parseBin parses the body of a BIN report, or the value of an
// endpoint-load-metrics-bin header: the serialized message in standard
// base64, with or without padding.
func parseBin(body string) (Report, error) {
	msg, err := decodeBase64(strings.Trim(body, " \t"))
	if err != nil {
		return Report{}, fault(ErrSyntax, "", "bad base64: "+err.Error())
	}
	b := builder{}
	for len(msg) > 0 {
		if err := b.key(); err != nil {
			return Report{}, err
		}
		num, wt, rest, err := tag(msg)
		if err != nil {
			return Report{}, err
		}
		msg = rest
		if s, ok := binScalar(num); ok {
			if wt != wireFixed64 {
				return Report{}, fault(ErrSyntax, s.name, fmt.Sprintf("wire type %d, want %d", wt, wireFixed64))
			}
			var v float64
			if v, msg, err = fixed64(s.name, msg); err != nil {
				return Report{}, err
			}
			if err := b.setScalar(s, s.name, v); err != nil {
				return Report{}, err
			}
			continue
		}
		if m, ok := binMap(num); ok {
			if wt != wireBytes {
				return Report{}, fault(ErrSyntax, mapPrefix[m], fmt.Sprintf("wire type %d, want %d", wt, wireBytes))
			}
			var entry []byte
			if entry, msg, err = bytesField(mapPrefix[m], msg); err != nil {
				return Report{}, err
			}
			if err := b.binEntry(m, entry); err != nil {
				return Report{}, err
			}
			continue
		}
		if msg, err = skip(num, wt, msg); err != nil {
			return Report{}, err
		}
	}
	return b.r, nil
}

// decodeBase64 decodes standard base64 by gRPC's rule for binary
// metadata: a length that is a multiple of 4 is read as padded (or as
// needing no padding), any other as unpadded. Padding where none fits,
// such as "QQ=", is refused, as gRPC refuses it.
func decodeBase64(s string) ([]byte, error) {
	if len(s)%4 == 0 {
		return base64.StdEncoding.DecodeString(s)
	}
	return base64.RawStdEncoding.DecodeString(s)
}

// binEntry reads one map entry message: key (field 1, string) and value
// (field 2, double), either of which may be absent (protobuf defaults:
// "" and 0), and either repeated (the last wins). Its fields do not
// count against MaxKeys: each takes at least two bytes of the header,
// which bounds them.
func (b *builder) binEntry(m int, entry []byte) error {
	var name string
	var v float64
	where := mapPrefix[m]
	for len(entry) > 0 {
		num, wt, rest, err := tag(entry)
		if err != nil {
			return err
		}
		entry = rest
		switch {
		case num == 1 && wt == wireBytes:
			var k []byte
			if k, entry, err = bytesField(where, entry); err != nil {
				return err
			}
			if len(k) > MaxNameBytes {
				// Checked here so that no long name is copied.
				return fault(ErrName, where+"."+string(k[:maxQuote]), fmt.Sprintf("longer than %d bytes", MaxNameBytes))
			}
			name = string(k)
		case num == 2 && wt == wireFixed64:
			if v, entry, err = fixed64(where, entry); err != nil {
				return err
			}
		case num == 1 || num == 2:
			return fault(ErrSyntax, where, fmt.Sprintf("entry field %d has wire type %d", num, wt))
		default:
			if entry, err = skip(num, wt, entry); err != nil {
				return err
			}
		}
	}
	return b.setEntry(m, name, v)
}

// tag reads a field's tag: its number and wire type.
func tag(msg []byte) (num uint64, wt int, rest []byte, err error) {
	t, n := binary.Uvarint(msg)
	if n <= 0 {
		return 0, 0, nil, fault(ErrSyntax, "", "truncated or overlong field tag")
	}
	num, wt = t>>3, int(t&7)
	if num == 0 || num > math.MaxInt32>>2 {
		return 0, 0, nil, fault(ErrSyntax, "", fmt.Sprintf("field number %d out of range", num))
	}
	return num, wt, msg[n:], nil
}

// fixed64 reads a double.
func fixed64(key string, msg []byte) (float64, []byte, error) {
	if len(msg) < 8 {
		return 0, nil, fault(ErrSyntax, key, "truncated double")
	}
	return math.Float64frombits(binary.LittleEndian.Uint64(msg)), msg[8:], nil
}

// bytesField reads a length-delimited field's content.
func bytesField(key string, msg []byte) (content, rest []byte, err error) {
	l, n := binary.Uvarint(msg)
	if n <= 0 || l > uint64(len(msg)-n) {
		return nil, nil, fault(ErrSyntax, key, "truncated length-delimited field")
	}
	end := n + int(l)
	return msg[n:end], msg[end:], nil
}

// skip passes over a field this package does not read.
func skip(num uint64, wt int, msg []byte) ([]byte, error) {
	switch wt {
	case wireVarint:
		_, n := binary.Uvarint(msg)
		if n <= 0 {
			return nil, fault(ErrSyntax, "", fmt.Sprintf("field %d: truncated varint", num))
		}
		return msg[n:], nil
	case wireFixed64:
		if len(msg) < 8 {
			return nil, fault(ErrSyntax, "", fmt.Sprintf("field %d: truncated fixed64", num))
		}
		return msg[8:], nil
	case wireBytes:
		_, rest, err := bytesField(fmt.Sprintf("field %d", num), msg)
		return rest, err
	case wireFixed32:
		if len(msg) < 4 {
			return nil, fault(ErrSyntax, "", fmt.Sprintf("field %d: truncated fixed32", num))
		}
		return msg[4:], nil
	}
	// Groups (3, 4) are not used by this message; 6 and 7 do not exist.
	return nil, fault(ErrSyntax, "", fmt.Sprintf("field %d has unsupported wire type %d", num, wt))
}
