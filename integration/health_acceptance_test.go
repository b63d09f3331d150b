package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// Acceptance tests of the health features, as the issue states them:
// an Eid day (every backend slows down at once) and a flapping backend.

// ---- Eid day ----

// The Eid-day timings. While the fleet is slow every health check takes
// eidHealthDelay, well past the configured health_timeout, so Caddy's
// active health checks mark every upstream down; a request's first attempt
// hangs (an overloaded backend) until the proxy's response_header_timeout
// gives up on it, and its retry is answered after eidServeDelay.
const (
	eidUpstreams   = 10
	eidCap         = 2 // max_ejection_percent 20% of 10 upstreams
	eidConsecutive = 1 // consecutive_failures: every hung attempt condemns its host at once
	eidHealthDelay = 400 * time.Millisecond
	eidServeDelay  = 150 * time.Millisecond
	eidStall       = 5 * time.Second
)

// eidSite is the reverse_proxy of the Eid-day test with the given
// lb_policy: fast active health checks that a slow fleet fails, a header
// timeout that ends the hung first attempts, and retries for 3 s.
func eidSite(bs []*backend, policy string) string {
	return fmt.Sprintf(`reverse_proxy %s {
	%s
	lb_try_duration 3s
	lb_try_interval 20ms
	health_uri /health
	health_interval 100ms
	health_timeout 150ms
	health_fails 1
	transport http {
		response_header_timeout 600ms
	}
}`, dials(bs...), policy)
}

// eidFleet is the switch that slows a whole fleet of backends down.
type eidFleet struct {
	slow    atomic.Bool
	seen    sync.Map     // request ids some backend has been asked for
	stalled atomic.Int64 // first attempts left hanging
	probes  sync.Map     // *backend → *atomic.Int64: health checks received, slow or not
}

// wrap returns b's handler behind the fleet's switch.
func (f *eidFleet) wrap(b *backend) http.Handler {
	probes := new(atomic.Int64)
	f.probes.Store(b, probes)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			probes.Add(1)
		}
		if !f.slow.Load() {
			b.ServeHTTP(w, r)
			return
		}
		if r.URL.Path == "/health" {
			if accSleep(r.Context(), eidHealthDelay) {
				b.ServeHTTP(w, r)
			}
			return
		}
		if id := r.URL.Query().Get("id"); id != "" {
			if _, retry := f.seen.LoadOrStore(id, true); !retry {
				f.stalled.Add(1)
				if accSleep(r.Context(), eidStall) {
					// the proxy should have given up long ago
					http.Error(w, "stalled first attempt was not abandoned", http.StatusGatewayTimeout)
				}
				return
			}
		}
		if accSleep(r.Context(), eidServeDelay) {
			b.ServeHTTP(w, r)
		}
	})
}

// probeCounts returns how many health checks each of bs has received.
func (f *eidFleet) probeCounts(bs []*backend) []int64 {
	out := make([]int64, len(bs))
	for i, b := range bs {
		if c, ok := f.probes.Load(b); ok {
			out[i] = c.(*atomic.Int64).Load()
		}
	}
	return out
}

// goSlow turns the slowdown on and waits until every backend has received
// three health checks since: the first of them has timed out by the time
// the third is sent (health_interval 100ms, health_timeout 150ms), so with
// health_fails 1 Caddy deems every upstream unhealthy.
func (f *eidFleet) goSlow(t *testing.T, bs []*backend) {
	t.Helper()
	before := f.probeCounts(bs)
	f.slow.Store(true)
	waitFor(t, 10*time.Second, "three health checks of every backend after the slowdown", func() (bool, string) {
		now := f.probeCounts(bs)
		for i := range bs {
			if now[i] < before[i]+3 {
				return false, fmt.Sprintf("%s: %d health checks since", bs[i].name, now[i]-before[i])
			}
		}
		return true, ""
	})
}

// An Eid day: every backend slows down so much that every active health
// check times out. Stock Caddy then has no healthy upstream and answers
// 503. lbx keeps serving: panic mode ignores health when it cannot be
// believed, outlier ejection (which the hung attempts trigger on every
// backend) stops at max_ejection_percent, so the pool is never emptied,
// and every request succeeds, slowly (its first attempt hangs, its retry
// is answered). Afterwards every host returns and gets traffic again.
func TestEidDayPoolNeverEmptied(t *testing.T) {
	e := newEnv(t)
	f := new(eidFleet)
	bs := make([]*backend, eidUpstreams)
	for i := range bs {
		bs[i] = e.accBackend(fmt.Sprintf("b%d", i), f.wrap)
	}

	// Stock Caddy, the same health checks and retries.
	e.load(eidSite(bs, "lb_policy least_conn"))
	for range 3 {
		e.mustGet("/warm")
	}
	f.goSlow(t, bs)
	stock := e.drivePaths(8, 8, func(i int) string { return fmt.Sprintf("/eid?id=stock-%d", i) })
	t.Logf("stock least_conn, every health check timing out: %d of %d requests failed (%v), longest %v",
		len(stock.errors), stock.total, stock.statuses, stock.longest.Round(time.Millisecond))
	if len(stock.errors) == 0 {
		t.Fatalf("stock least_conn answered all %d requests with every upstream unhealthy; the comparison is void", stock.total)
	}
	f.slow.Store(false)

	// lbx. A short decay: the hung attempts charge every upstream's
	// estimate with seconds, and with the default of 10s ewma takes about a
	// minute after the recovery to try the most charged ones again (62 s
	// measured), so "every backend gets traffic again" would take that long.
	accEvents.reset()
	e.accLoad(eidSite(bs, fmt.Sprintf(`lb_policy ewma {
		decay 200ms
		outlier {
			consecutive_failures %d
			max_ejection_percent 20%%
			base_ejection_time 1s
			max_ejection_time 3s
		}
	}`, eidConsecutive)), "upstream_ejected")
	e.waitPool("/warm", "every upstream available before the slowdown", func(p poolInfo) bool {
		return p.Available == eidUpstreams && !p.Panic
	}, bs...)
	watch := e.watchEjections(bs)
	t.Cleanup(watch.stop) // also when a wait below fails

	f.goSlow(t, bs)
	const slowRequests = 40
	stalledBefore := f.stalled.Load()
	start := time.Now()
	slow := e.drivePaths(slowRequests, 8, func(i int) string { return fmt.Sprintf("/eid?id=ewma-%d", i) })
	slowPhase := time.Since(start)
	rep := report(t)
	p, _ := rep.pool(bs...)
	var ejections uint64
	for _, b := range bs {
		u, _ := rep.upstream(b.addr)
		ejections += u.Ejections
	}
	seen := watch.read()
	for _, ev := range accEvents.of("upstream_ejected") {
		t.Logf("ejected at +%v: %s for %dms, number %d in a row", ev.at.Sub(start).Round(time.Millisecond), ev.host, ev.forMs, ev.inARow)
	}
	t.Logf("ewma+outlier, every health check timing out: %d of %d requests failed (%v) in %v, longest %v; %d first attempts hung",
		len(slow.errors), slow.total, slow.statuses, slowPhase.Round(time.Millisecond), slow.longest.Round(time.Millisecond),
		f.stalled.Load()-stalledBefore)
	t.Logf("%d ejections, at most %d upstreams out at once in %d samples (cap %d), ejections refused by the cap %d; panic seen %v, now %v, panic_entered_total %d",
		ejections, seen.maxEjected, seen.samples, eidCap, seen.overflow, seen.panicSeen, p.Panic, p.PanicEntered)

	if hung := f.stalled.Load() - stalledBefore; hung != slowRequests {
		t.Errorf("%d first attempts hung for %d requests: the slowdown did not make every request need its retry", hung, slowRequests)
	}
	if slow.total != slowRequests || len(slow.errors) > 0 {
		t.Errorf("%d of %d requests failed during the slowdown; want none: %q", len(slow.errors), slow.total, firstFew(slow.errors))
	}
	if len(seen.over) > 0 {
		t.Errorf("more than %d upstreams ejected at once in %d of %d samples, e.g. %s", eidCap, len(seen.over), seen.samples, seen.over[0])
	}
	if seen.maxEjected != eidCap || seen.overflow == 0 {
		// Every backend hangs first attempts, so without the cap more
		// than eidCap would be out; a run where the cap was never
		// reached, or never refused an ejection, proves nothing about it.
		t.Errorf("at most %d upstreams out at once, %d ejections refused by the cap: the slowdown did not press against the cap of %d",
			seen.maxEjected, seen.overflow, eidCap)
	}
	if !seen.panicSeen || !p.Panic || p.PanicEntered < 1 {
		t.Errorf("pool not in panic mode with every health check failing: panic seen %v, now %v, panic_entered_total %d",
			seen.panicSeen, p.Panic, p.PanicEntered)
	}

	// Recovery: every upstream available again and used again.
	f.slow.Store(false)
	recStart := time.Now()
	e.waitPool("/rec", "every upstream available and panic over after the slowdown", func(p poolInfo) bool {
		return p.Available == eidUpstreams && !p.Panic
	}, bs...)
	recovered := time.Since(recStart)
	used := map[string]int{}
	waitFor(t, 15*time.Second, "every backend to serve again after the slowdown", func() (bool, string) {
		r := e.drive("/spread", 40, 8)
		for name, n := range r.counts {
			used[name] += n
		}
		if len(r.errors) > 0 {
			t.Errorf("%d requests failed after the recovery: %q", len(r.errors), firstFew(r.errors))
		}
		var idle []string
		for _, b := range bs {
			if used[b.name] == 0 {
				idle = append(idle, b.name)
			}
		}
		return len(idle) == 0, fmt.Sprintf("not used yet: %v; used: %v", idle, used)
	})
	t.Logf("recovered: all %d upstreams available after %v, all used within %v of the reset: %v",
		eidUpstreams, recovered.Round(time.Millisecond), time.Since(recStart).Round(time.Millisecond), used)
	watch.stop()
	if over := watch.read().over[len(seen.over):]; len(over) > 0 {
		t.Errorf("more than %d upstreams ejected at once during the recovery: %s", eidCap, over[0])
	}
}

// ejectionWatch samples the admin API in the background: how many of a
// pool's upstreams are ejected at once, whether the pool is in panic, and
// and the most ejections max_ejection_percent has refused so far.
type ejectionWatch struct {
	mu         sync.Mutex
	samples    int
	maxEjected int
	over       []string // samples with more than eidCap ejected
	panicSeen  bool
	overflow   uint64

	quit chan struct{}
	done chan struct{}
	once sync.Once
}

// eidUpstream is the part of an admin API upstream entry the watch reads,
// with the consecutive_failures that helpers' upstreamInfo leaves out.
type eidUpstream struct {
	Dial        string  `json:"dial"`
	EjectedMs   float64 `json:"ejected_for_ms"`
	Consecutive int64   `json:"consecutive_failures"`
	Overflow    uint64  `json:"ejections_overflow_total"`
}

type eidReport struct {
	Upstreams []eidUpstream `json:"upstreams"`
	Pools     []poolInfo    `json:"pools"`
}

func fetchEidReport() (eidReport, error) {
	var rep eidReport
	res, err := adminClient.Get("http://" + adminAddr + "/lbx/upstreams?limit=1000")
	if err != nil {
		return rep, err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return rep, fmt.Errorf("GET /lbx/upstreams: status %d", res.StatusCode)
	}
	return rep, json.NewDecoder(res.Body).Decode(&rep)
}

func (e *env) watchEjections(bs []*backend) *ejectionWatch {
	w := &ejectionWatch{quit: make(chan struct{}), done: make(chan struct{})}
	dials := make(map[string]string, len(bs))
	for _, b := range bs {
		dials[b.addr] = b.name
	}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-w.quit:
				return
			case <-tick.C:
			}
			rep, err := fetchEidReport()
			if err != nil {
				continue
			}
			var ejected []string
			var overflow uint64
			for _, u := range rep.Upstreams {
				name, ours := dials[u.Dial]
				if !ours {
					continue
				}
				overflow += u.Overflow
				if u.EjectedMs > 0 {
					ejected = append(ejected, fmt.Sprintf("%s for %.0fms", name, u.EjectedMs))
				}
			}
			panicking := false
			for _, p := range rep.Pools {
				if len(p.Upstreams) > 0 && dials[p.Upstreams[0].Dial] != "" {
					panicking = panicking || p.Panic
				}
			}
			w.mu.Lock()
			w.samples++
			w.maxEjected = max(w.maxEjected, len(ejected))
			if len(ejected) > eidCap {
				w.over = append(w.over, strings.Join(ejected, ", "))
			}
			w.overflow = max(w.overflow, overflow)
			w.panicSeen = w.panicSeen || panicking
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *ejectionWatch) stop() {
	w.once.Do(func() { close(w.quit) })
	<-w.done
}

// ejectionStats is what an ejectionWatch has seen so far.
type ejectionStats struct {
	samples, maxEjected int
	overflow            uint64
	over                []string
	panicSeen           bool
}

func (w *ejectionWatch) read() ejectionStats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return ejectionStats{w.samples, w.maxEjected, w.overflow, slices.Clone(w.over), w.panicSeen}
}

// ---- Flapping ----

// The flapping test's timings. The flapping backend answers 503 at once
// for flapBad, then 200 for the rest of flapPeriod (shorter than a base
// ejection time, and out of step with it); the healthy ones take
// flapServe per request, so the flapping one, fast even when it fails, is
// always tried again at once: the worst case, where only the backoff keeps
// it from flapping in and out.
const (
	flapPeriod = 600 * time.Millisecond
	flapBad    = 350 * time.Millisecond
	flapServe  = 10 * time.Millisecond
	flapBase   = 500 * time.Millisecond // base_ejection_time
	flapMax    = 4 * time.Second        // max_ejection_time
)

// flapper makes a backend alternate between bad and good phases, and
// records when each request reached it.
type flapper struct {
	mu       sync.Mutex
	start    time.Time // zero: not flapping (good)
	arrivals []time.Time
}

func (f *flapper) begin() {
	f.mu.Lock()
	f.start = time.Now()
	f.mu.Unlock()
}

func (f *flapper) wrap(b *backend) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			b.ServeHTTP(w, r)
			return
		}
		now := time.Now()
		f.mu.Lock()
		f.arrivals = append(f.arrivals, now)
		bad := !f.start.IsZero() && now.Sub(f.start)%flapPeriod < flapBad
		f.mu.Unlock()
		if bad {
			w.Header().Set("X-Backend", b.name)
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		b.ServeHTTP(w, r)
	})
}

// arrivalsBetween returns the requests that reached the backend in (from, to).
func (f *flapper) arrivalsBetween(from, to time.Time) []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []time.Time
	for _, a := range f.arrivals {
		if a.After(from) && a.Before(to) {
			out = append(out, a)
		}
	}
	return out
}

// flapBound is the most ejections the backoff allows in run when the
// multiplier never decays: the k-th ejection can begin only when the k-1
// before it, of 1, 2, … × base (capped), have run their course.
func flapBound(run time.Duration) int {
	bound, spent := 1, time.Duration(0)
	for {
		spent += min(time.Duration(bound)*flapBase, flapMax)
		if spent > run {
			return bound
		}
		bound++
	}
}

// A backend that alternates between failing and answering is ejected for
// longer and longer: the n-th ejection in a row lasts n × base (capped),
// it receives nothing while ejected, and over a bounded run it is ejected
// no more often than that backoff allows. The healthy backends are never
// ejected.
func TestFlappingBackendBacksOff(t *testing.T) {
	e := newEnv(t)
	healthy := e.startBackends(3)
	for _, b := range healthy {
		b.delay.Store(int64(flapServe))
	}
	fl := new(flapper)
	flap := e.accBackend("flap", fl.wrap)
	bs := append(slices.Clone(healthy), flap)

	accEvents.reset()
	// A short decay: a latency spike of the flapping backend (a stalled
	// machine) must not keep ewma away from it for long, or it would not
	// be tried again when an ejection ends.
	e.accLoad(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		decay 100ms
		outlier {
			consecutive_failures 3
			base_ejection_time %v
			max_ejection_time %v
		}
	}
}`, dials(bs...), flapBase, flapMax), "upstream_ejected", "upstream_restored")
	if warm := e.drive("/", 40, 4); len(warm.errors) > 0 {
		t.Fatalf("warm-up failed: %q", warm.errors)
	}

	const (
		interval = 5 * time.Millisecond // 200 req/s
		n        = 1400                 // 7 s
		conc     = 8
	)
	fl.begin()
	start := time.Now()
	res := e.drivePaced("/", n, conc, interval)
	run := time.Since(start)
	ejections := accEvents.of("upstream_ejected")
	restores := accEvents.of("upstream_restored")
	t.Logf("%d requests in %v: %v, %d answered 503", res.total, run.Round(time.Millisecond), res.counts, len(res.errors))
	for i, ev := range ejections {
		t.Logf("ejection %d: %s at +%v for %dms (number %d in a row, %s)",
			i+1, ev.host, ev.at.Sub(start).Round(time.Millisecond), ev.forMs, ev.inARow, ev.reason)
	}

	for _, ev := range slices.Concat(ejections, restores) {
		if ev.host != flap.addr {
			t.Errorf("%s event for %s, a healthy backend", ev.name, ev.host)
		}
	}
	rep := report(t)
	for _, b := range healthy {
		if u, _ := rep.upstream(b.addr); u.Ejections != 0 {
			t.Errorf("healthy %s was ejected %d times", b.name, u.Ejections)
		}
	}
	var flapEj []accEvent
	for _, ev := range ejections {
		if ev.host == flap.addr {
			flapEj = append(flapEj, ev)
		}
	}
	if u, _ := rep.upstream(flap.addr); int(u.Ejections) != len(flapEj) {
		t.Errorf("admin API counts %d ejections of the flapping backend, the events %d", u.Ejections, len(flapEj))
	}
	if len(flapEj) < 3 {
		t.Fatalf("flapping backend ejected %d times in %v; want at least 3 to see the backoff", len(flapEj), run)
	}

	// Slack for timing seen from outside: a request chosen just before an
	// ejection reaches the backend just after it, and the event is
	// recorded a moment after the ejection began.
	const slack = 100 * time.Millisecond
	var (
		outFor  []time.Duration
		decayed int // re-ejections that came a whole base after the return
	)
	for k, ev := range flapEj {
		d := time.Duration(ev.forMs) * time.Millisecond
		if want := min(time.Duration(ev.inARow)*flapBase, flapMax); ev.inARow < 1 || d != want {
			t.Errorf("ejection %d lasts %v as number %d in a row; want %v", k+1, d, ev.inARow, want)
		}
		if ev.reason != "consecutive_failures" {
			t.Errorf("ejection %d: reason %q, want consecutive_failures", k+1, ev.reason)
		}
		if got := fl.arrivalsBetween(ev.at.Add(slack), ev.at.Add(d-slack)); len(got) > 0 {
			t.Errorf("ejection %d (%v from +%v): %d requests reached the flapping backend while it was out, the first at +%v",
				k+1, d, ev.at.Sub(start).Round(time.Millisecond), len(got), got[0].Sub(start).Round(time.Millisecond))
		}
		outFor = append(outFor, d)
		if k == 0 {
			if ev.inARow != 1 {
				t.Errorf("first ejection is number %d in a row; want 1", ev.inARow)
			}
			continue
		}
		prev := flapEj[k-1]
		prevD := time.Duration(prev.forMs) * time.Millisecond
		gap := ev.at.Sub(prev.at)
		if gap < prevD-slack {
			t.Errorf("ejection %d began %v after ejection %d, which lasts %v: back in before its time", k+1, gap, k, prevD)
		}
		// The multiplier drops by one for each base the backend was
		// back in before this ejection, and otherwise grows by one.
		back := gap - prevD
		if back >= flapBase-slack {
			decayed++
		}
		hi := max(prev.inARow-int64(max(back-slack, 0)/flapBase), 0) + 1
		lo := max(prev.inARow-int64((back+slack)/flapBase), 0) + 1
		if ev.inARow < lo || ev.inARow > hi {
			t.Errorf("ejection %d is number %d in a row, %v after ejection %d (number %d) ended; want %d..%d",
				k+1, ev.inARow, back.Round(time.Millisecond), k, prev.inARow, lo, hi)
		}
	}
	t.Logf("the flapping backend was out for %v; back in for at least a base before %d of its re-ejections", outFor, decayed)

	// Each return is announced once, after the ejection's time is up and
	// before the next ejection; and it did come back and serve in its
	// good phases: held out, not shut out.
	if len(restores) > len(flapEj) || len(restores) < len(flapEj)-1 {
		t.Errorf("%d upstream_restored events for %d ejections", len(restores), len(flapEj))
	}
	for k, r := range restores {
		if k >= len(flapEj) {
			break
		}
		ev := flapEj[k]
		if end := ev.at.Add(time.Duration(ev.forMs)*time.Millisecond - slack); r.at.Before(end) {
			t.Errorf("return %d announced at +%v, before ejection %d (+%v for %dms) was up",
				k+1, r.at.Sub(start).Round(time.Millisecond), k+1, ev.at.Sub(start).Round(time.Millisecond), ev.forMs)
		}
		// (the return is announced by the first attempt judged after it,
		// which may finish its announcement a moment after attempts right
		// behind it ejected the backend again)
		if k+1 < len(flapEj) && r.at.After(flapEj[k+1].at.Add(slack)) {
			t.Errorf("return %d announced at +%v, after the next ejection at +%v",
				k+1, r.at.Sub(start).Round(time.Millisecond), flapEj[k+1].at.Sub(start).Round(time.Millisecond))
		}
	}
	if res.counts[flap.name] == 0 {
		t.Errorf("the flapping backend served no request in its good phases: %v", res.counts)
	}

	// Over the run: no more ejections than the backoff allows. The bound
	// assumes the multiplier never decays, which holds when the backend
	// fails again within a base of each return (it is good for
	// flapPeriod-flapBad at most and then fails at once); if a starved
	// machine kept it away longer, only the base each ejection lasts at
	// least is left to bound them.
	bound := flapBound(run)
	if decayed > 0 {
		bound = 1 + int(run/flapBase) // each ejection lasts a base at least
	}
	t.Logf("%d ejections of the flapping backend in %v; the backoff allows at most %d", len(flapEj), run.Round(time.Millisecond), bound)
	if len(flapEj) > bound {
		t.Errorf("flapping backend ejected %d times in %v; the backoff allows at most %d", len(flapEj), run, bound)
	}
	if last := outFor[len(outFor)-1]; last < 3*flapBase {
		t.Errorf("ejections of the flapping backend lasted %v: it flaps at the pace of the first ejection, not backing off", outFor)
	}
}

// ---- shared ----

// accBackend starts a plain HTTP backend whose handler is wrap(b): b's
// own counters and answers, behind a test's switch. It is closed in the
// test's cleanup like every other backend.
func (e *env) accBackend(name string, wrap func(*backend) http.Handler) *backend {
	e.t.Helper()
	b := &backend{name: name}
	b.healthCode.Store(http.StatusOK)
	b.srv = httptest.NewUnstartedServer(wrap(b))
	b.srv.Start()
	b.addr = b.srv.Listener.Addr().String()
	e.backends = append(e.backends, b)
	return b
}

// accSleep waits d or until ctx ends, and reports whether d passed.
func accSleep(ctx context.Context, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// firstFew returns at most the first three of errs, for messages.
func firstFew(errs []string) []string { return errs[:min(len(errs), 3)] }

// accLoad is load with the events app subscribing accEvents to the named
// events.
func (e *env) accLoad(site string, events ...string) {
	e.t.Helper()
	var sub strings.Builder
	sub.WriteString("\tevents {\n")
	for _, name := range events {
		fmt.Fprintf(&sub, "\t\ton %s %s\n", name, accRecorderName)
	}
	sub.WriteString("\t}\n}\n")
	global := strings.TrimSuffix(globalOptions(), "}\n") + sub.String()
	e.loaded = true
	e.tb.failed.Store(false)
	waitOldAdminGone(e.t)
	e.tester.InitServer(global+fmt.Sprintf(":%d {\n%s\n}\n", httpPort, site), "caddyfile")
	if e.tb.failed.Load() {
		e.t.FailNow()
	}
	lbxtest.SettleReload(e.t, e.client, httpPort)
}

// accRecorderName names an events handler this test binary registers:
// it records every event it is given in accEvents.
const accRecorderName = "lbx_acceptance_recorder"

func init() {
	caddy.RegisterModule(accRecorder{})
}

// accRecorder is an events handler that appends to accEvents.
type accRecorder struct{}

// CaddyModule returns the Caddy module information.
func (accRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "events.handlers." + accRecorderName,
		New: func() caddy.Module { return new(accRecorder) },
	}
}

// UnmarshalCaddyfile takes no arguments.
func (*accRecorder) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler's name
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}

// Handle records e.
func (*accRecorder) Handle(_ context.Context, e caddy.Event) error {
	accEvents.add(e)
	return nil
}

// accEvent is one recorded event: when it was handed to the recorder, and
// the data lbx's events carry.
type accEvent struct {
	at     time.Time
	name   string
	host   string
	reason string
	forMs  int64
	inARow int64
}

type accEventLog struct {
	mu   sync.Mutex
	list []accEvent
}

// accEvents is what the recorder saw since the last reset.
var accEvents accEventLog

func (l *accEventLog) add(e caddy.Event) {
	ev := accEvent{at: time.Now(), name: e.Name()}
	ev.host, _ = e.Data["host"].(string)
	ev.reason, _ = e.Data["reason"].(string)
	ev.forMs = accInt(e.Data["for_ms"])
	ev.inARow = accInt(e.Data["ejections_in_a_row"])
	l.mu.Lock()
	l.list = append(l.list, ev)
	l.mu.Unlock()
}

// accInt reads a whole number of an event's data; -1 when it is missing
// or of another type, which no check accepts.
func accInt(v any) int64 {
	if n, ok := v.(int64); ok {
		return n
	}
	return -1
}

func (l *accEventLog) reset() {
	l.mu.Lock()
	l.list = nil
	l.mu.Unlock()
}

// of returns the recorded events named name, in order.
func (l *accEventLog) of(name string) []accEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []accEvent
	for _, ev := range l.list {
		if ev.name == name {
			out = append(out, ev)
		}
	}
	return out
}

// Interface guards
var (
	_ caddyevents.Handler   = (*accRecorder)(nil)
	_ caddyfile.Unmarshaler = (*accRecorder)(nil)
)
