package gossipavg

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
)

// Kind says what a Message is.
type Kind uint8

// The kinds of message.
const (
	// Request opens an exchange: it carries the sender's flow and estimate.
	Request Kind = 1
	// Reply closes one: it carries the answering node's flow.
	Reply Kind = 2
)

// String returns "request" or "reply".
func (k Kind) String() string {
	switch k {
	case Request:
		return "request"
	case Reply:
		return "reply"
	}
	return fmt.Sprintf("kind %d", uint8(k))
}

// Entry is one member's load as messages carry it, for the lowest-load
// view.
type Entry struct {
	// Name is the member's name, 1 to MaxNameLen bytes.
	Name string
	// Load is the member's load (the first input value), 0 to MaxLoad.
	Load float64
	// Seq is the member's origin sequence: it grows whenever the member's
	// load changes (and across restarts), so a higher one is newer.
	Seq uint64
	// AgeMillis is how old the entry is, in milliseconds, by the clocks it
	// went through; at most MaxAgeMillis.
	AgeMillis uint32
}

// Message is a request or a reply between two members. The arrays hold
// Dim values and NumEntries entries; the rest is ignored (and is zero in
// a decoded message). A Message is a plain value: it shares nothing with
// the Node that made it.
type Message struct {
	// Kind is Request or Reply.
	Kind Kind
	// From and To name the sender and the receiver (1 to MaxNameLen bytes
	// each).
	From, To string
	// FromIncarnation is the sender's incarnation, never 0.
	FromIncarnation uint64
	// ToIncarnation is the receiver's incarnation as the sender knows it;
	// 0 when it knows none.
	ToIncarnation uint64
	// Seq is the request's sequence number (a reply echoes it).
	Seq uint64
	// Version is the version of the pair's flow that Flow carries, at
	// most 2^62.
	Version uint64
	// Dim is the number of values in Flow and Estimate, 1 to MaxDim.
	Dim int
	// Flow is the sender's flow to the receiver.
	Flow [MaxDim]float64
	// Estimate is the sender's estimate; requests only.
	Estimate [MaxDim]float64
	// NumEntries is the number of entries, 0 to MaxEntries.
	NumEntries int
	// Entries are lowest-load entries, the sender's own first.
	Entries [MaxEntries]Entry
}

// The wire format, all integers little-endian or unsigned varints (the
// shortest encoding only):
//
//	version   1 byte, wireVersion
//	kind      1 byte, 1 request, 2 reply
//	dim       1 byte, 1 to 8
//	from      1 byte length (1 to 128), the bytes
//	to        1 byte length (1 to 128), the bytes
//	from inc  8 bytes, not 0
//	to inc    8 bytes
//	seq       uvarint
//	version   uvarint
//	flow      dim × 8 bytes, IEEE 754 binary64
//	estimate  dim × 8 bytes, requests only
//	entries   1 byte count (0 to 8), then each:
//	            name (1 byte length, the bytes), load (8 bytes),
//	            seq (uvarint), age in ms (uvarint)
//
// The whole is at most MaxMessageSize bytes.
const wireVersion = 1

// maxVersion bounds a pair's version, so that bumping it never wraps
// around; an honest pair would need 2^61 exchanges to get there.
const maxVersion = 1 << 62

// Errors of the wire format.
var (
	errTooLarge = fmt.Errorf("gossipavg: message above %d bytes", MaxMessageSize)
	errShort    = errors.New("gossipavg: message truncated")
)

// uvarintLen is the length of v as a uvarint.
func uvarintLen(v uint64) int { return (bits.Len64(v|1) + 6) / 7 }

// headerSize is the encoded size of m without its entries (their count
// byte included).
func (m *Message) headerSize() int {
	n := 3 + 1 + len(m.From) + 1 + len(m.To) + 16 + uvarintLen(m.Seq) + uvarintLen(m.Version) + 8*m.Dim + 1
	if m.Kind == Request {
		n += 8 * m.Dim
	}
	return n
}

// entrySize is the encoded size of e.
func entrySize(e *Entry) int {
	return 1 + len(e.Name) + 8 + uvarintLen(e.Seq) + uvarintLen(uint64(e.AgeMillis))
}

// size is the encoded size of m, assuming valid counts.
func (m *Message) size() int {
	n := m.headerSize()
	for i := range m.NumEntries {
		n += entrySize(&m.Entries[i])
	}
	return n
}

// validName reports whether s can be a member name.
func validName(s string) bool { return s != "" && len(s) <= MaxNameLen }

// checkFlow reports whether v may travel as a flow or estimate value.
func checkFlow(v float64) bool { return math.Abs(v) <= MaxFlow } // false for NaN

// validLoad reports whether v may be an input value or entry load.
func validLoad(v float64) bool { return v >= 0 && v <= MaxLoad } // false for NaN

// check reports whether m is a well-formed message of at most
// MaxMessageSize bytes.
func (m *Message) check() error {
	switch {
	case m.Kind != Request && m.Kind != Reply:
		return fmt.Errorf("gossipavg: unknown message kind %d", m.Kind)
	case !validName(m.From):
		return fmt.Errorf("gossipavg: sender name of %d bytes, want 1 to %d", len(m.From), MaxNameLen)
	case !validName(m.To):
		return fmt.Errorf("gossipavg: receiver name of %d bytes, want 1 to %d", len(m.To), MaxNameLen)
	case m.FromIncarnation == 0:
		return errors.New("gossipavg: sender incarnation 0")
	case m.Dim < 1 || m.Dim > MaxDim:
		return fmt.Errorf("gossipavg: dimension %d, want 1 to %d", m.Dim, MaxDim)
	case m.Version > maxVersion:
		return fmt.Errorf("gossipavg: version %d above %d", m.Version, uint64(maxVersion))
	case m.NumEntries < 0 || m.NumEntries > MaxEntries:
		return fmt.Errorf("gossipavg: %d entries, want 0 to %d", m.NumEntries, MaxEntries)
	}
	for k := range m.Dim {
		if !checkFlow(m.Flow[k]) {
			return fmt.Errorf("gossipavg: flow value %v is not a number within ±%g", m.Flow[k], MaxFlow)
		}
		if m.Kind == Request && !checkFlow(m.Estimate[k]) {
			return fmt.Errorf("gossipavg: estimate value %v is not a number within ±%g", m.Estimate[k], MaxFlow)
		}
	}
	for i := range m.NumEntries {
		e := &m.Entries[i]
		switch {
		case !validName(e.Name):
			return fmt.Errorf("gossipavg: entry name of %d bytes, want 1 to %d", len(e.Name), MaxNameLen)
		case !validLoad(e.Load):
			return fmt.Errorf("gossipavg: entry load %v is not a number from 0 to %g", e.Load, MaxLoad)
		case e.AgeMillis > MaxAgeMillis:
			return fmt.Errorf("gossipavg: entry age %dms above %dms", e.AgeMillis, MaxAgeMillis)
		}
	}
	if m.size() > MaxMessageSize {
		return errTooLarge
	}
	return nil
}

// AppendBinary appends m's encoding to b (encoding.BinaryAppender). It
// refuses a malformed message, and one that would exceed MaxMessageSize,
// returning b unchanged.
func (m Message) AppendBinary(b []byte) ([]byte, error) {
	if err := m.check(); err != nil {
		return b, err
	}
	b = append(b, wireVersion, byte(m.Kind), byte(m.Dim))
	b = append(b, byte(len(m.From)))
	b = append(b, m.From...)
	b = append(b, byte(len(m.To)))
	b = append(b, m.To...)
	b = binary.LittleEndian.AppendUint64(b, m.FromIncarnation)
	b = binary.LittleEndian.AppendUint64(b, m.ToIncarnation)
	b = binary.AppendUvarint(b, m.Seq)
	b = binary.AppendUvarint(b, m.Version)
	for k := range m.Dim {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(m.Flow[k]))
	}
	if m.Kind == Request {
		for k := range m.Dim {
			b = binary.LittleEndian.AppendUint64(b, math.Float64bits(m.Estimate[k]))
		}
	}
	b = append(b, byte(m.NumEntries))
	for i := range m.NumEntries {
		e := &m.Entries[i]
		b = append(b, byte(len(e.Name)))
		b = append(b, e.Name...)
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(e.Load))
		b = binary.AppendUvarint(b, e.Seq)
		b = binary.AppendUvarint(b, uint64(e.AgeMillis))
	}
	return b, nil
}

// decoder reads the wire format; the first error sticks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) byte() byte {
	if d.err != nil || len(d.b) < 1 {
		d.fail(errShort)
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

func (d *decoder) uint64() uint64 {
	if d.err != nil || len(d.b) < 8 {
		d.fail(errShort)
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}

func (d *decoder) float() float64 { return math.Float64frombits(d.uint64()) }

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	switch {
	case n == 0:
		d.fail(errShort)
		return 0
	case n < 0 || n != uvarintLen(v):
		d.fail(errors.New("gossipavg: malformed varint"))
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) name() string {
	n := int(d.byte())
	if d.err != nil {
		return ""
	}
	if n < 1 || n > MaxNameLen {
		d.fail(fmt.Errorf("gossipavg: name of %d bytes, want 1 to %d", n, MaxNameLen))
		return ""
	}
	if len(d.b) < n {
		d.fail(errShort)
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

func (d *decoder) fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

// Decode parses one message, strictly: anything AppendBinary would not
// have produced (an unknown version or kind, a count or name out of
// bounds, a non-finite or out-of-range number, a longer than needed
// varint, trailing bytes, more than MaxMessageSize bytes) is an error.
func Decode(b []byte) (Message, error) {
	var m Message
	if len(b) > MaxMessageSize {
		return m, errTooLarge
	}
	d := decoder{b: b}
	if v := d.byte(); d.err == nil && v != wireVersion {
		return m, fmt.Errorf("gossipavg: wire version %d, want %d", v, wireVersion)
	}
	m.Kind = Kind(d.byte())
	m.Dim = int(d.byte())
	switch {
	case d.err != nil:
	case m.Kind != Request && m.Kind != Reply:
		return Message{}, fmt.Errorf("gossipavg: unknown message kind %d", m.Kind)
	case m.Dim < 1 || m.Dim > MaxDim:
		return Message{}, fmt.Errorf("gossipavg: dimension %d, want 1 to %d", m.Dim, MaxDim)
	}
	m.From = d.name()
	m.To = d.name()
	m.FromIncarnation = d.uint64()
	m.ToIncarnation = d.uint64()
	m.Seq = d.uvarint()
	m.Version = d.uvarint()
	for k := range m.Dim {
		m.Flow[k] = d.float()
	}
	if m.Kind == Request {
		for k := range m.Dim {
			m.Estimate[k] = d.float()
		}
	}
	m.NumEntries = int(d.byte())
	if d.err == nil && m.NumEntries > MaxEntries {
		return Message{}, fmt.Errorf("gossipavg: %d entries, want 0 to %d", m.NumEntries, MaxEntries)
	}
	for i := range m.NumEntries {
		e := &m.Entries[i]
		e.Name = d.name()
		e.Load = d.float()
		e.Seq = d.uvarint()
		age := d.uvarint()
		if d.err == nil && age > MaxAgeMillis {
			return Message{}, fmt.Errorf("gossipavg: entry age %dms above %dms", age, MaxAgeMillis)
		}
		e.AgeMillis = uint32(age)
	}
	switch {
	case d.err != nil:
		return Message{}, d.err
	case len(d.b) != 0:
		return Message{}, fmt.Errorf("gossipavg: %d trailing bytes", len(d.b))
	}
	if err := m.check(); err != nil {
		return Message{}, err
	}
	return m, nil
}
