package lbpolicy

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// loadPolicy loads a selection policy by name from its options' JSON, as
// Caddy does for a reverse_proxy's selection_policy.
func loadPolicy(t *testing.T, name, options string) *LeastTimeSelection {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	mod, err := ctx.LoadModuleByID("http.reverse_proxy.selection_policies."+name, json.RawMessage(options))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	lt, ok := mod.(leastTimer)
	if !ok {
		t.Fatalf("%s loads %T, not the least_time policy", name, mod)
	}
	s := lt.leastTime()
	t.Cleanup(func() { _ = s.Cleanup() })
	return s
}

// TestEWMAIsLeastTime checks that the earlier name, ewma, is the least_time
// policy under another name: loaded from the same options, the two price
// every upstream the same and choose the same one after every step of the
// same history (answers of several latencies, failures, requests in
// flight), on a timeline of their own so that nothing but the policies can
// differ. Each names itself as configured.
func TestEWMAIsLeastTime(t *testing.T) {
	const options = `{"choices":"all","decay":"10s","weights":[1,2,1,4],"panic_threshold":25}`
	type step struct {
		i       int           // the upstream
		latency time.Duration // an answer of this latency; 0: a request begins
		outcome hoststate.Outcome
	}
	history := []step{
		{0, 2 * time.Millisecond, hoststate.Success},
		{1, 8 * time.Millisecond, hoststate.Success},
		{2, 30 * time.Millisecond, hoststate.Success},
		{3, 5 * time.Millisecond, hoststate.Success},
		{3, 0, 0},
		{3, 0, 0},
		{0, 3 * time.Millisecond, hoststate.Success},
		{1, 40 * time.Millisecond, hoststate.Failure},
		{0, 0, 0},
		{2, 4 * time.Millisecond, hoststate.Success},
		{2, 4 * time.Millisecond, hoststate.Success},
		{3, 0, 0},
		{3, 200 * time.Millisecond, hoststate.Success},
		{3, 300 * time.Millisecond, hoststate.Success},
		{3, 250 * time.Millisecond, hoststate.Success},
		{0, 60 * time.Millisecond, hoststate.Success},
		{0, 60 * time.Millisecond, hoststate.Success},
		{1, 0, 0},
		{1, 9 * time.Millisecond, hoststate.Success},
	}
	names := []string{leastTimeName, ewmaName}
	var (
		policies [2]*LeastTimeSelection
		pools    [2]reverseproxy.UpstreamPool
	)
	for k, name := range names {
		policies[k] = loadPolicy(t, name, options)
		pools[k] = make(reverseproxy.UpstreamPool, 4)
		for i := range pools[k] {
			// addresses of each policy's own, so that no state is shared
			pools[k][i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("%s-%s-%d:80", t.Name(), name, i)}
		}
	}
	now := monoclock.Now()
	candidates := func(k int) leastTimeCandidates {
		s := policies[k]
		return leastTimeCandidates{pool: pools[k], view: s.viewFor(pools[k]), table: s.table, now: now, base: s.table.Baseline()}
	}
	chosen := map[string]bool{}
	for n, st := range history {
		now += int64(time.Millisecond)
		for k, s := range policies {
			stats := s.table.Stats(pools[k][st.i].Dial)
			if st.latency == 0 {
				stats.BeginAt(now)
				continue
			}
			stats.BeginAt(now - int64(st.latency))
			s.table.ObserveAt(stats, now-int64(st.latency), now, st.outcome)
		}
		a, b := candidates(0), candidates(1)
		if a.base != b.base {
			t.Fatalf("step %d: baselines differ: %s %v, %s %v", n, names[0], a.base, names[1], b.base)
		}
		for i := range pools[0] {
			if ca, cb := a.Cost(i), b.Cost(i); ca != cb {
				t.Fatalf("step %d: upstream %d priced %+v by %s, %+v by %s", n, i, ca, names[0], cb, names[1])
			}
		}
		wa, wb := unbeaten(a), unbeaten(b)
		if fmt.Sprint(wa) != fmt.Sprint(wb) {
			t.Fatalf("step %d: %s would choose among %v, %s among %v", n, names[0], wa, names[1], wb)
		}
		chosen[fmt.Sprint(wa)] = true
	}
	// The history must have moved the choice, or the comparison above
	// proves little.
	if len(chosen) < 2 {
		t.Fatalf("the history never changed the choice (always %v)", chosen)
	}
	for k, s := range policies {
		st := s.statusOf(s.viewFor(pools[k]), false)
		if st.Policy != names[k] {
			t.Errorf("%s reports itself as %q", names[k], st.Policy)
		}
		if got := s.panic.policy; got != names[k] {
			t.Errorf("%s logs and counts panic mode as %q", names[k], got)
		}
	}
}

// unbeaten returns the upstreams no other upstream beats: those the
// policy chooses among (near-ties are broken at random).
func unbeaten(c leastTimeCandidates) []int {
	var out []int
	for i := range c.pool {
		beaten := false
		for j := range c.pool {
			beaten = beaten || j != i && c.Cost(j).Beats(c.Cost(i))
		}
		if !beaten {
			out = append(out, i)
		}
	}
	return out
}
