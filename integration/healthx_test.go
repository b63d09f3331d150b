package integration

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// retryOnFailureStatus makes reverse_proxy retry a failure status on
// another upstream, as well as transport errors.
const retryOnFailureStatus = "lb_retry_match {\n\t\texpression `{rp.status_code} in [502, 503, 504]`\n\t}"

// The black hole again, now with lb_retries 2: idempotent clients see no
// error at all with ewma and outlier ejection, because an instant 503 is
// charged as a failure (the retry of that very request goes elsewhere) and
// the hole is ejected after a few. Stock least_conn, with the same
// retries, keeps choosing the hole (it has the fewest requests in flight)
// and clients see errors.
func TestBlackHoleRetriesHideIt(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(4)
	hole := bs[3]
	hole.status.Store(http.StatusServiceUnavailable)

	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy least_conn
	lb_retries 2
	%s
}`, dials(bs...), retryOnFailureStatus))
	stock := e.drive("/", 400, 8)
	stockHits := hole.hits.Load()
	t.Logf("least_conn, lb_retries 2: %d of 400 failed; the hole got %d attempts", len(stock.errors), stockHits)

	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		outlier {
			consecutive_failures 3
			base_ejection_time 1m
		}
	}
	lb_retries 2
	%s
}`, dials(bs...), retryOnFailureStatus))
	res := e.drive("/", 400, 8)
	got := hole.hits.Load() - stockHits
	t.Logf("ewma+outlier, lb_retries 2: %d of 400 failed; the hole got %d attempts", len(res.errors), got)
	if len(res.errors) != 0 {
		t.Fatalf("%d requests failed, want 0; first: %s", len(res.errors), res.errors[0])
	}
	// 3 failures eject it; attempts already on their way may still land.
	if got > 3+8 {
		t.Fatalf("the hole got %d attempts after 3 failures", got)
	}
	if len(stock.errors) == 0 || got >= stockHits {
		t.Fatalf("stock least_conn must do worse: %d failed, %d attempts to the hole (ours: %d)", len(stock.errors), stockHits, got)
	}
}

// An ejected upstream whose active health checks pass returns before its
// ejection time is up (Envoy's behaviour); one whose checks fail stays out.
func TestOutlierEarlyReturnOnPassingHealthChecks(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(4)
	passing, failing := bs[2], bs[3]
	passing.status.Store(http.StatusServiceUnavailable) // traffic fails, /health passes
	failing.status.Store(http.StatusServiceUnavailable)
	failing.healthCode.Store(http.StatusServiceUnavailable)

	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		outlier {
			consecutive_failures 2
			base_ejection_time 1h
			max_ejection_percent 50%%
		}
	}
	health_uri /health
	health_interval 100ms
	health_fails 100
}`, dials(bs...)))
	// Closed-loop traffic until both are ejected (the 503s are the
	// evidence of it, not an error of the test).
	waitFor(t, 10*time.Second, "both failing upstreams ejected", func() (bool, string) {
		e.drive("/", 20, 4)
		p, _ := report(t).upstream(passing.addr)
		f, _ := report(t).upstream(failing.addr)
		return p.Ejections >= 1 && f.EjectedMs > 0, fmt.Sprintf("passing %+v, failing %+v", p, f)
	})
	// No traffic from here on: only the health checks can end an
	// ejection of an hour.
	waitFor(t, 10*time.Second, "the upstream passing health checks back", func() (bool, string) {
		p, _ := report(t).upstream(passing.addr)
		return p.EjectedMs == 0, fmt.Sprintf("%+v", p)
	})
	f, _ := report(t).upstream(failing.addr)
	if f.EjectedMs < float64(50*time.Minute/time.Millisecond) {
		t.Fatalf("an upstream failing its health checks must stay ejected: %+v", f)
	}

	// With health_check_restore off, passing checks change nothing.
	bs = e.startBackends(4)
	passing = bs[3]
	passing.status.Store(http.StatusServiceUnavailable)
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		outlier {
			consecutive_failures 2
			base_ejection_time 1h
			health_check_restore off
		}
	}
	health_uri /health
	health_interval 50ms
}`, dials(bs...)))
	waitFor(t, 10*time.Second, "ejection", func() (bool, string) {
		e.drive("/", 20, 4)
		p, _ := report(t).upstream(passing.addr)
		return p.EjectedMs > 0, fmt.Sprintf("%+v", p)
	})
	probes := passing.healthHits.Load()
	waitFor(t, 10*time.Second, "ten more passing health checks", func() (bool, string) {
		n := passing.healthHits.Load() - probes
		return n >= 10, fmt.Sprintf("%d", n)
	})
	if p, _ := report(t).upstream(passing.addr); p.EjectedMs == 0 {
		t.Fatalf("health_check_restore off, yet passing checks ended the ejection: %+v", p)
	}
}

// Slow start after an ejection: the returning upstream's share ramps up over
// the window instead of jumping to a quarter at once. Shares are measured
// in consecutive windows of paced traffic after the ejection ends.
func TestSlowStartRampAfterEjection(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(4)
	back := bs[3]
	back.status.Store(http.StatusServiceUnavailable)
	// Equal, real latency: scheduling noise stays well inside the tie
	// band, so shares follow the ramp, not who had the last hiccup.
	for _, b := range bs {
		b.delay.Store(int64(20 * time.Millisecond))
	}
	const (
		window  = 6 * time.Second
		buckets = 4
	)
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		outlier {
			consecutive_failures 2
			base_ejection_time 1s
		}
		slow_start %v
	}
}`, dials(bs...), window))
	// Eject it, then let it heal while ejected.
	waitFor(t, 10*time.Second, "ejection", func() (bool, string) {
		e.drive("/", 10, 2)
		u, _ := report(t).upstream(back.addr)
		return u.EjectedMs > 0, fmt.Sprintf("%+v", u)
	})
	back.status.Store(0)
	u, _ := report(t).upstream(back.addr)
	returns := time.Now().Add(time.Duration(u.EjectedMs * float64(time.Millisecond)))

	// Paced traffic from the return to the end of the window, counted per
	// bucket of window/buckets by when each request was sent.
	var (
		mu           sync.Mutex
		total, onIt  [buckets]int
		failed, next atomic.Int64
		wg           sync.WaitGroup
	)
	const interval = 4 * time.Millisecond // 250 req/s, ~5 in flight
	n := int64(window / interval)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= n {
					return
				}
				at := returns.Add(time.Duration(i) * interval)
				time.Sleep(time.Until(at))
				status, name, body, err := e.get("/")
				if err != nil || status != http.StatusOK {
					if failed.Add(1) == 1 {
						t.Logf("first failure: status %d, %q, %v", status, body, err)
					}
					continue
				}
				b := int(time.Duration(i) * interval * buckets / window)
				mu.Lock()
				total[b]++
				if name == back.name {
					onIt[b]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d requests failed during the ramp", failed.Load())
	}
	shares := make([]float64, buckets)
	for b := range buckets {
		shares[b] = float64(onIt[b]) / float64(max(total[b], 1))
	}
	t.Logf("returning upstream's share per %v of the %v ramp: %.3f", window/buckets, window, shares)
	// The ramping upstream is a candidate only for the fraction of
	// selections its weight factor admits (max(t/window, 10%)), so its
	// share in a quarter of the window is at most the factor's mean over
	// that quarter (0.145 in the first), whatever the load; how much of
	// that it gets depends on how busy the others are. A full share is
	// 1/4. The slack is about two standard deviations of a quarter's
	// ~375 requests.
	const slack = 0.035
	for b := range buckets {
		lo, hi := float64(b)/buckets, float64(b+1)/buckets
		mean := meanRampFactor(lo, hi, 0.10)
		if shares[b] > mean+slack {
			t.Errorf("quarter %d of the ramp: share %.3f, above the ramp's mean weight factor %.3f", b+1, shares[b], mean)
		}
	}
	for b := 1; b < buckets; b++ {
		if shares[b] < shares[b-1]-0.03 {
			t.Errorf("share fell from %.3f to %.3f during the ramp", shares[b-1], shares[b])
		}
	}
	// A ramp at least half again as large at the end as at the start, and
	// by at least 0.05: a pool left at the floor stays flat near 0.03-0.08,
	// and one with no ramp at all fails the first quarter's cap above. Under
	// a loaded CI machine the end's share has measured 0.163 against 0.083.
	if first, last := shares[0], shares[buckets-1]; last < first+0.05 || last < 1.5*first {
		t.Errorf("share did not ramp: %.3f at the start, %.3f at the end", first, last)
	}
	if p, _ := report(t).pool(bs...); p.Upstreams[3].SlowStart != nil {
		t.Errorf("the ramp is over, yet the admin API shows a slow-start weight of %.1f%%", *p.Upstreams[3].SlowStart)
	}
}

// meanRampFactor is the mean of a linear slow-start factor max(x, floor)
// over x in [lo, hi], fractions of the window.
func meanRampFactor(lo, hi, floor float64) float64 {
	integral := func(x float64) float64 { // of max(u, floor) from 0 to x
		if x <= floor {
			return floor * x
		}
		return floor*floor + (x*x-floor*floor)/2
	}
	return (integral(hi) - integral(lo)) / (hi - lo)
}

// Slow start for an upstream added by a reload to a pool that serves, and
// for one Caddy's health checks see healthy again: the admin API shows the
// ramp.
func TestSlowStartNewAndHealthyAgain(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(4)
	policy := `lb_policy ewma {
		slow_start 1m
	}
	health_uri /health
	health_interval 50ms`
	e.load(fmt.Sprintf("reverse_proxy %s {\n\t%s\n}", dials(bs[:3]...), policy))
	// every one of the three serves before the reload: least_time may
	// leave one idle for a while on loopback (a first answer on a new
	// connection is several times slower), and one that never served
	// would rightly ramp as new
	waitFor(t, 10*time.Second, "each of the first three upstreams to serve", func() (bool, string) {
		e.drive("/", 30, 3)
		hits := []int64{bs[0].hits.Load(), bs[1].hits.Load(), bs[2].hits.Load()}
		return hits[0] > 0 && hits[1] > 0 && hits[2] > 0, fmt.Sprint("requests served: ", hits)
	})
	e.load(fmt.Sprintf("reverse_proxy %s {\n\t%s\n}", dials(bs...), policy))
	p := e.waitPool("/", "the added upstream ramping", func(p poolInfo) bool {
		return p.Upstreams[3].SlowStart != nil
	}, bs...)
	for _, m := range p.Upstreams[:3] {
		if m.SlowStart != nil {
			t.Fatalf("an upstream that served before the reload ramps: %+v", m)
		}
	}

	bs[1].healthCode.Store(http.StatusServiceUnavailable)
	e.waitPool("/", "b1 unhealthy", func(p poolInfo) bool { return !p.Upstreams[1].Healthy && !p.Upstreams[1].Available }, bs...)
	bs[1].healthCode.Store(http.StatusOK)
	p = e.waitPool("/", "b1 healthy again and ramping", func(p poolInfo) bool {
		return p.Upstreams[1].Healthy && p.Upstreams[1].Available && p.Upstreams[1].SlowStart != nil
	}, bs...)
	if w := *p.Upstreams[1].SlowStart; w < 10 || w > 20 {
		t.Fatalf("b1's weight just after it came back: %.1f%%, want near the 10%% floor", w)
	}
}

// A brown-out: every backend answers 503 after a while. With lb_retries 3
// every request would make four attempts; the retry budget keeps retries
// to about a fifth of the requests in flight.
func TestRetryBudgetUnderBrownOut(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(6)
	for _, b := range bs {
		b.status.Store(http.StatusServiceUnavailable)
		b.delay.Store(int64(20 * time.Millisecond))
	}
	hits := func() (n int64) {
		for _, b := range bs {
			n += b.hits.Load()
		}
		return n
	}
	const requests, conc = 300, 16
	run := func(policy string) (retryShare float64) {
		e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy %s
	lb_retries 3
	%s
}`, dials(bs...), policy, retryOnFailureStatus))
		before := hits()
		res := e.drive("/", requests, conc)
		if len(res.errors) != requests {
			t.Fatalf("%s: %d of %d requests failed; in a brown-out all must", policy, len(res.errors), requests)
		}
		attempts := hits() - before
		return float64(attempts-requests) / float64(attempts)
	}
	without := run("ewma")
	with := run("ewma {\n\t\tretry_budget 20% {\n\t\t\tmin_concurrent 2\n\t\t}\n\t}")
	p, _ := report(t).pool(bs...)
	t.Logf("retries among attempts: %.2f without a budget, %.2f with 20%% (min 2); refused: %+v", without, with, p.RetryBudget)
	if without < 0.7 {
		t.Fatalf("without a budget lb_retries 3 should make 3 retries per request: retry share %.2f", without)
	}
	// Retries in flight at most max(2, 20% of ~16 requests in flight) = 3
	// of ~16 attempts in flight; allow for the race between checking the
	// budget and starting the retry.
	if with > 0.35 {
		t.Fatalf("with the budget, retries are %.2f of attempts, want at most about 0.2", with)
	}
	if p.RetryBudget == nil || p.RetryBudget.Refused == 0 || p.RetryBudget.InFlight != 0 {
		t.Fatalf("admin API must show refused retries and none in flight after the run: %+v", p.RetryBudget)
	}
	res, err := adminClient.Get("http://" + adminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(res.Body)
	res.Body.Close()
	want := fmt.Sprintf(`caddy_lbx_pool_retries_refused_total{policy="ewma",upstreams=%q} %d`, strings.ReplaceAll(dials(bs...), " ", ","), p.RetryBudget.Refused)
	if !strings.Contains(string(metrics), want) {
		t.Errorf("/metrics lacks %s", want)
	}
}
