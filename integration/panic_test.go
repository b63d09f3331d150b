package integration

import (
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"
)

// panicPool starts four backends for the panic tests: every one answers
// normal requests, and the last `failing` of them fail /health.
func panicPool(e *env, failing int) []*backend {
	bs := e.startBackends(4)
	for _, b := range bs[4-failing:] {
		b.healthCode.Store(http.StatusServiceUnavailable)
	}
	return bs
}

// loadPanicConfig loads reverse_proxy over bs with the given lb_policy
// line and fast active health checks.
func (e *env) loadPanicConfig(policy string, bs []*backend) {
	e.t.Helper()
	e.load(fmt.Sprintf(`reverse_proxy %s {
	%s
	health_uri /health
	health_interval 100ms
	health_fails 1
	health_passes 1
}`, dials(bs...), policy))
}

// waitHealthConverged waits until the pool report shows exactly the
// backends in healthy as available. A config's health state starts
// healthy, so every reload must wait for it again.
func (e *env) waitHealthConverged(bs []*backend, healthy ...*backend) poolInfo {
	e.t.Helper()
	want := make([]string, len(healthy))
	for i, b := range healthy {
		want[i] = b.addr
	}
	return e.waitPool("/conv", fmt.Sprintf("health to converge on %v", want), func(p poolInfo) bool {
		return slices.Equal(healthyMembers(p), want)
	}, bs...)
}

// assertUsed fails unless exactly the backends in want answered, each at
// least once, with no failed request.
func assertUsed(t *testing.T, what string, r loadResult, want ...*backend) {
	t.Helper()
	t.Logf("%s: %v", what, r.counts)
	if len(r.errors) > 0 {
		t.Errorf("%s: %d failed requests: %q", what, len(r.errors), r.errors)
	}
	for name, n := range r.counts {
		if !slices.ContainsFunc(want, func(b *backend) bool { return b.name == name }) {
			t.Errorf("%s: %d requests went to %s; want only %v", what, n, name, names(want))
		}
	}
	for _, b := range want {
		if r.counts[b.name] == 0 {
			t.Errorf("%s: %s got no request; want all of %v used", what, b.name, names(want))
		}
	}
}

func names(bs []*backend) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = b.name
	}
	return out
}

// The panic wrapper gives a stock policy panic mode.
func TestPanicWrapperStockPolicy(t *testing.T) {
	e := newEnv(t)
	bs := panicPool(e, 3)
	healthy := bs[0]

	// Stock least_conn: once health has converged, only the healthy one.
	e.loadPanicConfig("lb_policy least_conn", bs)
	streak := 0
	waitFor(t, 10*time.Second, "stock least_conn to use only the healthy backend", func() (bool, string) {
		if e.mustGet("/conv") == healthy.name {
			streak++
		} else {
			streak = 0
		}
		return streak >= 10, fmt.Sprintf("%d in a row on %s", streak, healthy.name)
	})
	assertUsed(t, "least_conn, 1 of 4 healthy", e.drive("/", 40, 1), healthy)

	// panic at the default 50%: 1/4 available is panic, all four are used.
	e.loadPanicConfig("lb_policy panic {\n\t\tpolicy least_conn\n\t}", bs)
	e.waitHealthConverged(bs, healthy)
	assertUsed(t, "panic(least_conn) 50%, 1 of 4 healthy", e.drive("/", 80, 1), bs...)
	p, _ := report(t).pool(bs...)
	if p.Policy != "panic(least_conn)" || !p.Panic || p.PanicEntered < 1 || p.Available != 1 {
		t.Errorf("pool report: %+v; want policy panic(least_conn), panic true, panic_entered_total >= 1, available 1", p)
	}

	// threshold 20%: 1/4 = 25% is enough, health is respected.
	e.loadPanicConfig("lb_policy panic {\n\t\tthreshold 20%\n\t\tpolicy least_conn\n\t}", bs)
	e.waitHealthConverged(bs, healthy)
	assertUsed(t, "panic(least_conn) 20%, 1 of 4 healthy", e.drive("/", 40, 1), healthy)
	p, _ = report(t).pool(bs...)
	if p.Panic || p.PanicEntered != 0 || p.PanicThreshold != 20 {
		t.Errorf("pool report: %+v; want panic false, panic_entered_total 0, threshold 20", p)
	}

	// 2 of 4 healthy at 50% is exactly at the threshold: not panic.
	bs[1].healthCode.Store(http.StatusOK)
	e.loadPanicConfig("lb_policy panic {\n\t\tpolicy least_conn\n\t}", bs)
	e.waitHealthConverged(bs, bs[0], bs[1])
	assertUsed(t, "panic(least_conn) 50%, 2 of 4 healthy", e.drive("/", 60, 1), bs[0], bs[1])
	p, _ = report(t).pool(bs...)
	if p.Panic || p.PanicEntered != 0 || p.Available != 2 {
		t.Errorf("pool report: %+v; want panic false, panic_entered_total 0, available 2", p)
	}
}

// ewma has the same panic mode built in (default 50%), and it can be
// turned off.
func TestEWMAPanicMode(t *testing.T) {
	e := newEnv(t)
	bs := panicPool(e, 3)
	healthy := bs[0]

	e.loadPanicConfig("lb_policy ewma", bs)
	e.waitHealthConverged(bs, healthy)
	// Concurrent load, so requests in flight spread it even where
	// latency estimates differ.
	assertUsed(t, "ewma, 1 of 4 healthy", e.drive("/", 200, 8), bs...)
	p, _ := report(t).pool(bs...)
	if p.Policy != "ewma" || !p.Panic || p.PanicEntered < 1 || p.PanicThreshold != 50 {
		t.Errorf("pool report: %+v; want policy ewma, panic true, panic_entered_total >= 1, threshold 50", p)
	}

	e.loadPanicConfig("lb_policy ewma {\n\t\tpanic_threshold off\n\t}", bs)
	e.waitHealthConverged(bs, healthy)
	assertUsed(t, "ewma panic_threshold off, 1 of 4 healthy", e.drive("/", 200, 8), healthy)
	p, _ = report(t).pool(bs...)
	if p.Panic || p.PanicEntered != 0 || p.PanicThreshold != 0 {
		t.Errorf("pool report: %+v; want panic false, panic_entered_total 0, threshold 0", p)
	}
	if p.Available != 1 {
		t.Errorf("pool report: available = %d with panic mode off; want 1 (the healthy backend)", p.Available)
	}
}

// A pool that goes entirely down while no request is proxied must still
// enter panic mode on the next request: ewma caches its count of
// available upstreams against a clock that only round trips move, and no
// round trip happens while nothing is available.
func TestEWMAPanicWhenWholePoolGoesDownQuietly(t *testing.T) {
	e := newEnv(t)
	bs := panicPool(e, 0)
	e.loadPanicConfig("lb_policy ewma", bs)
	e.waitHealthConverged(bs, bs...)
	assertUsed(t, "ewma, all healthy", e.drive("/", 100, 8), bs...)

	seen := make([]int64, len(bs))
	for i, b := range bs {
		b.healthCode.Store(http.StatusServiceUnavailable)
		seen[i] = b.healthHits.Load()
	}
	// Wait on the backends alone — neither a proxied request nor the
	// admin API, both of which read the clock — until each has failed
	// two health checks (health_fails 1 marks it down after one).
	waitFor(t, 10*time.Second, "two failed health checks on every upstream", func() (bool, string) {
		for i, b := range bs {
			if b.healthHits.Load() < seen[i]+2 {
				return false, fmt.Sprintf("%s: %d health checks since the flip", b.name, b.healthHits.Load()-seen[i])
			}
		}
		return true, ""
	})
	res := e.drive("/", 40, 4)
	t.Logf("ewma, none healthy: %v", res.counts)
	if len(res.errors) > 0 || res.total != 40 {
		t.Fatalf("with every upstream down, panic mode must keep serving: %d of 40 answered, errors %v", res.total-len(res.errors), res.errors)
	}
	if p, _ := report(t).pool(bs...); !p.Panic {
		t.Errorf("pool report: %+v; want panic true", p)
	}
}
