package gossipavg

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// t0 is the tests' start time.
var t0 = time.Unix(1_700_000_000, 0)

// testConfig is the configuration of the unit tests and the simulation.
func testConfig(name string) Config {
	return Config{Name: name, Dim: 2, Entries: 4, Peers: 4, Freshness: 5 * time.Second, RetryTimeout: 500 * time.Millisecond, MaxRetries: 2}
}

// newNode returns a node named name, with an incarnation drawn from seed,
// and input in.
func newNode(t testing.TB, name string, seed uint64, in ...float64) *Node {
	t.Helper()
	n, err := New(testConfig(name), t0, rand.New(rand.NewPCG(seed, 1)))
	if err != nil {
		t.Fatal(err)
	}
	if err := n.SetInput(in); err != nil {
		t.Fatal(err)
	}
	return n
}

// requestTo makes a's request to peer, whatever Tick would choose.
func requestTo(t testing.TB, a *Node, peer string, now time.Time) Message {
	t.Helper()
	p := a.lookup(peer)
	if p == nil {
		p = a.add(peer, now)
	}
	p.tries = 0
	m, ok := a.request(now, p)
	if !ok {
		t.Fatalf("%s: no request to %s", a.cfg.Name, peer)
	}
	return m
}

// receive delivers m to n and fails on an error.
func receive(t testing.TB, n *Node, m Message, now time.Time) (Message, bool) {
	t.Helper()
	r, ok, err := n.Receive(now, m)
	if err != nil {
		t.Fatalf("%s receives %v from %s: %v", n.cfg.Name, m.Kind, m.From, err)
	}
	return r, ok
}

// exchange runs one complete exchange from a to b.
func exchange(t testing.TB, a, b *Node, now time.Time) {
	t.Helper()
	r, ok := receive(t, b, requestTo(t, a, b.cfg.Name, now), now)
	if !ok {
		t.Fatalf("%s did not answer %s", b.cfg.Name, a.cfg.Name)
	}
	receive(t, a, r, now)
}

// checkMass fails unless the nodes' estimates sum to their inputs, in
// every dimension, within tol.
func checkMass(t testing.TB, tol float64, nodes ...*Node) {
	t.Helper()
	for k := range nodes[0].cfg.Dim {
		var est, in float64
		for _, n := range nodes {
			est += n.estimate()[k]
			in += n.input[k]
		}
		if math.Abs(est-in) > tol {
			t.Fatalf("dimension %d: estimates sum to %.12g, inputs to %.12g (off by %g)", k, est, in, est-in)
		}
	}
}

// checkEstimate fails unless n estimates want within tol.
func checkEstimate(t testing.TB, n *Node, tol float64, want ...float64) {
	t.Helper()
	e := n.estimate()
	for k, w := range want {
		if math.Abs(e[k]-w) > tol {
			t.Fatalf("%s estimates %v in dimension %d, want %v", n.cfg.Name, e[k], k, w)
		}
	}
}

func TestTwoNodesExactAverage(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	exchange(t, a, b, t0)
	checkEstimate(t, a, 0, 20, 0.5)
	checkEstimate(t, b, 0, 20, 0.5)
	checkMass(t, 1e-9, a, b)

	// An input change moves the estimate by as much, at once; the next
	// exchange shares it.
	if err := a.SetInput([]float64{50, 1}); err != nil {
		t.Fatal(err)
	}
	checkEstimate(t, a, 1e-12, 60, 0.5)
	checkMass(t, 1e-9, a, b)
	exchange(t, b, a, t0.Add(time.Second))
	checkEstimate(t, a, 1e-12, 40, 0.5)
	checkEstimate(t, b, 1e-12, 40, 0.5)
	checkMass(t, 1e-9, a, b)
}

func TestThreeNodesConverge(t *testing.T) {
	nodes := []*Node{newNode(t, "a", 1, 3, 1), newNode(t, "b", 2, 9, 0), newNode(t, "c", 3, 27, 0)}
	rng := rand.New(rand.NewPCG(7, 7))
	now := t0
	for range 60 {
		now = now.Add(100 * time.Millisecond)
		i := rng.IntN(3)
		j := (i + 1 + rng.IntN(2)) % 3
		exchange(t, nodes[i], nodes[j], now)
		checkMass(t, 1e-9, nodes...)
		// Both ends of an exchange estimate the same.
		if ei, ej := nodes[i].estimate(), nodes[j].estimate(); math.Abs(ei[0]-ej[0]) > 1e-12 || math.Abs(ei[1]-ej[1]) > 1e-12 {
			t.Fatalf("after an exchange %s estimates %v, %s %v", nodes[i].cfg.Name, ei[:2], nodes[j].cfg.Name, ej[:2])
		}
	}
	for _, n := range nodes {
		checkEstimate(t, n, 1e-9, 13, 1.0/3)
	}
}

func TestCrossedExchangesAgree(t *testing.T) {
	for _, order := range []string{"a first", "b first"} {
		t.Run(order, func(t *testing.T) {
			a := newNode(t, "a", 1, 10, 1)
			b := newNode(t, "b", 2, 30, 0)
			c := newNode(t, "c", 3, 50, 0)
			exchange(t, a, b, t0)
			exchange(t, b, c, t0)
			now := t0.Add(time.Second)
			// a and b ask each other at once; each answers the other's
			// request before it gets the reply to its own.
			ma, mb := requestTo(t, a, "b", now), requestTo(t, b, "a", now)
			ra, _ := receive(t, b, ma, now)
			rb, _ := receive(t, a, mb, now)
			if order == "a first" {
				receive(t, a, ra, now)
				receive(t, b, rb, now)
			} else {
				receive(t, b, rb, now)
				receive(t, a, ra, now)
			}
			pa, pb := a.lookup("b"), b.lookup("a")
			if pa.stamp != pb.stamp || pa.flow[0] != -pb.flow[0] || pa.flow[1] != -pb.flow[1] {
				t.Fatalf("a holds %v at version %d, b holds %v at version %d", pa.flow[:2], pa.stamp, pb.flow[:2], pb.stamp)
			}
			checkMass(t, 1e-9, a, b, c)
		})
	}
}

func TestDuplicateAndStaleMessagesIgnored(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	m1 := requestTo(t, a, "b", t0)
	r1, _ := receive(t, b, m1, t0)
	if _, ok := receive(t, b, m1, t0); ok {
		t.Fatal("b answered a duplicate request")
	}
	receive(t, a, r1, t0)
	checkMass(t, 1e-9, a, b)

	if err := a.SetInput([]float64{90, 1}); err != nil {
		t.Fatal(err)
	}
	now := t0.Add(time.Second)
	m2 := requestTo(t, a, "b", now)
	r2, _ := receive(t, b, m2, now)
	receive(t, a, r2, now)
	flow := a.lookup("b").flow
	// The old reply and the old request arrive late: nothing changes.
	receive(t, a, r1, now)
	if _, ok := receive(t, b, m1, now); ok {
		t.Fatal("b answered a request older than one it applied")
	}
	if got := a.lookup("b").flow; got != flow {
		t.Fatalf("a stale reply moved a's flow from %v to %v", flow[:2], got[:2])
	}
	checkMass(t, 1e-9, a, b)
	checkEstimate(t, a, 1e-12, 60, 0.5)
	checkEstimate(t, b, 1e-12, 60, 0.5)
}

func TestLostReplyIsRetriedThenGivenUp(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	rng := rand.New(rand.NewPCG(1, 2))
	m := requestTo(t, a, "b", t0)
	receive(t, b, m, t0) // the reply is lost
	var est, in float64
	for _, n := range []*Node{a, b} {
		est, in = est+n.estimate()[0], in+n.input[0]
	}
	if math.Abs(est-in) < 1 {
		t.Fatalf("a lost reply left no mass error (estimates %v, inputs %v)", est, in)
	}
	if _, ok := a.Tick(t0.Add(400*time.Millisecond), nil, rng); ok {
		t.Fatal("a retried before RetryTimeout")
	}
	now := t0.Add(500 * time.Millisecond)
	retry, ok := a.Tick(now, []string{"x"}, rng)
	if !ok || retry.To != "b" || retry.Seq == m.Seq {
		t.Fatalf("a's next tick after RetryTimeout sends %+v, want a new request to b", retry)
	}
	r, _ := receive(t, b, retry, now)
	receive(t, a, r, now)
	checkMass(t, 1e-9, a, b)
	checkEstimate(t, a, 1e-12, 20, 0.5)
	checkEstimate(t, b, 1e-12, 20, 0.5)

	// b stops answering: a sends MaxRetries more, then gives up on b and
	// leaves it alone (no refresh) until it hears from it.
	// (a holds fewer than Peers pairs, so it would draw from peers but for
	// the refresh.)
	now = now.Add(3 * time.Second)
	if m, _ := a.Tick(now, []string{"x"}, rng); m.To != "b" {
		t.Fatalf("a did not refresh its pair with b after Freshness/2: %+v", m)
	}
	for i := range a.cfg.MaxRetries {
		now = now.Add(a.cfg.RetryTimeout)
		if m, ok := a.Tick(now, nil, rng); !ok || m.To != "b" {
			t.Fatalf("retry %d: a sends %+v, want a request to b", i+1, m)
		}
	}
	now = now.Add(a.cfg.RetryTimeout)
	if m, ok := a.Tick(now, nil, rng); ok {
		t.Fatalf("after %d retries a still sends %+v", a.cfg.MaxRetries, m)
	}
	if p := a.lookup("b"); p == nil || p.backoff.IsZero() {
		t.Fatal("a dropped its pair with b, or did not give up on it")
	}

	// A peer never heard from is dropped when given up on.
	now = now.Add(a.cfg.RetryTimeout)
	if m, _ := a.Tick(now, []string{"ghost"}, rng); m.To != "ghost" || a.lookup("ghost") == nil {
		t.Fatalf("a sends %+v, want a pending request to ghost", m)
	}
	for range a.cfg.MaxRetries + 1 {
		now = now.Add(a.cfg.RetryTimeout)
		a.Tick(now, nil, rng)
	}
	if a.lookup("ghost") != nil {
		t.Fatal("a kept a pair with a peer that never answered")
	}
}

func TestForgetRemovesExactlyTheDepartedMass(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	c := newNode(t, "c", 3, 200, 0)
	now := t0
	for range 10 {
		now = now.Add(100 * time.Millisecond)
		exchange(t, a, b, now)
		exchange(t, b, c, now)
		exchange(t, c, a, now)
	}
	checkEstimate(t, a, 1e-3, 80, 1.0/3)
	a.Forget("c")
	b.Forget("c")
	checkMass(t, 1e-9, a, b)
	exchange(t, a, b, now)
	checkEstimate(t, a, 1e-9, 20, 0.5)
	checkEstimate(t, b, 1e-9, 20, 0.5)
	if a.lookup("c") != nil || a.findEntry("c") >= 0 {
		t.Fatal("a still knows c after Forget")
	}
}

func TestSilentPeerDroppedAfterFreshness(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	c := newNode(t, "c", 3, 200, 0)
	exchange(t, c, a, t0)
	exchange(t, c, b, t0)
	// c goes silent; a and b go on exchanging.
	fresh := a.cfg.Freshness
	for d := time.Duration(0); d <= fresh+time.Second; d += 500 * time.Millisecond {
		now := t0.Add(d)
		exchange(t, a, b, now)
		if v := a.Estimate(now); d <= fresh && v.Peers != 2 || d > fresh && v.Peers != 1 {
			t.Fatalf("at %v a holds pair state with %d peers", d, v.Peers)
		}
	}
	checkMass(t, 1e-9, a, b)
	checkEstimate(t, a, 1e-9, 20, 0.5)
}

func TestRestartDropsOldIncarnation(t *testing.T) {
	for _, first := range []string{"survivor asks", "restarted asks"} {
		t.Run(first, func(t *testing.T) {
			a := newNode(t, "a", 1, 10, 1)
			b := newNode(t, "b", 2, 30, 0)
			exchange(t, a, b, t0)
			exchange(t, b, a, t0)
			// A reply from the old b, held back in the network.
			late, _ := receive(t, b, requestTo(t, a, "b", t0), t0)
			now := t0.Add(time.Second)
			b2 := newNode(t, "b", 99, 70, 0)
			if b2.inc == b.inc {
				t.Fatal("same incarnation")
			}
			if first == "survivor asks" {
				exchange(t, a, b2, now)
			} else {
				exchange(t, b2, a, now)
			}
			checkMass(t, 1e-9, a, b2)
			checkEstimate(t, a, 1e-9, 40, 0.5)
			checkEstimate(t, b2, 1e-9, 40, 0.5)
			receive(t, a, late, now)
			checkMass(t, 1e-9, a, b2)
			// A request from the old b, late too, is ignored.
			b.seq = 1000
			if _, ok := receive(t, a, requestTo(t, b, "a", now), now); ok {
				t.Fatal("a answered the old incarnation of b")
			}
			checkMass(t, 1e-9, a, b2)
		})
	}
}

func TestReceiveRejectsForeignMessages(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	good := requestTo(t, a, "b", t0)
	for _, tc := range []struct {
		name   string
		change func(*Message)
		want   string
	}{
		{"misdirected", func(m *Message) { m.To = "c" }, `to "c" received by "b"`},
		{"from itself", func(m *Message) { m.From = "b" }, "to itself"},
		{"other dimension", func(m *Message) { m.Dim = 3 }, "dimension 3, want 2"},
		{"NaN estimate", func(m *Message) { m.Estimate[0] = math.NaN() }, "estimate value NaN"},
		{"infinite flow", func(m *Message) { m.Flow[1] = math.Inf(-1) }, "flow value -Inf"},
		{"huge flow", func(m *Message) { m.Flow[0] = 2e18 }, "flow value 2e+18"},
		{"negative load", func(m *Message) { m.Entries[0].Load = -1 }, "entry load -1"},
		{"no incarnation", func(m *Message) { m.FromIncarnation = 0 }, "incarnation 0"},
	} {
		m := good
		tc.change(&m)
		if _, _, err := b.Receive(t0, m); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
	checkEstimate(t, b, 0, 30, 0)
	if b.lookup("a") != nil {
		t.Fatal("a rejected message made a pair")
	}
}

func TestLowestEntries(t *testing.T) {
	a := newNode(t, "a", 1, 50, 1)
	hop := a.cfg.hopAge()
	msg := func(entries ...Entry) Message {
		m := Message{Kind: Reply, From: "z", To: "a", FromIncarnation: 5, ToIncarnation: a.inc, Dim: 2, NumEntries: len(entries)}
		copy(m.Entries[:], entries)
		return m
	}
	receive(t, a, msg(Entry{Name: "b", Load: 40, Seq: 1}, Entry{Name: "c", Load: 30, Seq: 1, AgeMillis: 1000},
		Entry{Name: "d", Load: 60, Seq: 1}, Entry{Name: "e", Load: 70, Seq: 1}, Entry{Name: "f", Load: 80, Seq: 1}), t0)
	if got := a.Lowest(t0); got.Name != "c" || got.Load != 30 || time.Duration(got.AgeMillis)*time.Millisecond != time.Second+hop {
		t.Fatalf("lowest %+v, want c at 30, aged 1s and a hop", got)
	}
	if len(a.low) != a.cfg.Entries || a.findEntry("f") >= 0 {
		t.Fatalf("a keeps %v, want the %d lowest", a.low, a.cfg.Entries)
	}
	// An older sequence loses; a newer one wins, even when higher.
	receive(t, a, msg(Entry{Name: "c", Load: 1, Seq: 0}), t0)
	if got := a.Lowest(t0); got.Name != "c" || got.Load != 30 {
		t.Fatalf("an older sequence replaced c: %+v", got)
	}
	receive(t, a, msg(Entry{Name: "c", Load: 100, Seq: 2}), t0)
	if got := a.Lowest(t0); got.Name != "b" || got.Load != 40 {
		t.Fatalf("lowest %+v after c rose, want b at 40", got)
	}
	// An entry sent on carries its age, rounded up; this node's own first,
	// then c's newer entry, which keeps its older one's place (see
	// TestLowestStaleCopyRefused).
	m := requestTo(t, a, "b", t0.Add(1500*time.Microsecond))
	if m.NumEntries != 4 || m.Entries[0].Name != "a" || m.Entries[1].Name != "c" || m.Entries[1].Load != 100 ||
		m.Entries[2].Name != "b" || m.Entries[2].AgeMillis != uint32((hop+2*time.Millisecond).Milliseconds()) {
		t.Fatalf("a sends entries %+v", m.Entries[:m.NumEntries])
	}
	// Entries expire after Freshness; this node's own stays.
	if got := a.Lowest(t0.Add(a.cfg.Freshness)); got.Name != "a" {
		t.Fatalf("lowest after Freshness %+v, want a itself", got)
	}
	if len(a.low) != 0 {
		t.Fatalf("entries older than Freshness kept: %v", a.low)
	}
	// Entries too old to keep are not taken in, nor this node's own name.
	receive(t, a, msg(Entry{Name: "g", Load: 1, Seq: 1, AgeMillis: 5000}, Entry{Name: "a", Load: 0, Seq: 1 << 62}), t0)
	if got := a.Lowest(t0); got.Name != "a" || got.Load != 50 {
		t.Fatalf("lowest %+v, want a itself at 50", got)
	}
}

// lowMessage returns a reply from z to n carrying entries.
func lowMessage(n *Node, entries ...Entry) Message {
	m := Message{Kind: Reply, From: "z", To: n.cfg.Name, FromIncarnation: 5, ToIncarnation: n.inc, Dim: 2, NumEntries: len(entries)}
	copy(m.Entries[:], entries)
	return m
}

// TestLowestStaleCopyRefused: a member's newer entry, with a higher load,
// must not be forgotten while its older copies are about, or one of them,
// arriving again from another node, is taken in as new (the bug
// TestSimMassJoinLowest shows at scale).
func TestLowestStaleCopyRefused(t *testing.T) {
	a := newNode(t, "a", 1, 50, 1)
	receive(t, a, lowMessage(a, Entry{Name: "c", Load: 30, Seq: 1}), t0)
	// c's load rises above four others'. Its newer entry would sort out of
	// the Entries lowest; it keeps the older one's place instead.
	receive(t, a, lowMessage(a, Entry{Name: "c", Load: 100, Seq: 2}), t0)
	receive(t, a, lowMessage(a, Entry{Name: "b", Load: 40, Seq: 1}, Entry{Name: "d", Load: 41, Seq: 1},
		Entry{Name: "e", Load: 42, Seq: 1}, Entry{Name: "f", Load: 43, Seq: 1}), t0)
	if i := a.findEntry("c"); i < 0 || a.low[i].seq != 2 || a.findEntry("f") >= 0 {
		t.Fatalf("a keeps %+v, want c's newer entry in its older one's place", a.low)
	}
	// The older copy, still about, comes back from another node: refused,
	// and a sends the newer one on.
	later := t0.Add(time.Second)
	receive(t, a, lowMessage(a, Entry{Name: "c", Load: 30, Seq: 1}), later)
	if got := a.Lowest(later); got.Name != "b" {
		t.Fatalf("lowest %+v after c's older copy came back, want b", got)
	}
	if m := requestTo(t, a, "b", later); m.Entries[1].Name != "c" || m.Entries[1].Seq != 2 {
		t.Fatalf("a sends %+v, want c's newer entry first", m.Entries[:m.NumEntries])
	}
	// Four lower entries evict it: the older copy, ranking below them, is
	// not kept either.
	receive(t, a, lowMessage(a, Entry{Name: "g", Load: 10, Seq: 1}, Entry{Name: "h", Load: 11, Seq: 1},
		Entry{Name: "i", Load: 12, Seq: 1}, Entry{Name: "j", Load: 13, Seq: 1}), later)
	receive(t, a, lowMessage(a, Entry{Name: "c", Load: 30, Seq: 1}), later)
	if a.findEntry("c") >= 0 {
		t.Fatalf("a keeps %+v, want g to j", a.low)
	}
	// Once every older copy has expired (Freshness after the newer entry's
	// origin), the newer one, still refreshed, ranks by its own load.
	b := newNode(t, "b", 2, 50, 1)
	receive(t, b, lowMessage(b, Entry{Name: "c", Load: 30, Seq: 1}), t0)
	receive(t, b, lowMessage(b, Entry{Name: "c", Load: 100, Seq: 2}), t0)
	end := t0.Add(b.cfg.Freshness - b.cfg.hopAge())
	others := []Entry{{Name: "c", Load: 100, Seq: 2}, {Name: "d", Load: 41, Seq: 1}, {Name: "e", Load: 42, Seq: 1},
		{Name: "f", Load: 43, Seq: 1}, {Name: "g", Load: 44, Seq: 1}}
	receive(t, b, lowMessage(b, others...), end.Add(-time.Second))
	receive(t, b, lowMessage(b, others[1:]...), end.Add(-time.Millisecond))
	if b.findEntry("c") < 0 || b.findEntry("g") >= 0 {
		t.Fatalf("b keeps %+v while c's older copies may be about, want c, d, e, f", b.low)
	}
	receive(t, b, lowMessage(b, others[1:]...), end)
	if b.findEntry("c") >= 0 {
		t.Fatalf("b keeps %+v after c's older copies expired, want d to g", b.low)
	}
}

func TestLows(t *testing.T) {
	a := newNode(t, "a", 1, 50, 1)
	// No Tick yet: an entry is current up to Freshness/2 (see currentAge).
	if got := a.currentAge(); got != a.cfg.Freshness/2 {
		t.Fatalf("current age %v, want %v", got, a.cfg.Freshness/2)
	}
	// c is just older than that (a hop ages it too).
	old := uint32((a.cfg.Freshness/2 - a.cfg.hopAge() + time.Millisecond).Milliseconds())
	receive(t, a, lowMessage(a, Entry{Name: "b", Load: 40, Seq: 1}, Entry{Name: "c", Load: 20, Seq: 1, AgeMillis: old},
		Entry{Name: "d", Load: 60, Seq: 1}), t0)
	names := func(lows []Entry) string {
		var s []string
		for _, e := range lows {
			s = append(s, e.Name)
		}
		return strings.Join(s, " ")
	}
	for _, tc := range []struct {
		load float64
		at   time.Duration
		want string
	}{
		// The current ones, b and d, first; this node's own before the
		// first with a higher load.
		{50, 0, "x b a d c"},
		{30, 0, "x a b d c"},
		{10, 0, "x a b d c"},
		// None is current any more: by load.
		{50, a.cfg.Freshness/2 - a.cfg.hopAge() + 2*time.Millisecond, "x c b a d"},
		{30, a.cfg.Freshness/2 - a.cfg.hopAge() + 2*time.Millisecond, "x c a b d"},
	} {
		if err := a.SetInput([]float64{tc.load, 1}); err != nil {
			t.Fatal(err)
		}
		now := t0.Add(tc.at)
		lows := a.Lows(now, []Entry{{Name: "x"}})
		if got := names(lows); got != tc.want {
			t.Errorf("load %v at %v: Lows %q, want %q", tc.load, tc.at, got, tc.want)
		}
		if low := a.Lowest(now); low != lows[1] {
			t.Errorf("load %v at %v: Lowest %+v, Lows %+v", tc.load, tc.at, low, lows)
		}
		for _, e := range lows[1:] {
			if e.Name == "c" && time.Duration(e.AgeMillis)*time.Millisecond != a.cfg.Freshness/2+time.Millisecond+tc.at {
				t.Errorf("c's age %dms at %v", e.AgeMillis, tc.at)
			}
		}
	}
	if allocs := testing.AllocsPerRun(10, func() { a.Lowest(t0) }); allocs != 0 {
		t.Errorf("Lowest allocates %v times", allocs)
	}
	// With the members known (Tick), the hop aging of a trip across them
	// counts too.
	a.Tick(t0, []string{"b", "c", "d", "e", "f", "g", "h"}, rand.New(rand.NewPCG(1, 2)))
	if got, want := a.currentAge(), a.cfg.Freshness/2+3*a.cfg.hopAge(); got != want {
		t.Fatalf("current age with 8 members %v, want %v", got, want)
	}
}

func TestEstimateView(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	b := newNode(t, "b", 2, 30, 0)
	c := newNode(t, "c", 3, 50, 0)
	if v := a.Estimate(t0); v.Peers != 0 || v.Exchanges != 0 || !v.LastExchange.IsZero() || v.Values[0] != 10 {
		t.Fatalf("fresh view %+v", v)
	}
	exchange(t, a, b, t0)
	exchange(t, c, a, t0.Add(time.Second))
	v := a.Estimate(t0.Add(2 * time.Second))
	if v.Peers != 2 || v.Exchanges != 2 || !v.LastExchange.Equal(t0.Add(time.Second)) || v.Dim != 2 {
		t.Fatalf("view %+v, want 2 peers, 2 exchanges, the last at 1s", v)
	}
	// Exchanges older than Freshness (to a bucket) stop counting.
	if v := a.Estimate(t0.Add(a.cfg.Freshness + a.cfg.Freshness/bucketCount)); v.Exchanges != 1 {
		t.Fatalf("view %+v, want the exchange at 1s only", v)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		change func(*Config)
		want   string
	}{
		{func(c *Config) { c.Name = "" }, "Name"},
		{func(c *Config) { c.Name = strings.Repeat("x", 129) }, "129 bytes"},
		{func(c *Config) { c.Dim = 0 }, "Dim 0 is below the minimum 1"},
		{func(c *Config) { c.Dim = 9 }, "Dim 9 is above the maximum 8"},
		{func(c *Config) { c.Entries = 0 }, "Entries 0"},
		{func(c *Config) { c.Entries = 9 }, "Entries 9"},
		{func(c *Config) { c.Peers = 0 }, "Peers 0"},
		{func(c *Config) { c.Peers = 65 }, "Peers 65"},
		{func(c *Config) { c.Freshness = time.Millisecond }, "Freshness 1ms"},
		{func(c *Config) { c.Freshness = 2 * time.Hour }, "Freshness 2h0m0s"},
		{func(c *Config) { c.RetryTimeout = 0 }, "RetryTimeout 0s"},
		{func(c *Config) { c.MaxRetries = -1 }, "MaxRetries -1"},
		{func(c *Config) { c.MaxRetries = 11 }, "MaxRetries 11"},
		{func(c *Config) { c.RetryTimeout = time.Second }, "RetryTimeout 1s × (MaxRetries 2 + 1) must be below Freshness/2 (2.5s)"},
	} {
		c := testConfig("a")
		tc.change(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one containing %q", c, err, tc.want)
		}
		if n, err := New(c, t0, rand.New(rand.NewPCG(1, 1))); n != nil || err == nil {
			t.Errorf("%+v: New accepted it", c)
		}
	}
	if err := testConfig("a").Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestSetInputBounds(t *testing.T) {
	a := newNode(t, "a", 1, 10, 1)
	for _, in := range [][]float64{{1}, {1, 2, 3}, {math.NaN(), 0}, {math.Inf(1), 0}, {-1, 0}, {1, 2e15}} {
		if err := a.SetInput(in); err == nil {
			t.Errorf("SetInput(%v) accepted", in)
		}
	}
	checkEstimate(t, a, 0, 10, 1)
}
