package drain

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
)

// The wire form of a batch of entries, as members send them:
//
//	magic 'd', version 1, count (uint16)
//	count times: address length (uint16), address, flags (bit 0:
//	drained), weight percent, version (uint64), origin length (uint8),
//	origin, HMAC-SHA256 (32 bytes)
//
// Integers are big-endian. Each entry is signed on its own, with the ops
// key, over a domain label and the entry's bytes before its MAC, so a
// member may pass on what it received without re-signing it.
const (
	wireMagic   byte = 'd'
	wireVersion byte = 1
	macSize          = sha256.Size
	// MaxMessage is the longest message Decode reads, in bytes.
	MaxMessage = 64 << 10
	// entryFixed is an entry's size without its address and origin.
	entryFixed = 2 + 1 + 1 + 8 + 1 + macSize
)

// macLabel separates these signatures from any other use of the key.
var macLabel = []byte("lbx drain entry v1\x00")

// KeySize is the ops key's length in bytes.
const KeySize = 32

// errors of Decode
var (
	errShort   = errors.New("truncated")
	errTrailer = errors.New("bytes after the last entry")
)

// appendEntry appends e's wire form, signed with key.
func appendEntry(b []byte, e Entry, key []byte) []byte {
	start := len(b)
	b = binary.BigEndian.AppendUint16(b, uint16(len(e.Addr)))
	b = append(b, e.Addr...)
	var flags byte
	if e.Drained {
		flags = 1
	}
	b = append(b, flags, e.WeightPercent)
	b = binary.BigEndian.AppendUint64(b, e.Version)
	b = append(b, byte(len(e.Origin)))
	b = append(b, e.Origin...)
	return append(b, sign(b[start:], key)...)
}

// sign returns the MAC of an entry's bytes.
func sign(body, key []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(macLabel)
	m.Write(body)
	return m.Sum(nil)
}

// EntrySize is the wire size of e.
func EntrySize(e Entry) int { return entryFixed + len(e.Addr) + len(e.Origin) }

// Encode returns a message of as many of entries, from the first, as fit
// in limit bytes (at most MaxMessage), signed with key, and how many it
// holds. It holds none when the first does not fit.
func Encode(entries []Entry, key []byte, limit int) ([]byte, int) {
	limit = min(limit, MaxMessage)
	b := []byte{wireMagic, wireVersion, 0, 0}
	n := 0
	for _, e := range entries {
		if n == 0xffff || len(b)+EntrySize(e) > limit {
			break
		}
		b = appendEntry(b, e, key)
		n++
	}
	binary.BigEndian.PutUint16(b[2:], uint16(n))
	return b, n
}

// Decode reads a message, checking each entry's signature with key. It
// returns the entries that are signed and within bounds, and how many
// were not (bad). The error is for a message that is not one: too long,
// truncated, another magic or version, a count that does not match;
// nothing of such a message is returned.
func Decode(msg, key []byte) (entries []Entry, bad int, err error) {
	if len(msg) > MaxMessage {
		return nil, 0, fmt.Errorf("message of %d bytes; at most %d", len(msg), MaxMessage)
	}
	if len(msg) < 4 {
		return nil, 0, errShort
	}
	if msg[0] != wireMagic || msg[1] != wireVersion {
		return nil, 0, fmt.Errorf("magic %#x version %d: not a drain message", msg[0], msg[1])
	}
	count := int(binary.BigEndian.Uint16(msg[2:]))
	if count*entryFixed > len(msg)-4 {
		return nil, 0, errShort
	}
	rest := msg[4:]
	entries = make([]Entry, 0, count)
	for range count {
		e, body, mac, r, ok := readEntry(rest)
		if !ok {
			return nil, 0, errShort
		}
		rest = r
		if !hmac.Equal(mac, sign(body, key)) || e.check() != nil {
			bad++
			continue
		}
		entries = append(entries, e)
	}
	if len(rest) != 0 {
		return nil, 0, errTrailer
	}
	return entries, bad, nil
}

// readEntry reads one entry from b: the entry, its signed bytes, its MAC
// and what follows; ok false when b is too short.
func readEntry(b []byte) (e Entry, body, mac, rest []byte, ok bool) {
	if len(b) < 2 {
		return
	}
	n := int(binary.BigEndian.Uint16(b))
	if n > MaxAddr || len(b) < 2+n+1+1+8+1 {
		return
	}
	off := 2
	e.Addr = string(b[off : off+n])
	off += n
	flags, weight := b[off], b[off+1]
	off += 2
	e.Drained = flags == 1
	e.WeightPercent = weight
	e.Version = binary.BigEndian.Uint64(b[off:])
	off += 8
	o := int(b[off])
	off++
	if len(b) < off+o+macSize {
		return
	}
	e.Origin = string(b[off : off+o])
	off += o
	if flags > 1 {
		// an unknown flag: out of bounds, so check refuses the entry
		e.WeightPercent = 0
	}
	return e, b[:off], b[off : off+macSize], b[off+macSize:], true
}
