package hoststate

import (
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// observeAt records a round trip of the given latency.
func observeAt(t *Table, s *Stats, latency time.Duration, o Outcome) {
	start := s.Begin()
	t.Observe(s, start-int64(latency), o)
}

func TestTableSharesStateAcrossReloads(t *testing.T) {
	dial := t.Name() + ":80"
	old := NewTable(Config{})
	s := old.Stats(dial)
	observeAt(old, s, 3*time.Millisecond, Success)

	// A reload provisions the new config before the old one is cleaned up.
	next := NewTable(Config{})
	if next.Stats(dial) != s {
		t.Fatal("the new config must see the same state for the same address")
	}
	if References(dial) != 2 {
		t.Fatalf("want 2 references during the reload, got %d", References(dial))
	}
	old.Release()
	old.Release() // idempotent
	if References(dial) != 1 {
		t.Fatalf("want 1 reference after the old config let go, got %d", References(dial))
	}
	if got := next.Stats(dial).Snapshot(monoclock.Now()).Samples; got != 1 {
		t.Fatalf("samples lost across reload: %d", got)
	}
	next.Release()
	if References(dial) != 0 {
		t.Fatalf("state must be released when no config uses it, refs %d", References(dial))
	}
	fresh := NewTable(Config{})
	defer fresh.Release()
	if fresh.Stats(dial) == s {
		t.Fatal("a released address must start afresh")
	}
}

func TestTableStatsAfterReleaseTakesNoReference(t *testing.T) {
	dial := t.Name() + ":80"
	tb := NewTable(Config{})
	tb.Release()
	if tb.Stats(dial) == nil || References(dial) != 0 {
		t.Fatal("a straggler after release must get usable state without a reference")
	}
}

func TestBaselineAndPrior(t *testing.T) {
	tb := NewTable(Config{Prior: 7 * time.Millisecond})
	defer tb.Release()
	if tb.Baseline() != float64(7*time.Millisecond) {
		t.Fatalf("empty pool baseline must be the prior, got %v", tb.Baseline())
	}
	a := tb.Stats(t.Name() + "-a")
	if est := tb.Expected(a, monoclock.Now(), tb.Baseline()); est != float64(7*time.Millisecond) {
		t.Fatalf("unsampled host must get the prior, got %v", est)
	}
	for range 200 {
		observeAt(tb, a, 2*time.Millisecond, Success)
	}
	if b := tb.Baseline(); b < float64(2*time.Millisecond) || b > float64(2100*time.Microsecond) {
		t.Fatalf("baseline should converge to the typical 2ms, got %v", time.Duration(b))
	}
	// Failures do not pull the baseline.
	before := tb.Baseline()
	observeAt(tb, a, time.Second, Failure)
	if tb.Baseline() != before {
		t.Fatal("a failure must not move the pool baseline")
	}
}

func TestAbandonedOnlyRaises(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	s := tb.Stats(t.Name())
	observeAt(tb, s, 10*time.Millisecond, Success)
	observeAt(tb, s, time.Millisecond, Abandoned)
	snap := s.Snapshot(monoclock.Now())
	if snap.Estimate < 10*time.Millisecond || snap.Samples != 1 || snap.Failures != 0 {
		t.Fatalf("a quick abandon must change nothing: %+v", snap)
	}
	observeAt(tb, s, 80*time.Millisecond, Abandoned)
	if est := s.Snapshot(monoclock.Now()).Estimate; est <= 10*time.Millisecond {
		t.Fatalf("a long abandon is a lower bound and must raise the estimate: %v", est)
	}
	if s.Snapshot(monoclock.Now()).Pending != 0 {
		t.Fatal("pending must return to 0")
	}
}

// TestUntriedHostIsTriedAgain: a slow host keeps its estimate while it is
// tried within the horizon; once it has gone a horizon without an attempt
// and has nothing in flight, one request is let through at the pool's
// typical latency, and while that request is in flight the old estimate
// holds, so that one request, not a stampede, tells whether it changed.
func TestUntriedHostIsTriedAgain(t *testing.T) {
	tb := NewTable(Config{Horizon: time.Second})
	defer tb.Release()
	fast, slow := tb.Stats(t.Name()+"-f"), tb.Stats(t.Name()+"-s")
	for range 100 {
		observeAt(tb, fast, 2*time.Millisecond, Success)
	}
	observeAt(tb, slow, 200*time.Millisecond, Success)
	now := monoclock.Now()
	base := tb.Baseline()
	if base > float64(10*time.Millisecond) {
		t.Fatalf("baseline %v: one slow answer must not dominate the pool's typical latency", time.Duration(base))
	}
	if e := tb.Expected(slow, now+int64(900*time.Millisecond), base); e < float64(150*time.Millisecond) {
		t.Fatalf("within the horizon the slow host must look slow, got %v", time.Duration(e))
	}
	later := now + int64(time.Second)
	if e := tb.Expected(slow, later, base); e != base {
		t.Fatalf("after a horizon untried the host must be tried at the baseline %v, got %v", time.Duration(base), time.Duration(e))
	}
	slow.BeginAt(later)
	if e := tb.Expected(slow, later+int64(time.Millisecond), base); e < float64(150*time.Millisecond) {
		t.Fatalf("while the trial request is in flight the old estimate must hold, got %v", time.Duration(e))
	}
	tb.ObserveAt(slow, later, later+int64(3*time.Millisecond), Success)
	if e := tb.Expected(slow, later+int64(4*time.Millisecond), base); e > float64(5*time.Millisecond) {
		t.Fatalf("a recovered host's one fast answer must be believed (old ones are past the horizon), got %v", time.Duration(e))
	}
}

// TestStallIsSeenAsItHappens: a host with requests in flight that has
// finished nothing for longer than its estimate is expected to be that
// slow, before any late answer arrives.
func TestStallIsSeenAsItHappens(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	s := tb.Stats(t.Name())
	for range 20 {
		observeAt(tb, s, 2*time.Millisecond, Success)
	}
	now := monoclock.Now()
	s.BeginAt(now)
	if e := tb.Expected(s, now+int64(time.Millisecond), tb.Baseline()); e > float64(3*time.Millisecond) {
		t.Fatalf("1 ms into a request the host is not stalled: %v", time.Duration(e))
	}
	if e := tb.Expected(s, now+int64(50*time.Millisecond), tb.Baseline()); e < float64(50*time.Millisecond) {
		t.Fatalf("50 ms without an answer must be expected to cost 50 ms, got %v", time.Duration(e))
	}
}

// TestAbandonedStallGoesOn: a hedge gives up on a stalled host's only
// request. Nothing is in flight any more, yet the stall it revealed goes
// on counting (a frozen host does not look idle and fresh the moment its
// loser is cancelled) until the host answers something, or until it has
// lasted as long again, when the host is let back to show how it is.
func TestAbandonedStallGoesOn(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	s := tb.Stats(t.Name())
	for range 20 {
		observeAt(tb, s, 2*time.Millisecond, Success)
	}
	ms := int64(time.Millisecond)
	t0 := monoclock.Now() + 10*ms // after every answer above
	s.BeginAt(t0)
	tb.ObserveAt(s, t0, t0+15*ms, Abandoned)
	if p := s.Snapshot(t0 + 15*ms).Pending; p != 0 {
		t.Fatalf("pending %d after the abandon; want 0", p)
	}
	if e := tb.Expected(s, t0+20*ms, tb.Baseline()); e < float64(20*ms) {
		t.Fatalf("5 ms after abandoning a request stuck for 15 ms: expected %v, want the 20 ms stall so far", time.Duration(e))
	}
	// A new request does not restart the stall's clock.
	s.BeginAt(t0 + 21*ms)
	if e := tb.Expected(s, t0+25*ms, tb.Baseline()); e < float64(25*ms) {
		t.Fatalf("with a new request in flight: expected %v, want the 25 ms stall", time.Duration(e))
	}
	tb.ObserveAt(s, t0+21*ms, t0+26*ms, Abandoned)
	// The second abandon saw 26 ms of stall: it goes on to 52 ms.
	if e := tb.Expected(s, t0+50*ms, tb.Baseline()); e < float64(50*ms) {
		t.Fatalf("before the stall's end: expected %v, want 50 ms", time.Duration(e))
	}
	if e := tb.Expected(s, t0+53*ms, tb.Baseline()); e > float64(10*ms) {
		t.Fatalf("after the stall's end the host is judged by its answers again: expected %v", time.Duration(e))
	}

	// An answer ends a known stall at once.
	t1 := t0 + 60*ms
	s.BeginAt(t1)
	tb.ObserveAt(s, t1, t1+30*ms, Abandoned)
	s.BeginAt(t1 + 31*ms)
	tb.ObserveAt(s, t1+31*ms, t1+33*ms, Success)
	if e := tb.Expected(s, t1+34*ms, tb.Baseline()); e > float64(10*ms) {
		t.Fatalf("after an answer: expected %v, want the answers' estimate again", time.Duration(e))
	}
	// A quick abandon (under the estimate) reveals no stall.
	t2 := t1 + 40*ms
	s.BeginAt(t2)
	tb.ObserveAt(s, t2, t2+ms, Abandoned)
	if e := tb.Expected(s, t2+2*ms, tb.Baseline()); e > float64(10*ms) {
		t.Fatalf("after a quick abandon: expected %v", time.Duration(e))
	}
}

func TestConcurrentObserve(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 500 {
				s := tb.Stats(t.Name() + string(rune('a'+(g+i)%5)))
				observeAt(tb, s, time.Duration(1+i%4)*time.Millisecond, Outcome(i%3))
				_ = tb.Expected(s, monoclock.Latest(), tb.Baseline())
			}
		})
	}
	wg.Wait()
	var samples uint64
	for _, snap := range All() {
		samples += snap.Samples
	}
	// Success and Failure count as samples; short Abandoned ones do not.
	if samples < 8*500*2/3-10 {
		t.Fatalf("lost samples: %d", samples)
	}
}

// TestFirstFailureOfNewHostIsNotFast: a host never sampled that fails in
// 100µs has no estimate of its own to double; it is charged at least twice
// the pool's typical latency, so the retry of that very request does not
// pick it again as the "fastest" upstream.
func TestFirstFailureOfNewHostIsNotFast(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	ok, hole := tb.Stats(t.Name()+"-ok"), tb.Stats(t.Name()+"-hole")
	for range 20 {
		observeAt(tb, ok, 2*time.Millisecond, Success)
	}
	base := tb.Baseline()
	observeAt(tb, hole, 100*time.Microsecond, Failure)
	if e := tb.Expected(hole, monoclock.Now(), base); e < 2*base {
		t.Fatalf("a new host's first fast failure is estimated at %v; want at least twice the pool's %v",
			time.Duration(e), time.Duration(base))
	}
}

// TestTableDropBoundsChurn: a table whose upstream list churns keeps
// references only on the addresses it still uses, and the addresses that
// stay keep their estimates.
func TestTableDropBoundsChurn(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	stable := tb.Stats(t.Name() + "-stable:80")
	observeAt(tb, stable, 3*time.Millisecond, Success)
	want := stable.Snapshot(monoclock.Now()).Estimate

	const rounds, perRound = 50, 100
	var prev []string
	for r := range rounds {
		cur := make([]string, perRound)
		for i := range cur {
			cur[i] = t.Name() + "-" + strconv.Itoa(r) + "-" + strconv.Itoa(i) + ":80"
			observeAt(tb, tb.Stats(cur[i]), time.Millisecond, Success)
		}
		for _, d := range prev {
			tb.Drop(d)
		}
		prev = cur
		if n := tb.Len(); n != perRound+1 {
			t.Fatalf("round %d: the table holds %d addresses; want the %d in use", r, n, perRound+1)
		}
	}
	if n := References(t.Name() + "-0-0:80"); n != 0 {
		t.Errorf("an address that left the list keeps %d references", n)
	}
	if tb.Stats(t.Name()+"-stable:80") != stable || stable.Snapshot(monoclock.Now()).Estimate != want {
		t.Error("the address that stayed lost its state")
	}
	if s, ok := tb.Lookup(t.Name() + "-0-0:80"); ok || s != nil {
		t.Error("a dropped address is still looked up")
	}
}

// TestTableDropKeepsSharedState: dropping an address one table no longer
// uses keeps its state for another table that still does (the next config
// of a reload), and dropping after Release changes nothing.
func TestTableDropKeepsSharedState(t *testing.T) {
	dial := t.Name() + ":80"
	old, next := NewTable(Config{}), NewTable(Config{})
	defer next.Release()
	s := old.Stats(dial)
	observeAt(old, s, 2*time.Millisecond, Success)
	if next.Stats(dial) != s {
		t.Fatal("tables must share an address's state")
	}
	old.Drop(dial)
	old.Drop(dial) // idempotent
	if References(dial) != 1 || next.Stats(dial) != s || s.Snapshot(monoclock.Now()).Samples != 1 {
		t.Fatalf("the state must survive for the table still using it: refs %d", References(dial))
	}
	old.Release()
	next.Release()
	next.Drop(dial)
	if References(dial) != 0 {
		t.Fatalf("refs %d after release", References(dial))
	}
}

// TestTableConcurrentStatsAndDrop: adding, looking up and dropping
// addresses from several goroutines leaves the table and the shared
// registry in agreement (run with -race).
func TestTableConcurrentStatsAndDrop(t *testing.T) {
	tb := NewTable(Config{})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 400 {
				d := t.Name() + "-" + strconv.Itoa(i%20) + ":80"
				if (g+i)%3 == 0 {
					tb.Drop(d)
				} else {
					_ = tb.Stats(d)
				}
			}
		})
	}
	wg.Wait()
	held := 0
	for i := range 20 {
		d := t.Name() + "-" + strconv.Itoa(i) + ":80"
		_, ok := tb.Lookup(d)
		if refs := References(d); (refs == 1) != ok || refs > 1 {
			t.Fatalf("%s: in table %v, %d references", d, ok, refs)
		}
		if ok {
			held++
		}
	}
	if held != tb.Len() {
		t.Fatalf("Len %d, held %d", tb.Len(), held)
	}
	tb.Release()
	for i := range 20 {
		if refs := References(t.Name() + "-" + strconv.Itoa(i) + ":80"); refs != 0 {
			t.Fatalf("refs %d after release", refs)
		}
	}
}

func TestTableDropIdle(t *testing.T) {
	table := NewTable(Config{})
	t.Cleanup(table.Release)
	name := func(s string) string { return t.Name() + "-" + s + ":80" }
	table.Stats(name("idle"))
	table.Stats(name("kept"))
	busy, inFlight, ejected := table.Stats(name("busy")), table.Stats(name("inflight")), table.Stats(name("ejected"))
	const idleFor = 10 * time.Minute
	later := monoclock.Now() + int64(idleFor) + int64(time.Minute)
	busy.lastDoneNs.Store(later - int64(time.Second)) // an attempt a second ago
	inFlight.Begin()
	defer inFlight.pending.Add(-1)
	ejected.ejectedUntilNs.Store(later - int64(time.Minute)) // ejection ended a minute ago
	n := table.DropIdle(later, idleFor, func(dial string) bool { return dial == name("kept") })
	if n != 1 {
		t.Errorf("dropped %d; want 1 (the idle one)", n)
	}
	if _, ok := table.Lookup(name("idle")); ok {
		t.Error("the idle address is still held")
	}
	for _, d := range []string{"busy", "inflight", "ejected", "kept"} {
		if _, ok := table.Lookup(name(d)); !ok {
			t.Errorf("%s was dropped", d)
		}
	}
	if n := table.DropIdle(monoclock.Now(), idleFor, func(string) bool { return false }); n != 0 {
		t.Errorf("dropped %d addresses just created", n)
	}
}
