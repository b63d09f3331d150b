package gossipavg

import (
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// boundedNode returns a node "me" with input {40, 0} and bounds of 30 to
// 50 on the load, 0 to 1 on the size indicator.
func boundedNode(t testing.TB) *Node {
	t.Helper()
	n, err := New(testConfig("me"), t0, rand.New(rand.NewPCG(3, 4)))
	if err != nil {
		t.Fatal(err)
	}
	if err := n.SetInput([]float64{40, 0}); err != nil {
		t.Fatal(err)
	}
	if err := n.SetBounds([]float64{30, 0}, []float64{50, 1}); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSetBoundsChecks: bounds of the wrong length, reversed or not finite
// are refused; nil removes them.
func TestSetBoundsChecks(t *testing.T) {
	n := boundedNode(t)
	for _, c := range []struct {
		name   string
		lo, hi []float64
	}{
		{"one value", []float64{0}, []float64{1}},
		{"reversed", []float64{2, 0}, []float64{1, 1}},
		{"NaN", []float64{math.NaN(), 0}, []float64{1, 1}},
		{"infinite", []float64{0, 0}, []float64{math.Inf(1), 1}},
		{"past MaxFlow", []float64{-2 * MaxFlow, 0}, []float64{1, 1}},
	} {
		if err := n.SetBounds(c.lo, c.hi); err == nil {
			t.Errorf("%s: SetBounds(%v, %v) accepted", c.name, c.lo, c.hi)
		}
	}
	if err := n.SetBounds(nil, nil); err != nil || n.bounded {
		t.Errorf("SetBounds(nil, nil): %v, bounded %v", err, n.bounded)
	}
}

// TestBoundsRefuseLies: a request whose estimate is outside the bounds,
// and one whose flow would take this node's estimate outside them, are
// refused with ErrOutOfBounds and change nothing; an honest request
// within them is answered; a reply whose flow would take the estimate out
// is refused.
func TestBoundsRefuseLies(t *testing.T) {
	req := func(est0 float64, flow0 float64, seq uint64) Message {
		return Message{Kind: Request, From: "liar", To: "me", FromIncarnation: 7, Seq: seq, Dim: 2,
			Flow: [MaxDim]float64{flow0}, Estimate: [MaxDim]float64{est0, 0.25}}
	}
	for _, c := range []struct {
		name string
		m    Message
	}{
		{"estimate 0.001", req(0.001, 0, 1)},
		{"estimate -1", req(-1, 0, 1)},
		{"estimate 1e18", req(1e18, 0, 1)},
		{"estimate -1e18", req(-1e18, 0, 1)},
		// Within the bounds, but the flow it says this node holds
		// would take this node to 40 - 1000.
		{"a flow that moves this node out", req(40, 1000, 1)},
	} {
		n := boundedNode(t)
		before := n.Estimate(t0)
		_, ok, err := n.Receive(t0, c.m)
		if !errors.Is(err, ErrOutOfBounds) || ok {
			t.Errorf("%s: Receive = %v, %v; want ErrOutOfBounds", c.name, ok, err)
		}
		if after := n.Estimate(t0); after.Values != before.Values || after.LastExchange != before.LastExchange {
			t.Errorf("%s: refused, yet the estimate went from %v to %v", c.name, before.Values, after.Values)
		}
	}

	// An honest request within the bounds is answered, and the estimate
	// moves to the average of the two.
	n := boundedNode(t)
	if _, ok, err := n.Receive(t0, req(44, 0, 1)); err != nil || !ok {
		t.Fatalf("honest request: %v, %v", ok, err)
	}
	if got := n.Estimate(t0).Values[0]; got != 42 {
		t.Errorf("after averaging with 44: %v; want 42", got)
	}

	// A reply that would take the estimate out of the bounds.
	n = boundedNode(t)
	m, ok := n.Tick(t0, []string{"liar"}, rand.New(rand.NewPCG(1, 1)))
	if !ok {
		t.Fatal("no request to the liar")
	}
	reply := Message{Kind: Reply, From: "liar", To: "me", FromIncarnation: 7, ToIncarnation: m.FromIncarnation,
		Seq: m.Seq, Version: 9, Dim: 2, Flow: [MaxDim]float64{-1000}}
	if _, _, err := n.Receive(t0, reply); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("reply with flow -1000: %v; want ErrOutOfBounds", err)
	}
	if got := n.Estimate(t0).Values[0]; got != 40 {
		t.Errorf("after the refused reply: %v; want 40", got)
	}
	// An estimate already outside (the bounds moved) may come closer.
	if err := n.SetBounds([]float64{45, 0}, []float64{50, 1}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.Receive(t0, req(48, 0, 2)); err != nil {
		t.Errorf("a request that brings the estimate closer to the bounds: %v", err)
	}
}

// FuzzReceive drives a bounded node with any sequence of messages from
// four peers, and its own requests: whatever arrives, its estimate stays
// finite, never moves farther outside its bounds (it starts inside them,
// so it stays inside), and a refused message changes nothing.
func FuzzReceive(f *testing.F) {
	f.Add([]byte{})
	seed := make([]byte, 0, 64)
	seed = append(seed, 1, 0, 1, 0, 5, 0, 0)
	seed = binary.LittleEndian.AppendUint64(seed, math.Float64bits(0.001))
	seed = binary.LittleEndian.AppendUint64(seed, math.Float64bits(0.25))
	seed = binary.LittleEndian.AppendUint64(seed, math.Float64bits(0))
	f.Add(seed)
	f.Add([]byte("\x00\x01\x02\x03 a few bytes of anything, as a seed"))
	f.Fuzz(func(t *testing.T, b []byte) {
		n := boundedNode(t)
		rng := rand.New(rand.NewPCG(5, 6))
		peers := []string{"p0", "p1", "p2", "p3"}
		now := t0
		for len(b) > 0 {
			op := b[0]
			b = b[1:]
			now = now.Add(time.Duration(op&7) * time.Millisecond) // never past freshness: no expiry
			if op&0x80 != 0 {
				n.Tick(now, peers, rng)
				continue
			}
			m := fuzzMessage(n, op, &b)
			before := n.Estimate(now)
			_, _, err := n.Receive(now, m)
			after := n.Estimate(now)
			for k := range 2 {
				if math.IsNaN(after.Values[k]) || math.IsInf(after.Values[k], 0) {
					t.Fatalf("estimate %v after %+v", after.Values, m)
				}
				if d := n.outside(k, after.Values[k]); d > 0 && d > n.outside(k, before.Values[k]) {
					t.Fatalf("estimate %d went from %v to %v, outside %v to %v, after %+v", k, before.Values[k], after.Values[k], n.lo[k], n.hi[k], m)
				}
			}
			if err != nil && after.Values != before.Values {
				t.Fatalf("refused (%v), yet the estimate went from %v to %v", err, before.Values, after.Values)
			}
		}
	})
}

// fuzzMessage makes a message to n from the bytes at *b, consuming them:
// its kind, sender, incarnations, sequence numbers, flows and estimates
// (any float64 bits), and up to two entries.
func fuzzMessage(n *Node, op byte, b *[]byte) Message {
	next := func() byte {
		if len(*b) == 0 {
			return 0
		}
		c := (*b)[0]
		*b = (*b)[1:]
		return c
	}
	float := func() float64 {
		var raw [8]byte
		for i := range raw {
			raw[i] = next()
		}
		return math.Float64frombits(binary.LittleEndian.Uint64(raw[:]))
	}
	m := Message{Kind: Request, To: "me", Dim: 2}
	if op&1 != 0 {
		m.Kind = Reply
	}
	m.From = []string{"p0", "p1", "p2", "p3"}[op>>1&3]
	m.FromIncarnation = uint64(next()%3) + 1
	switch next() % 3 {
	case 0:
		m.ToIncarnation = n.inc
	case 1:
		m.ToIncarnation = 0
	default:
		m.ToIncarnation = n.inc + 1
	}
	m.Seq = uint64(next())
	m.Version = uint64(next())
	for k := range 2 {
		m.Flow[k] = float()
		m.Estimate[k] = float()
	}
	m.NumEntries = int(next() % 3)
	for i := range m.NumEntries {
		m.Entries[i] = Entry{Name: m.From, Load: math.Abs(float()), Seq: uint64(next()), AgeMillis: uint32(next())}
	}
	return m
}
