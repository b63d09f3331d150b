package lbpolicy

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/drain"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// setDrain drains (percent 0) or reweights an address in the process's
// store, and undoes it when the test ends.
func setDrain(t *testing.T, addr string, percent int) {
	t.Helper()
	var err error
	if percent == 0 {
		_, err = drain.Shared().Set(addr, true, 100)
	} else {
		_, err = drain.Shared().Set(addr, false, percent)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { drain.Shared().Set(addr, false, 100) })
}

// drainSelectors are the policies that honour drains, each with a way to
// pick from a pool: a fresh key per request for consistent_hash.
func drainSelectors(t *testing.T) map[string]func(pool reverseproxy.UpstreamPool, n int) *reverseproxy.Upstream {
	lt := provisionLeastTime(t, &LeastTimeSelection{})
	ch := provisionHash(t, &ConsistentHashSelection{})
	pr := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "round_robin"}`)})
	pl := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "least_conn"}`)})
	pch := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "consistent_hash"}`)})
	return map[string]func(reverseproxy.UpstreamPool, int) *reverseproxy.Upstream{
		"least_time": func(p reverseproxy.UpstreamPool, _ int) *reverseproxy.Upstream { return lt.Select(p, nil, nil) },
		"consistent_hash": func(p reverseproxy.UpstreamPool, n int) *reverseproxy.Upstream {
			return ch.Select(p, hashRequest(fmt.Sprintf("/k/%d", n)), nil)
		},
		"panic(round_robin)": func(p reverseproxy.UpstreamPool, _ int) *reverseproxy.Upstream { return pr.Select(p, nil, nil) },
		"panic(least_conn)":  func(p reverseproxy.UpstreamPool, _ int) *reverseproxy.Upstream { return pl.Select(p, nil, nil) },
		"panic(consistent_hash)": func(p reverseproxy.UpstreamPool, n int) *reverseproxy.Upstream {
			return pch.Select(p, hashRequest(fmt.Sprintf("/k/%d", n)), nil)
		},
	}
}

// drainPool is a pool of n upstreams with addresses the drain store
// takes, unique to the test and policy.
func drainPool(t *testing.T, policy string, n int) reverseproxy.UpstreamPool {
	pool := make(reverseproxy.UpstreamPool, n)
	name := strings.NewReplacer("/", "-", "(", "-", ")", "-", "_", "-").Replace(t.Name() + "-" + policy)
	for i := range pool {
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("%s-%d:80", name, i)}
	}
	return pool
}

func countPicks(t *testing.T, pick func(reverseproxy.UpstreamPool, int) *reverseproxy.Upstream, pool reverseproxy.UpstreamPool, n int) []int {
	t.Helper()
	got := make([]int, len(pool))
	for k := range n {
		u := pick(pool, k)
		if u == nil {
			t.Fatalf("pick %d: no upstream", k)
		}
		for i := range pool {
			if pool[i] == u {
				got[i]++
			}
		}
	}
	return got
}

// TestDrainedGetsNoNewRequests: a drained upstream gets none of the
// picks; drained all, the pool keeps serving; undrained, it is picked
// again.
func TestDrainedGetsNoNewRequests(t *testing.T) {
	for name, pick := range drainSelectors(t) {
		t.Run(name, func(t *testing.T) {
			pool := drainPool(t, name, 4)
			countPicks(t, pick, pool, 10) // builds the view
			setDrain(t, pool[1].Dial, 0)
			got := countPicks(t, pick, pool, 2000)
			if got[1] != 0 {
				t.Fatalf("drained upstream got %d of 2000 picks: %v", got[1], got)
			}
			for i, n := range got {
				if i != 1 && n < 400 {
					t.Fatalf("upstream %d got %d of 2000: %v", i, n, got)
				}
			}
			for _, i := range []int{0, 2, 3} {
				setDrain(t, pool[i].Dial, 0)
			}
			got = countPicks(t, pick, pool, 400) // fails on a nil pick
			if got[0]+got[1]+got[2]+got[3] != 400 {
				t.Fatalf("every upstream drained: %v", got)
			}
		})
	}
}

// TestWeightPercentScalesShare: an upstream at 50% of its weight gets
// about half the share of the others (least_time and panic admit it to
// half of the selections; consistent_hash keeps half of its keys).
func TestWeightPercentScalesShare(t *testing.T) {
	for name, pick := range drainSelectors(t) {
		t.Run(name, func(t *testing.T) {
			pool := drainPool(t, name, 4)
			countPicks(t, pick, pool, 10)
			const n = 8000
			before := countPicks(t, pick, pool, n)
			setDrain(t, pool[0].Dial, 50)
			got := countPicks(t, pick, pool, n)
			// its share relative to the others' average, before and after
			rel := func(c []int) float64 { return float64(c[0]) / (float64(c[1]+c[2]+c[3]) / 3) }
			ratio := rel(got) / rel(before)
			// admitting it to half of the selections gives 0.43 with four
			// upstreams (1/8 against 7/24); a weight of 0.5 would give 0.5
			if ratio < 0.33 || ratio > 0.6 {
				t.Fatalf("at 50%% weight its relative share went from %.3f to %.3f (x%.2f); want about half: before %v after %v",
					rel(before), rel(got), ratio, before, got)
			}
			setDrain(t, pool[0].Dial, 1)
			if got = countPicks(t, pick, pool, n); float64(got[0]) > 0.02*n {
				t.Fatalf("at 1%% weight it got %d of %d", got[0], n)
			}
		})
	}
}

// TestWeightNeverRefuses: an upstream at a low weight that alone can take
// the request takes it.
func TestWeightNeverRefuses(t *testing.T) {
	for name, pick := range drainSelectors(t) {
		t.Run(name, func(t *testing.T) {
			pool := drainPool(t, name, 1)
			setDrain(t, pool[0].Dial, 1)
			if got := countPicks(t, pick, pool, 200); got[0] != 200 {
				t.Fatalf("the only upstream, at 1%%, got %v", got)
			}
		})
	}
}

// TestDrainYieldsToEjection: when the only undrained upstream is ejected,
// the drained ones serve (a drain never becomes an outage), and the
// ejected one stays out.
func TestDrainYieldsToEjection(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{Outlier: &Outlier{MaxEjectionPercent: percent(100)}})
	pool := drainPool(t, "lt", 4)
	s.Select(pool, nil, nil)
	if _, _, ok := s.table.Stats(pool[0].Dial).Eject(monoclock.Now(), time.Hour,
		func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("ejecting")
	}
	s.views.last.Load().countedAt.Store(-countEvery)
	for _, u := range pool[1:] {
		setDrain(t, u.Dial, 0)
	}
	got := countPicks(t, func(p reverseproxy.UpstreamPool, _ int) *reverseproxy.Upstream { return s.Select(p, nil, nil) }, pool, 300)
	if got[0] != 0 || got[1] == 0 || got[2] == 0 || got[3] == 0 {
		t.Fatalf("ejected one and three drained: %v", got)
	}
}

// TestDrainShownInPools: the pools of /lbx/upstreams mark a drained and a
// reweighted member, and leave it available (not unhealthy).
func TestDrainShownInPools(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "round_robin"}`)})
	pool := drainPool(t, "panic", 3)
	p.Select(pool, nil, nil)
	setDrain(t, pool[0].Dial, 0)
	setDrain(t, pool[1].Dial, 30)
	var found int
	for _, st := range poolStatusesIn(allPoolReports(), dialRange{}) {
		for _, m := range st.Upstreams {
			switch m.Dial {
			case pool[0].Dial:
				found++
				if !m.Drained || m.WeightPercent != 0 || !m.Healthy {
					t.Errorf("drained member: %+v", m)
				}
			case pool[1].Dial:
				found++
				if m.Drained || m.WeightPercent != 30 {
					t.Errorf("reweighted member: %+v", m)
				}
			case pool[2].Dial:
				found++
				if m.Drained || m.WeightPercent != 0 {
					t.Errorf("untouched member: %+v", m)
				}
			}
		}
	}
	if found != 3 {
		t.Fatalf("found %d of the pool's members", found)
	}
	if d, w := drainView(pool[0].Dial); !d || w != 0 {
		t.Fatalf("upstream view of the drained: %v %d", d, w)
	}
}

// TestUndrainRamps: an undrained upstream that served before starts its
// slow start ramp.
func TestUndrainRamps(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)}})
	pool := drainPool(t, "lt", 2)
	s.Select(pool, nil, nil)
	for _, u := range pool {
		observe(s, u, time.Millisecond, hoststate.Success)
	}
	st := s.table.Stats(pool[0].Dial)
	// an undrain of an upstream that was not drained changes nothing
	start := monoclock.Now()
	drain.Shared().Set(pool[1].Dial, false, 100)
	if r := s.table.Stats(pool[1].Dial).RampStart(monoclock.Now()); r >= start {
		t.Fatal("an undrain of an upstream never drained started its ramp")
	}
	setDrain(t, pool[0].Dial, 0)
	before := monoclock.Now()
	if r := st.RampStart(before); r >= before {
		t.Fatalf("ramping before the undrain: %d", r)
	}
	drain.Shared().Set(pool[0].Dial, false, 100)
	if r := st.RampStart(monoclock.Now()); r < before {
		t.Fatalf("undrain did not start the ramp: %d < %d", r, before)
	}
	if r := s.table.Stats(pool[1].Dial).RampStart(monoclock.Now()); r >= before {
		t.Fatal("the other upstream's ramp started too")
	}
}

func TestDrainAdminRoutes(t *testing.T) {
	st := drain.New()
	do := func(method string, op drainOp, query string) (int, string) {
		rec := httptest.NewRecorder()
		err := serveDrainOp(st, op, rec, httptest.NewRequest(method, op.path()+query, nil))
		if err != nil {
			apiErr := err.(caddy.APIError)
			return apiErr.HTTPStatus, apiErr.Err.Error()
		}
		return rec.Code, rec.Body.String()
	}
	for _, c := range []struct {
		method string
		op     drainOp
		query  string
		status int
		want   string
	}{
		{http.MethodGet, opDrain, "?upstream=10.0.0.1:80", 405, "takes POST"},
		{http.MethodPut, opWeight, "?upstream=10.0.0.1:80&percent=5", 405, "takes POST"},
		{http.MethodPost, opDrain, "", 400, "needs upstream"},
		{http.MethodPost, opDrain, "?upstream=10.0.0.1", 400, "host:port"},
		{http.MethodPost, opDrain, "?upstream=10.0.0.1:0", 400, "port"},
		{http.MethodPost, opDrain, "?upstream=10.0.0.1:80&upstream=10.0.0.2:80", 400, "given 2 times"},
		{http.MethodPost, opDrain, "?upstream=10.0.0.1:80&percent=5", 400, "unknown query parameter \"percent\""},
		{http.MethodPost, opUndrain, "?dial=10.0.0.1:80", 400, "unknown query parameter \"dial\""},
		{http.MethodPost, opWeight, "?upstream=10.0.0.1:80", 400, "needs percent"},
		{http.MethodPost, opWeight, "?upstream=10.0.0.1:80&percent=0", 400, "percent 0"},
		{http.MethodPost, opWeight, "?upstream=10.0.0.1:80&percent=101", 400, "percent 101"},
		{http.MethodPost, opWeight, "?upstream=10.0.0.1:80&percent=half", 400, "percent=\"half\""},
		{http.MethodPost, opDrain, "?upstream=10.0.0.1:80", 200, `"drained": true`},
		{http.MethodPost, opWeight, "?upstream=10.0.0.2:80&percent=25", 200, `"weight_percent": 25`},
		{http.MethodPost, opUndrain, "?upstream=10.0.0.3:80", 200, `"local to this node`},
	} {
		status, body := do(c.method, c.op, c.query)
		if status != c.status || !strings.Contains(body, c.want) {
			t.Errorf("%s %s%s: %d %s; want %d with %q", c.method, c.op.path(), c.query, status, body, c.status, c.want)
		}
	}
	if len(st.Entries()) != 3 {
		t.Fatalf("bad requests changed the store: %d entries", len(st.Entries()))
	}
	v := buildDrainsView(st)
	if v.Propagated || len(v.Entries) != 3 || v.Entries[0].Upstream != "10.0.0.1:80" || !v.Entries[0].Drained ||
		v.Entries[1].WeightPercent != 25 || v.Entries[2].Drained || v.Entries[2].Version <= v.Entries[1].Version {
		t.Fatalf("GET /lbx/drains: %+v", v)
	}
	// GET only on the view
	rec := httptest.NewRecorder()
	var route caddy.AdminRoute
	for _, r := range (drainAdmin{}).Routes() {
		if r.Pattern == "/lbx/drains" {
			route = r
		}
	}
	if err := route.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/lbx/drains", nil)); err == nil {
		t.Fatal("POST /lbx/drains accepted")
	}
	rec = httptest.NewRecorder()
	if err := route.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/lbx/drains", nil)); err != nil || !strings.Contains(rec.Body.String(), `"entries"`) {
		t.Fatalf("GET /lbx/drains: %v %s", err, rec.Body.String())
	}
}

// TestWeightPercentSameKeysEverywhere: under consistent_hash, the keys a
// reweighted upstream keeps do not depend on the order of the pool, so
// every node, whatever order its upstreams came in, sends a key to the
// same place.
func TestWeightPercentSameKeysEverywhere(t *testing.T) {
	a := provisionHash(t, &ConsistentHashSelection{})
	b := provisionHash(t, &ConsistentHashSelection{})
	pool := drainPool(t, "ch", 4)
	reversed := reverseproxy.UpstreamPool{pool[3], pool[2], pool[1], pool[0]}
	setDrain(t, pool[0].Dial, 50)
	kept, moved := 0, 0
	for k := range 2000 {
		key := fmt.Sprintf("/k/%d", k)
		ua, ub := a.Select(pool, hashRequest(key), nil), b.Select(reversed, hashRequest(key), nil)
		if ua.Dial != ub.Dial {
			t.Fatalf("key %s: %s in one order, %s in the other", key, ua.Dial, ub.Dial)
		}
		if ua == pool[0] {
			kept++
		} else {
			moved++
		}
	}
	if kept == 0 || moved == 0 {
		t.Fatalf("kept %d, moved %d", kept, moved)
	}
}

// TestWeightHoldsLoadSeeker: behind the panic wrapper, a policy that seeks
// the least loaded offers a reweighted upstream, which holds fewer
// requests, at nearly every choice; the weight still holds its share to
// percent × the others' (within a few percent), where the draw alone let
// it take percent of all picks. A closed loop keeps 32 requests in flight
// over 4 upstreams and ends one at random before each new selection.
func TestWeightHoldsLoadSeeker(t *testing.T) {
	const n, inFlight, picks = 4, 32, 20000
	p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "least_conn"}`)})
	inner := &leastHeld{held: map[string]int{}}
	p.inner = inner
	pool := drainPool(t, "panic", n)
	for _, pct := range []int{20, 50} {
		setDrain(t, pool[0].Dial, pct)
		rng := rand.New(rand.NewPCG(uint64(pct), 2))
		clear(inner.held)
		running := make([]string, 0, inFlight)
		for len(running) < inFlight {
			u := pool[len(running)%n]
			running = append(running, u.Dial)
			inner.held[u.Dial]++
		}
		got := make([]int, n)
		for range picks {
			i := rng.IntN(len(running))
			inner.held[running[i]]--
			u := p.Select(pool, nil, nil)
			running[i] = u.Dial
			inner.held[u.Dial]++
			got[slices.Index(pool, u)]++
		}
		rel := float64(got[0]) / (float64(got[1]+got[2]+got[3]) / 3)
		t.Logf("at %d%%: picks %v, relative to the others %.3f", pct, got, rel)
		if want := float64(pct) / 100; math.Abs(rel-want) > 0.05 {
			t.Errorf("at %d%% weight the upstream's picks are %.3f of the others', want %.2f ± 0.05", pct, rel, want)
		}
	}
}
