package lbpolicy

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// newPool returns n upstreams with Caddy host records, as reverse_proxy
// would provision them, with dial addresses unique to the test.
func newPool(t testing.TB, n int) reverseproxy.UpstreamPool {
	pool := make(reverseproxy.UpstreamPool, n)
	for i := range pool {
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("%s-%d:80", t.Name(), i)}
	}
	return pool
}

func provisionLeastTime(t testing.TB, s *LeastTimeSelection) *LeastTimeSelection {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Cleanup() })
	return s
}

// observe feeds one round trip of the given latency into the policy's state.
func observe(s *LeastTimeSelection, u *reverseproxy.Upstream, latency time.Duration, outcome hoststate.Outcome) {
	st := s.table.Stats(u.Dial)
	start := st.Begin()
	s.table.Observe(st, start-int64(latency), outcome)
}

func shares(s *LeastTimeSelection, pool reverseproxy.UpstreamPool, picks int) map[*reverseproxy.Upstream]int {
	counts := map[*reverseproxy.Upstream]int{}
	for range picks {
		counts[s.Select(pool, nil, nil)]++
	}
	return counts
}

func TestLeastTimeAvoidsSlowUpstream(t *testing.T) {
	for _, choices := range []Choices{choicesAuto, choicesAll, 2} {
		t.Run(choices.String(), func(t *testing.T) {
			s := provisionLeastTime(t, &LeastTimeSelection{Choices: choices})
			pool := newPool(t, 4)
			for _, u := range pool {
				observe(s, u, 2*time.Millisecond, hoststate.Success)
			}
			observe(s, pool[2], 40*time.Millisecond, hoststate.Success)
			counts := shares(s, pool, 2000)
			if counts[pool[2]] != 0 {
				t.Fatalf("slow upstream chosen %d times of 2000", counts[pool[2]])
			}
		})
	}
}

func TestLeastTimeFastFailingUpstreamIsNotCheap(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{})
	pool := newPool(t, 3)
	for _, u := range pool {
		observe(s, u, 5*time.Millisecond, hoststate.Success)
	}
	// pool[0] now refuses connections in 50µs, repeatedly.
	for range 3 {
		observe(s, pool[0], 50*time.Microsecond, hoststate.Failure)
	}
	if n := shares(s, pool, 1000)[pool[0]]; n != 0 {
		t.Fatalf("fast-failing upstream chosen %d times of 1000", n)
	}
	if got := s.table.Expected(s.table.Stats(pool[0].Dial), monoclock.Now(), s.table.Baseline()); got < float64(30*time.Millisecond) {
		t.Fatalf("three fast failures from 5ms should cost ≥ 40ms, estimate is %v", time.Duration(got))
	}
}

// TestEWMAPartlyFailingUpstreamIsPriced: an upstream as fast as the
// other but failing one attempt in five (never twice in a row, so no
// failure streak) is charged for it: idle and equally fast, the healthy
// one wins every time. Without the failure price in Cost the two tie and
// each gets about half.
func TestLeastTimePartlyFailingUpstreamIsPriced(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{})
	pool := newPool(t, 2)
	for i := range 40 {
		observe(s, pool[1], 2*time.Millisecond, hoststate.Success)
		if i%5 == 2 {
			observe(s, pool[0], 50*time.Microsecond, hoststate.Failure)
		} else {
			observe(s, pool[0], 2*time.Millisecond, hoststate.Success)
		}
	}
	st := s.table.Stats(pool[0].Dial)
	if f := st.FailureRatio(monoclock.Now()); f < 0.15 || f > 0.25 {
		t.Fatalf("failure ratio after 8 failures in 40 attempts is %.3f; want about 0.2", f)
	}
	if n := shares(s, pool, 1000)[pool[0]]; n != 0 {
		t.Fatalf("the partly failing upstream was chosen %d times of 1000 against an equally fast healthy one", n)
	}
	now := monoclock.Now()
	if sel, exp := s.table.SelectionLatency(st, now), s.table.Expected(st, now, s.table.Baseline()); sel < 1.4*exp {
		t.Fatalf("SelectionLatency %v of the partly failing upstream does not include its failure price (Expected %v)",
			time.Duration(sel), time.Duration(exp))
	}
}

func TestLeastTimeNewUpstreamGetsPrior(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{})
	pool := newPool(t, 4)
	for i, u := range pool[:3] {
		for range 10 {
			observe(s, u, time.Duration(2+3*i)*time.Millisecond, hoststate.Success)
		}
	}
	now := monoclock.Now()
	fresh := s.table.Expected(s.table.Stats(pool[3].Dial), now, s.table.Baseline())
	// The prior is the pool's typical latency: between its fastest and
	// slowest member, so the newcomer is neither a magnet (zero) nor
	// starved (infinite).
	if fresh <= float64(2*time.Millisecond) || fresh >= float64(8*time.Millisecond) {
		t.Fatalf("a new upstream must start at the pool's typical latency (2–8ms), got %v", time.Duration(fresh))
	}
	counts := shares(s, pool, 1000)
	if counts[pool[0]] != 1000 {
		t.Fatalf("the measured-fastest upstream must win over a newcomer at idle: %d of 1000", counts[pool[0]])
	}
}

func TestLeastTimeWeights(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{Weights: []int{1, 4}})
	pool := newPool(t, 2)
	for _, u := range pool {
		observe(s, u, 2*time.Millisecond, hoststate.Success)
	}
	v := s.viewFor(pool)
	if v.members[0].invWeight != 1 || v.members[1].invWeight != 0.25 {
		t.Fatalf("weights not applied in upstream order: %+v", v.members)
	}
	// With equal latency and nothing in flight, the heavier upstream is
	// cheaper: it is taken to serve four times the concurrency.
	if n := shares(s, pool, 200)[pool[1]]; n != 200 {
		t.Fatalf("weight 4 upstream got %d of 200 idle picks", n)
	}
}

func TestLeastTimePanicIgnoresHealthButNotFull(t *testing.T) {
	// Availability is Caddy's own: here an upstream with max_requests 0
	// is never full, so the no-upstream case is the empty pool.
	s := provisionLeastTime(t, &LeastTimeSelection{})
	if s.Select(nil, nil, nil) != nil {
		t.Fatal("empty pool must yield nil")
	}
	for _, choices := range []Choices{choicesAuto, choicesAll, 2, 3} {
		s := provisionLeastTime(t, &LeastTimeSelection{Choices: choices})
		for n := 1; n <= 3; n++ {
			pool := newPool(t, n)
			for range 50 {
				if u := s.Select(pool, nil, nil); !contains(pool, u) {
					t.Fatalf("choices %v, pool of %d: picked %v", choices, n, u)
				}
			}
		}
	}
}

func TestLeastTimeViewFollowsPoolChanges(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{})
	a, b := newPool(t, 3), newPool(t, 2)
	for range 50 {
		if u := s.Select(a, nil, nil); u == nil || !contains(a, u) {
			t.Fatal("picked outside pool a")
		}
		if u := s.Select(b, nil, nil); u == nil || !contains(b, u) {
			t.Fatal("picked outside pool b")
		}
	}
}

func contains(pool reverseproxy.UpstreamPool, u *reverseproxy.Upstream) bool {
	for _, p := range pool {
		if p == u {
			return true
		}
	}
	return false
}

// TestEWMAConcurrent exercises selection, observation and view rebuilds
// from many goroutines; run with -race.
func TestLeastTimeConcurrent(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{Choices: 2})
	pools := []reverseproxy.UpstreamPool{newPool(t, 20), newPool(t, 5)}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				pool := pools[(g+i/100)%2]
				u := s.Select(pool, nil, nil)
				if u == nil {
					t.Error("nil pick")
					return
				}
				observe(s, u, time.Duration(1+i%7)*time.Millisecond, hoststate.Outcome(i%3))
			}
		})
	}
	wg.Wait()
	// one report per pool served, each with its own members
	reps := s.poolStatuses()
	if len(reps) != 2 || len(reps[0].Upstreams)+len(reps[1].Upstreams) != 25 {
		t.Fatalf("want reports of the two pools (20 and 5 upstreams), got %d reports", len(reps))
	}
}

func TestChoicesForPool(t *testing.T) {
	cases := []struct {
		c    Choices
		n    int
		want int
	}{
		{choicesAuto, 4, 0}, // see choose's TestSamplingFloorOfTwoChoices
		{choicesAuto, autoScanLimit, 0},
		{choicesAuto, autoScanLimit + 1, 2},
		{choicesAll, 1000, 0},
		{2, 4, 2},
		{5, 3, 5},
	}
	for _, c := range cases {
		if got := c.c.forPool(c.n); got != c.want {
			t.Errorf("%v.forPool(%d) = %d, want %d", c.c, c.n, got, c.want)
		}
	}
}
