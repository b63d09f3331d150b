package gossipavg

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// sampleMessages returns valid messages of both kinds, small and large.
func sampleMessages(t testing.TB) []Message {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "node-b.example.com", 2, 30, 0)
	req := requestTo(t, a, b.cfg.Name, t0)
	rep, _ := receive(t, b, req, t0)
	big := Message{Kind: Request, From: strings.Repeat("f", MaxNameLen), To: strings.Repeat("t", MaxNameLen),
		FromIncarnation: math.MaxUint64, ToIncarnation: 1, Seq: math.MaxUint64, Version: maxVersion, Dim: MaxDim, NumEntries: 3}
	for k := range MaxDim {
		big.Flow[k], big.Estimate[k] = -MaxFlow, MaxFlow
	}
	for i := range big.NumEntries {
		big.Entries[i] = Entry{Name: strings.Repeat("e", 100+i), Load: MaxLoad, Seq: math.MaxUint64, AgeMillis: MaxAgeMillis}
	}
	return []Message{req, rep, big}
}

func TestMessageRoundTrip(t *testing.T) {
	for _, m := range sampleMessages(t) {
		b, err := m.AppendBinary([]byte("prefix"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(b, []byte("prefix")) || len(b)-6 != m.size() {
			t.Fatalf("AppendBinary wrote %d bytes after the prefix, size says %d", len(b)-6, m.size())
		}
		got, err := Decode(b[6:])
		if err != nil {
			t.Fatal(err)
		}
		if got != m {
			t.Fatalf("decoded %+v, want %+v", got, m)
		}
		t.Logf("%v of dimension %d with %d entries: %d bytes", m.Kind, m.Dim, m.NumEntries, len(b)-6)
	}
}

func TestAppendBinaryRefusesTooLarge(t *testing.T) {
	m := sampleMessages(t)[2]
	m.NumEntries = MaxEntries
	for i := range m.NumEntries {
		m.Entries[i] = Entry{Name: strings.Repeat("e", MaxNameLen), Load: 1}
	}
	b, err := m.AppendBinary(nil)
	if err == nil || len(b) != 0 || !strings.Contains(err.Error(), "above 1200 bytes") {
		t.Fatalf("AppendBinary of a %d-byte message: %d bytes, error %v", m.size(), len(b), err)
	}
	// A node trims the entries it sends to fit.
	n, err := New(Config{Name: strings.Repeat("a", MaxNameLen), Dim: MaxDim, Entries: MaxEntries, Peers: 1,
		Freshness: testConfig("").Freshness, RetryTimeout: testConfig("").RetryTimeout}, t0, rand.New(rand.NewPCG(1, 1)))
	if err != nil {
		t.Fatal(err)
	}
	for i := range MaxEntries {
		n.low = append(n.low, lowEntry{name: strings.Repeat(string(rune('b'+i)), MaxNameLen), load: 1, origin: t0})
	}
	req := requestTo(t, n, strings.Repeat("z", MaxNameLen), t0)
	if b, err := req.AppendBinary(nil); err != nil || req.NumEntries < 2 || req.NumEntries == MaxEntries {
		t.Fatalf("a node sends %d entries in %d bytes: %v", req.NumEntries, len(b), err)
	}
}

func TestDecodeRejects(t *testing.T) {
	good, err := sampleMessages(t)[0].AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	// Offsets in good: version 0, kind 1, dim 2, from length 3.
	fromEnd := 4 + int(good[3])
	toEnd := fromEnd + 1 + int(good[fromEnd])
	incs := toEnd
	seq := incs + 16
	flows := seq + 2 // seq 1 and version 0: one byte each
	entries := flows + 4*8
	set := func(i int, v ...byte) []byte {
		b := bytes.Clone(good)
		return append(b[:i], append(v, b[i+len(v):]...)...)
	}
	f64 := func(v float64) []byte { return binary.LittleEndian.AppendUint64(nil, math.Float64bits(v)) }
	for _, tc := range []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "truncated"},
		{"truncated", good[:len(good)-1], "truncated"},
		{"trailing", append(bytes.Clone(good), 0), "1 trailing bytes"},
		{"too large", make([]byte, MaxMessageSize+1), "above 1200 bytes"},
		{"version", set(0, 2), "wire version 2"},
		{"kind", set(1, 3), "kind 3"},
		{"dim 0", set(2, 0), "dimension 0"},
		{"dim 9", set(2, 9), "dimension 9"},
		{"empty name", set(3, 0), "name of 0 bytes"},
		{"long name", set(3, 129), "name of 129 bytes"},
		{"incarnation 0", set(incs, 0, 0, 0, 0, 0, 0, 0, 0), "incarnation 0"},
		{"long varint", set(seq, 0x81, 0x00), "malformed varint"},
		{"version 2^62+1", append(set(seq+1, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40)[:seq+10], good[seq+2:]...), "version 4611686018427387905"},
		{"NaN flow", set(flows, f64(math.NaN())...), "flow value NaN"},
		{"Inf estimate", set(flows+16, f64(math.Inf(1))...), "estimate value +Inf"},
		{"9 entries", set(entries, 9), "9 entries"},
		{"negative load", set(entries+2+len("a"), f64(-1)...), "entry load -1"},
		{"absurd load", set(entries+2+len("a"), f64(1e16)...), "entry load 1e+16"},
	} {
		if _, err := Decode(tc.b); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range sampleMessages(f) {
		b, err := m.AppendBinary(nil)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		out, err := m.AppendBinary(nil)
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", m, err)
		}
		if !bytes.Equal(out, b) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", b, out)
		}
		if again, err := Decode(out); err != nil || again != m {
			t.Fatalf("round trip: %+v, %v; want %+v", again, err, m)
		}
		// Whatever decodes, a node takes without panicking.
		cfg := testConfig(m.To)
		cfg.Dim = m.Dim
		n, err := New(cfg, t0, rand.New(rand.NewPCG(1, 1)))
		if err != nil {
			t.Fatal(err)
		}
		if r, ok, err := n.Receive(t0, m); err == nil && ok {
			if _, err := r.AppendBinary(nil); err != nil {
				t.Fatalf("reply to %+v does not encode: %v", m, err)
			}
		}
	})
}
