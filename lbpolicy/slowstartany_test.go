package lbpolicy

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// rampSecond is one second of a simulated clock: the ramp's start is
// moved back by it, rather than a test waiting for real seconds.
const rampSecond = int64(time.Second)

// servedAll records one successful round trip on every member of pool in
// table, as the observing transport would: the pool is serving.
func servedAll(table *hoststate.Table, pool reverseproxy.UpstreamPool) {
	for _, u := range pool {
		st := table.Stats(u.Dial)
		table.Observe(st, st.Begin()-int64(time.Millisecond), hoststate.Success)
	}
}

// rampShares steps a simulated clock through a 10-second ramp of
// ramping's state and returns, for each simulated second, the share of
// picks (made by pick) that went to target, relative to the share it has
// off the ramp (full). The pool's recent picks (in table) are forgotten
// at each simulated second, as real seconds would.
func rampShares(t *testing.T, table *hoststate.Table, pool reverseproxy.UpstreamPool, ramping *hoststate.Stats, full float64, picks int, pick func() bool) []float64 {
	t.Helper()
	const seconds = 12 // the 10 s window, and two after it
	out := make([]float64, 0, seconds)
	for sec := range seconds {
		ramping.StartRamp(monoclock.Now() - int64(sec)*rampSecond)
		for _, u := range pool {
			table.Stats(u.Dial).ForgetPicks()
		}
		hits := 0
		for range picks {
			if pick() {
				hits++
			}
		}
		out = append(out, float64(hits)/float64(picks)/full)
	}
	return out
}

// checkRamp compares relative shares per simulated second of a 10 s
// linear ramp with a floor of 10% with share(min(1, max(0.1, sec/10))):
// each within tol, rising over the window, below full in the first second
// and full after the window.
func checkRamp(t *testing.T, got []float64, expect func(factor float64) float64, tol float64) {
	t.Helper()
	for sec, share := range got {
		want := expect(math.Min(1, math.Max(0.1, float64(sec)/10)))
		t.Logf("simulated second %2d: relative share %.3f, want %.3f", sec, share, want)
		if math.Abs(share-want) > tol {
			t.Errorf("simulated second %d: relative share %.3f, want %.3f ± %.2f", sec, share, want, tol)
		}
	}
	if got[0] > 0.3 {
		t.Errorf("first second: relative share %.3f, want well below full", got[0])
	}
	if got[2] <= got[0] || got[5] <= got[2] || got[8] <= got[5] {
		t.Errorf("shares do not rise over the window: %.3f", got)
	}
	if got[11] < 1-tol {
		t.Errorf("after the window: relative share %.3f, want full", got[11])
	}
}

// TestPanicSlowStartFollowsRamp: behind the panic wrapper, a ramping
// upstream's share follows its factor min(1, max(floor, elapsed /
// window)), second by simulated second. least_conn (all idle: ties, drawn
// at random) gives it factor × its full share. round_robin's cursor moves
// on with each ask, so a passed-over upstream's turn comes round sooner:
// of n, it gets factor / (n − 1 + factor), the share of an upstream whose
// weight is factor × the others' (Envoy's reading of a ramp).
func TestPanicSlowStartFollowsRamp(t *testing.T) {
	const n = 4
	for _, tc := range []struct {
		inner string
		share func(f float64) float64 // relative to the full share, 1/n
	}{
		{"round_robin", func(f float64) float64 { return n * f / (n - 1 + f) }},
		{"least_conn", func(f float64) float64 { return f }},
	} {
		inner := tc.inner
		t.Run(inner, func(t *testing.T) {
			p := provisionPanic(t, &PanicSelection{
				PolicyRaw: json.RawMessage(fmt.Sprintf(`{"policy": %q}`, inner)),
				SlowStart: &SlowStart{Window: caddy.Duration(10 * time.Second)},
			})
			pool := newPool(t, n)
			p.Select(pool, nil, nil)
			servedAll(p.table, pool)
			ramping := p.table.Stats(pool[3].Dial)
			got := rampShares(t, p.table, pool, ramping, 1.0/n, 8000, func() bool { return p.Select(pool, nil, nil) == pool[3] })
			checkRamp(t, got, tc.share, 0.05)
		})
	}
}

// TestPanicSlowStartTriggers: a member new to a serving pool ramps (and
// none does in a new pool), a member Caddy sees healthy again ramps, the
// end of an ejection ramps, and in panic mode no ramp applies.
func TestPanicSlowStartTriggers(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy": "round_robin"}`),
		SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)},
	})
	fresh := newPool(t, 3)
	p.Select(fresh, nil, nil)
	now := monoclock.Now()
	for _, u := range fresh {
		if r := p.table.Stats(u.Dial).RampStart(now); r != 0 {
			t.Fatalf("%s ramps in a pool where nobody served yet", u.Dial)
		}
	}
	servedAll(p.table, fresh)
	grown := append(fresh[:3:3], newPool(t, 4)[3])
	before := monoclock.Now()
	p.Select(grown, nil, nil)
	if r := p.table.Stats(grown[3].Dial).RampStart(monoclock.Now()); r < before {
		t.Fatalf("joining member: ramp start %d, want at least %d", r, before)
	}
	rep := p.poolStatuses()
	found := false
	for _, st := range rep {
		if len(st.Upstreams) == 4 {
			found = true
			if pct := st.Upstreams[3].SlowStartPercent; pct == nil || *pct != 10 {
				t.Errorf("report of the joining member: %v, want 10%%", fmtPercent(pct))
			}
			if st.SlowStart != "1m0s" {
				t.Errorf("report's slow_start %q, want 1m0s", st.SlowStart)
			}
		}
	}
	if !found {
		t.Fatal("no report of the grown pool")
	}

	// back from Caddy-unhealthy: the count that sees it healthy again
	v := p.viewFor(fresh)
	v.noteHealth(1, false, monoclock.Now())
	at := monoclock.Now()
	v.noteHealth(1, true, at)
	if r := p.table.Stats(fresh[1].Dial).RampStart(at); r != at {
		t.Fatalf("healthy again: ramp start %d, want %d", r, at)
	}

	// the end of an ejection
	st := p.table.Stats(fresh[2].Dial)
	if _, _, ok := st.Eject(monoclock.Now(), time.Hour, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("ejecting")
	}
	back := monoclock.Now()
	st.Restore(back)
	if r := st.RampStart(monoclock.Now()); r != back {
		t.Fatalf("after ejection: ramp start %d, want %d", r, back)
	}
}

// TestPanicSlowStartOffInPanic: in panic mode a ramping upstream gets its
// full share, the pool being short of capacity.
func TestPanicSlowStartOffInPanic(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy": "round_robin"}`),
		Threshold: percent(100), // any unavailable member means panic
		SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)},
	})
	pool := newPool(t, 4)
	p.Select(pool, nil, nil)
	servedAll(p.table, pool)
	// pool[0] ejected (by another policy's detector: the state is per
	// address): 3 of 4 available
	if _, _, ok := p.table.Stats(pool[0].Dial).Eject(monoclock.Now(), time.Hour, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("ejecting")
	}
	p.table.Stats(pool[3].Dial).StartRamp(monoclock.Now())
	p.views.last.Load().countedAt.Store(-countEvery)
	hits := 0
	for range 4000 {
		if p.Select(pool, nil, nil) == pool[3] {
			hits++
		}
	}
	if !p.views.last.Load().panic.on.Load() {
		t.Fatal("pool not in panic mode")
	}
	if share := float64(hits) / 4000; share < 0.22 {
		t.Fatalf("in panic mode the ramping member's share is %.3f, want its full quarter", share)
	}
}

// TestPanicSlowStartNeverRefuses: with every member ramping at the floor,
// every selection still chooses one.
func TestPanicSlowStartNeverRefuses(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy": "random"}`),
		SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)},
	})
	pool := newPool(t, 6)
	p.Select(pool, nil, nil)
	now := monoclock.Now()
	for _, u := range pool {
		p.table.Stats(u.Dial).StartRamp(now)
	}
	for i := range 2000 {
		if p.Select(pool, nil, nil) == nil {
			t.Fatalf("selection %d chose nothing", i)
		}
	}
}

// TestPanicSlowStartCaddyfile reads the panic wrapper's slow_start and its
// errors, each naming its line.
func TestPanicSlowStartCaddyfile(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{in: "panic {\n\tslow_start 30s {\n\t\tmin_weight 20%\n\t\taggression 1.5\n\t}\n\tpolicy round_robin\n}", want: `{"selection_policy":{"policy":"round_robin"},"slow_start":{"window":30000000000,"min_weight_percent":20,"aggression":1.5}}`},
		{in: "panic {\n\tslow_start\n}", err: "lb_policy panic: slow_start: missing value, at Testfile:2"},
		{in: "panic {\n\tslow_start 0s\n}", err: "lb_policy panic: slow_start: window 0s is below the minimum 1ms, at Testfile:2"},
		{in: "panic {\n\tslow_start 30s {\n\t\tramp 2\n\t}\n}", err: `lb_policy panic: slow_start: unknown option "ramp" (want min_weight or aggression), at Testfile:3`},
		{in: "panic {\n\tslow_start 30s\n\tslow_start 40s\n}", err: "lb_policy panic: slow_start specified more than once, at Testfile:3"},
		{in: "panic {\n\tpolicy least_time\n\tslow_start 30s\n}", err: "panic: configure slow_start inside the least_time policy, not around it, at Testfile:3"},
		{in: "panic {\n\tslow_start 30s\n\tpolicy ewma\n}", err: "panic: configure slow_start inside the ewma policy, not around it, at Testfile:3"},
	} {
		var p PanicSelection
		err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if tc.err != "" {
			if err == nil || err.Error() != tc.err {
				t.Errorf("%q: got error %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		b, err := json.Marshal(&p)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(b); got != tc.want {
			t.Errorf("%q: got %s, want %s", tc.in, got, tc.want)
		}
	}
}

// hashKeys returns n distinct URIs, keys of the default key.
func hashKeys(n int) []string {
	keys := make([]string, n)
	for k := range keys {
		keys[k] = fmt.Sprintf("/object/%d", k)
	}
	return keys
}

// owners returns the upstream a request for each key goes to (each a new
// request: a request seen before would be a retry, avoiding what it
// tried).
func owners(s *ConsistentHashSelection, pool reverseproxy.UpstreamPool, keys []string) []*reverseproxy.Upstream {
	got := make([]*reverseproxy.Upstream, len(keys))
	for k, key := range keys {
		got[k] = s.Select(pool, hashRequest(key), nil)
	}
	return got
}

// TestConsistentHashSlowStartFollowsRamp: a ramping upstream keeps each of
// its keys while the key's draw is below its factor, so its share of keys
// follows the ramp second by simulated second; a key it took back stays
// with it as the ramp rises, and a key it passes on goes elsewhere on the
// ring, to several upstreams.
func TestConsistentHashSlowStartFollowsRamp(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{SlowStart: &SlowStart{Window: caddy.Duration(10 * time.Second)}})
	pool := newPool(t, 4)
	keys := hashKeys(8000)
	home := owners(s, pool, keys) // not ramping: every key at its owner
	servedAll(s.table, pool)
	mine := 0
	for _, u := range home {
		if u == pool[3] {
			mine++
		}
	}
	if mine < 1500 {
		t.Fatalf("pool[3] owns %d of 8000 keys; want about a quarter", mine)
	}
	ramping := s.table.Stats(pool[3].Dial)
	var prev map[int]bool
	got := make([]float64, 0, 12)
	for sec := range 12 {
		ramping.StartRamp(monoclock.Now() - int64(sec)*rampSecond)
		now := owners(s, pool, keys)
		kept := map[int]bool{}
		elsewhere := map[*reverseproxy.Upstream]bool{}
		for k, u := range now {
			switch {
			case u == pool[3]:
				kept[k] = true
				if home[k] != pool[3] {
					t.Fatalf("second %d: key %d moved to the ramping upstream from %s", sec, k, home[k].Dial)
				}
			case home[k] == pool[3]:
				elsewhere[u] = true
			case u != home[k]:
				t.Fatalf("second %d: key %d of %s moved to %s", sec, k, home[k].Dial, u.Dial)
			}
		}
		for k := range prev {
			if !kept[k] {
				t.Fatalf("second %d: key %d, back at the ramping upstream, left it again", sec, k)
			}
		}
		prev = kept
		if sec < 9 && len(elsewhere) < 3 {
			t.Errorf("second %d: passed-on keys went to %d upstreams, want all 3 others", sec, len(elsewhere))
		}
		got = append(got, float64(len(kept))/float64(mine))
	}
	checkRamp(t, got, func(f float64) float64 { return f }, 0.05)
}

// TestConsistentHashOutlier: an ejected upstream is passed over on the
// ring: only its keys move, spread over the others, and it counts as
// unavailable; at the end of its ejection it ramps back with slow start.
func TestConsistentHashOutlier(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{
		Outlier:   &Outlier{},
		SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)},
	})
	pool := newPool(t, 4)
	keys := hashKeys(4000)
	home := owners(s, pool, keys)
	servedAll(s.table, pool)
	st := s.table.Stats(pool[1].Dial)
	if _, _, ok := st.Eject(monoclock.Now(), time.Hour, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("ejecting")
	}
	moved := map[*reverseproxy.Upstream]int{}
	for k, u := range owners(s, pool, keys) {
		switch {
		case u == pool[1]:
			t.Fatalf("key %d went to the ejected upstream", k)
		case home[k] == pool[1]:
			moved[u]++
		case u != home[k]:
			t.Fatalf("key %d of %s moved to %s", k, home[k].Dial, u.Dial)
		}
	}
	if len(moved) != 3 {
		t.Fatalf("the ejected upstream's keys went to %d upstreams, want the 3 others: %v", len(moved), moved)
	}
	var rep poolStatus
	for _, r := range s.poolStatuses() {
		rep = r
	}
	if rep.Available != 3 || rep.Upstreams[1].Available {
		t.Fatalf("report: %d available, ejected one available %v", rep.Available, rep.Upstreams[1].Available)
	}
	if !s.SkipsEjected() {
		t.Fatal("SkipsEjected false with an outlier block")
	}

	st.Restore(monoclock.Now())
	back := 0
	for k, u := range owners(s, pool, keys) {
		if u == pool[1] {
			back++
			if home[k] != pool[1] {
				t.Fatalf("key %d moved to the returning upstream", k)
			}
		}
	}
	ownKeys := 0
	for _, u := range home {
		if u == pool[1] {
			ownKeys++
		}
	}
	// at the floor of its ramp: about a tenth of its keys
	if f := float64(back) / float64(ownKeys); f < 0.05 || f > 0.16 {
		t.Fatalf("right after its ejection the upstream has %.3f of its keys, want about 0.1", f)
	}
}

// TestConsistentHashSlowStartNeverRefuses: with every upstream ramping at
// the floor, every key still goes somewhere, empty keys too.
func TestConsistentHashSlowStartNeverRefuses(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)}})
	pool := newPool(t, 3)
	s.Select(pool, nil, nil)
	now := monoclock.Now()
	for _, u := range pool {
		s.table.Stats(u.Dial).StartRamp(now)
	}
	for k, key := range append(hashKeys(1000), "") {
		r := hashRequest("/" + key)
		if key == "" {
			r = nil // no key
		}
		if s.Select(pool, r, nil) == nil {
			t.Fatalf("request %d chose nothing", k)
		}
	}
}

// leastHeld is a stand-in for least_conn under load: it chooses the
// upstream holding the fewest of the requests the test keeps in flight
// (ties to the first), as Caddy's least_conn does by NumRequests.
type leastHeld struct{ held map[string]int }

func (l *leastHeld) Select(pool reverseproxy.UpstreamPool, _ *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	var best *reverseproxy.Upstream
	for _, u := range pool {
		if best == nil || l.held[u.Dial] < l.held[best.Dial] {
			best = u
		}
	}
	return best
}

// TestPanicSlowStartHoldsLoadSeeker: a wrapped policy that seeks the least
// loaded offers a ramping upstream, which holds fewer requests, at nearly
// every choice; the ramp still holds it to its share. A closed loop keeps
// 32 requests in flight over 4 upstreams and ends one at random before
// each new selection. Without the cap on recent picks (the draw alone) its
// share in the first simulated second is 0.4 of full, not 0.1.
func TestPanicSlowStartHoldsLoadSeeker(t *testing.T) {
	const n, inFlight = 4, 32
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy": "least_conn"}`),
		SlowStart: &SlowStart{Window: caddy.Duration(10 * time.Second)},
	})
	pool := newPool(t, n)
	p.Select(pool, nil, nil)
	servedAll(p.table, pool)
	inner := &leastHeld{held: map[string]int{}}
	p.inner = inner
	rng := rand.New(rand.NewPCG(1, 2))
	var running []string
	for len(running) < inFlight {
		u := pool[len(running)%n]
		running = append(running, u.Dial)
		inner.held[u.Dial]++
	}
	ramping := p.table.Stats(pool[3].Dial)
	got := rampShares(t, p.table, pool, ramping, 1.0/n, 8000, func() bool {
		i := rng.IntN(len(running))
		inner.held[running[i]]--
		u := p.Select(pool, nil, nil)
		running[i] = u.Dial
		inner.held[u.Dial]++
		return u == pool[3]
	})
	// held to weight f against the others: 4f/(3+f) of full
	checkRamp(t, got, func(f float64) float64 { return n * f / (n - 1 + f) }, 0.05)
}
