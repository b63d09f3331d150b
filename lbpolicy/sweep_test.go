package lbpolicy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// hostTraffic is one upstream's traffic in an interval: judged attempts, of
// which failed.
type hostTraffic struct{ judged, failed int }

// full is an upstream with n attempts and no failure.
func full(n int) hostTraffic { return hostTraffic{n, 0} }

// sweepPool makes a table of one upstream per entry of traffic, starts a
// sweeper on it (its interval begins now), records the traffic as judge
// would and returns the sweeper and the upstreams in order.
func sweepPool(t *testing.T, o *Outlier, traffic []hostTraffic) (*sweeper, []*hoststate.Stats) {
	t.Helper()
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	hosts := make([]*hoststate.Stats, len(traffic))
	for i := range traffic {
		// zero-padded, so Members (sorted by dial) keeps this order
		hosts[i] = table.Stats(fmt.Sprintf("%s-%02d:80", t.Name(), i))
	}
	sw := newSweeper(o, table)
	for i, a := range traffic {
		record(hosts[i], a)
	}
	return sw, hosts
}

// record counts a's attempts on s the way judge does (without judging).
func record(s *hoststate.Stats, a hostTraffic) {
	for i := range a.judged {
		s.RecordOutcome(i < a.failed)
	}
}

// ejectedIndexes returns the positions in hosts of the dials in ejected.
func ejectedIndexes(hosts []*hoststate.Stats, ejected []string) []int {
	var out []int
	for i, s := range hosts {
		if slices.Contains(ejected, s.Dial()) {
			out = append(out, i)
		}
	}
	return out
}

func TestSuccessRateSweep(t *testing.T) {
	// Four upstreams at 100% and one at 50%, 100 attempts each: the mean
	// is 90%, σ = 20 points. With the default factor 1.9 the threshold
	// is 52%.
	four := []hostTraffic{full(100), full(100), full(100), full(100)}
	outlier := append(slices.Clone(four), hostTraffic{100, 50})
	cases := []struct {
		name    string
		cfg     Outlier
		traffic []hostTraffic
		want    []int // ejected upstreams
	}{
		{"exactly min hosts and min requests", Outlier{}, outlier, []int{4}},
		{"one host below min hosts", Outlier{SuccessRateMinHosts: 6}, outlier, nil},
		{"min hosts counts only hosts with min requests",
			Outlier{}, append([]hostTraffic{full(100), full(100), full(100), full(99)}, hostTraffic{100, 50}), nil},
		{"outlier one attempt below min requests: not judged",
			Outlier{}, append(slices.Clone(four), full(100), hostTraffic{99, 60}), nil},
		{"rate exactly at mean − k·σ is not ejected", Outlier{SuccessRateStdevFactor: 2}, outlier, nil},
		{"rate just below mean − k·σ is ejected", Outlier{SuccessRateStdevFactor: 1.99}, outlier, []int{4}},
		{"σ = 0 ejects nothing", Outlier{SuccessRateStdevFactor: 0.001},
			[]hostTraffic{{100, 10}, {100, 10}, {100, 10}, {100, 10}, {100, 10}}, nil},
		// 100×60/101 summed five times and divided by five is not quite
		// the rate itself: σ comes out as 7e-15, not 0.
		{"σ = 0 up to rounding ejects nothing", Outlier{SuccessRateStdevFactor: 0.001},
			[]hostTraffic{{101, 40}, {101, 40}, {101, 40}, {101, 40}, {101, 40}}, nil},
		{"success_rate off", Outlier{DisableSuccessRate: true}, outlier, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.MaxEjectionPercent = percent(100)
			o := newOutlier(t, c.cfg)
			sw, hosts := sweepPool(t, o, c.traffic)
			now := monoclock.Now()
			ejected, skipped := sw.sweep(now)
			if got := ejectedIndexes(hosts, ejected); !slices.Equal(got, c.want) || len(skipped) != 0 {
				t.Fatalf("ejected %v (skipped %v), want %v", got, skipped, c.want)
			}
			for i, s := range hosts {
				if s.Ejected(now) != slices.Contains(c.want, i) {
					t.Errorf("upstream %d ejected: %v", i, s.Ejected(now))
				}
			}
			for _, i := range c.want {
				if snap := hosts[i].Snapshot(now); snap.Outlier.LastReason != hoststate.ReasonSuccessRate ||
					snap.Outlier.ByReason[hoststate.ReasonSuccessRate] != 1 || snap.Ejections != 1 {
					t.Errorf("upstream %d: %+v, want one success_rate ejection", i, snap.Outlier)
				}
			}
		})
	}
}

func TestFailurePercentageSweep(t *testing.T) {
	five := []hostTraffic{full(50), full(50), full(50), full(50), full(50)}
	cases := []struct {
		name    string
		cfg     Outlier
		traffic []hostTraffic
		want    []int
	}{
		{"off by default", Outlier{}, append(slices.Clone(five), hostTraffic{50, 50}), nil},
		{"above the threshold", Outlier{FailurePercentageThreshold: percent(50)},
			append(slices.Clone(five), hostTraffic{50, 26}), []int{5}},
		{"exactly at the threshold is not ejected", Outlier{FailurePercentageThreshold: percent(50)},
			append(slices.Clone(five), hostTraffic{50, 25}), nil},
		{"exactly min hosts and min requests", Outlier{FailurePercentageThreshold: percent(50)},
			append(slices.Clone(five[:4]), hostTraffic{50, 50}), []int{4}},
		{"one host below min hosts", Outlier{FailurePercentageThreshold: percent(50)},
			append(slices.Clone(five[:3]), full(49), hostTraffic{50, 50}), nil},
		{"one attempt below min requests", Outlier{FailurePercentageThreshold: percent(50)},
			append(slices.Clone(five), hostTraffic{49, 49}), nil},
		{"threshold 0 ejects any failure", Outlier{FailurePercentageThreshold: percent(0)},
			append(slices.Clone(five), hostTraffic{50, 1}), []int{5}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.MaxEjectionPercent = percent(100)
			c.cfg.DisableSuccessRate = true
			o := newOutlier(t, c.cfg)
			sw, hosts := sweepPool(t, o, c.traffic)
			now := monoclock.Now()
			ejected, _ := sw.sweep(now)
			if got := ejectedIndexes(hosts, ejected); !slices.Equal(got, c.want) {
				t.Fatalf("ejected %v, want %v", got, c.want)
			}
			for _, i := range c.want {
				if r := hosts[i].Snapshot(now).Outlier; r.LastReason != hoststate.ReasonFailurePercentage || !hosts[i].Ejected(now) {
					t.Errorf("upstream %d: %+v, want ejected for failure_percentage", i, r)
				}
			}
		})
	}
}

func TestSweepAtCapEjectsWorstFirstAndLogsOnce(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	o := Outlier{FailurePercentageThreshold: percent(10), DisableSuccessRate: true, MaxEjectionPercent: percent(20)}
	o.provision(zap.New(core), events.Emitter{})
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	// Ten upstreams, the cap is two. Three fail too often: 20%, 60%, 40%.
	traffic := []hostTraffic{full(50), full(50), full(50), full(50), full(50), full(50), full(50),
		{50, 10}, {50, 30}, {50, 20}}
	sw, hosts := sweepPool(t, &o, traffic)
	now := monoclock.Now()
	ejected, skipped := sw.sweep(now)
	if got := ejectedIndexes(hosts, ejected); !slices.Equal(got, []int{8, 9}) || ejected[0] != hosts[8].Dial() {
		t.Fatalf("ejected %v (%v), want the worst two, 60%% first: [8 9]", got, ejected)
	}
	if !slices.Equal(skipped, []string{hosts[7].Dial()}) || hosts[7].Ejected(now) {
		t.Fatalf("skipped %v, want upstream 7 left in at the cap", skipped)
	}
	atCap := logs.FilterMessage("outliers not ejected: pool at max_ejection_percent").All()
	if len(atCap) != 1 {
		t.Fatalf("%d log lines about the cap, want one per sweep", len(atCap))
	}
	if f := atCap[0].ContextMap(); f["ejected"] != int64(2) || f["pool"] != int64(10) {
		t.Errorf("cap log fields %v", f)
	}
	ejections := logs.FilterMessage("upstream ejected").All()
	if len(ejections) != 2 || ejections[0].ContextMap()["reason"] != "failure_percentage" {
		t.Fatalf("ejection log lines %v", ejections)
	}

	// The next sweep sees only what happened since: nothing.
	if ejected, skipped := sw.sweep(monoclock.Now()); len(ejected)+len(skipped) != 0 {
		t.Fatalf("second sweep without new attempts: ejected %v, skipped %v", ejected, skipped)
	}
	if logs.FilterMessage("outliers not ejected: pool at max_ejection_percent").Len() != 1 {
		t.Fatal("the cap was logged again without new candidates")
	}
}

func TestSweepWorksOnDeltasAndSkipsEjected(t *testing.T) {
	o := newOutlier(t, Outlier{FailurePercentageThreshold: percent(50), DisableSuccessRate: true})
	traffic := []hostTraffic{full(100), full(100), full(100), full(100), full(100), {100, 90}}
	sw, hosts := sweepPool(t, o, traffic)
	// Upstream 5 is already ejected (say for consecutive failures), which
	// puts the pool at the cap (10% of 6: one): it is neither ejected
	// again nor reported as left in at the cap.
	now := monoclock.Now()
	o.eject(hosts[5], now, hoststate.ReasonConsecutiveFailures)
	before := hosts[4].Tally()
	if ejected, skipped := sw.sweep(now); len(ejected)+len(skipped) != 0 {
		t.Fatalf("ejected %v, skipped %v; want nothing", ejected, skipped)
	}
	if hosts[4].Tally() != before {
		t.Fatal("a sweep must not change the shared counters")
	}
	if n := hosts[5].Snapshot(now).Ejections; n != 1 {
		t.Fatalf("already ejected upstream ejected again: %d ejections", n)
	}
	*o.MaxEjectionPercent = 100
	// The next interval: upstream 4 fails 51 of 100. Counted from the
	// start it failed 51 of 200 (25.5%); only this interval's attempts
	// count: 51%.
	for i, a := range []hostTraffic{full(100), full(100), full(100), full(100), {100, 51}} {
		record(hosts[i], a)
	}
	ejected, _ := sw.sweep(monoclock.Now())
	if got := ejectedIndexes(hosts, ejected); !slices.Equal(got, []int{4}) {
		t.Fatalf("ejected %v, want [4]", got)
	}
	if r := hosts[4].Snapshot(monoclock.Now()).Outlier.LastReason; r != hoststate.ReasonFailurePercentage {
		t.Fatalf("reason %v", r)
	}
}

func TestSweepLeavesOutHostsNewToTheTable(t *testing.T) {
	o := newOutlier(t, Outlier{FailurePercentageThreshold: percent(10), MaxEjectionPercent: percent(100), DisableSuccessRate: true})
	traffic := []hostTraffic{full(50), full(50), full(50), full(50), full(50)}
	sw, hosts := sweepPool(t, o, traffic)
	// A new upstream with history from elsewhere: all failures.
	late := sw.table.Stats(t.Name() + "-late:80")
	record(late, hostTraffic{1000, 1000})
	if ejected, _ := sw.sweep(monoclock.Now()); len(ejected) != 0 {
		t.Fatalf("an upstream the sweeper never saw before was judged on its whole history: %v", ejected)
	}
	// From its first sighting on it is judged like the others.
	for _, s := range append(hosts, late) {
		record(s, full(50))
	}
	record(late, hostTraffic{50, 50})
	ejected, _ := sw.sweep(monoclock.Now())
	if !slices.Equal(ejected, []string{late.Dial()}) {
		t.Fatalf("ejected %v, want the late upstream", ejected)
	}
}

func TestSuccessRateCheckedBeforeFailurePercentage(t *testing.T) {
	o := newOutlier(t, Outlier{FailurePercentageThreshold: percent(10), MaxEjectionPercent: percent(100)})
	sw, hosts := sweepPool(t, o, []hostTraffic{full(100), full(100), full(100), full(100), {100, 50}})
	now := monoclock.Now()
	if ejected, _ := sw.sweep(now); !slices.Equal(ejected, []string{hosts[4].Dial()}) {
		t.Fatalf("ejected %v", ejected)
	}
	if r := hosts[4].Snapshot(now).Outlier; r.LastReason != hoststate.ReasonSuccessRate || r.ByReason[hoststate.ReasonFailurePercentage] != 0 {
		t.Fatalf("an upstream both rules flag is ejected once, for success_rate: %+v", r)
	}

	// At the cap (one of five, taken by upstream 0) it is left in, and
	// reported once.
	t.Run("at the cap", func(t *testing.T) {
		o := newOutlier(t, Outlier{FailurePercentageThreshold: percent(10)})
		sw, hosts := sweepPool(t, o, []hostTraffic{full(100), full(100), full(100), full(100), {100, 50}})
		now := monoclock.Now()
		o.eject(hosts[0], now, hoststate.ReasonConsecutiveFailures)
		if ejected, skipped := sw.sweep(now); len(ejected) != 0 || !slices.Equal(skipped, []string{hosts[4].Dial()}) {
			t.Fatalf("ejected %v, skipped %v; want upstream 4 skipped once", ejected, skipped)
		}
	})
}

func TestTallySince(t *testing.T) {
	var s hoststate.Stats
	prev := s.Tally()
	record(&s, hostTraffic{7, 3})
	if j, f := s.Tally().Since(prev); j != 7 || f != 3 {
		t.Fatalf("Since = %d judged, %d failed; want 7, 3", j, f)
	}
	// Across the wrap of the failures field (and of the whole word), the
	// difference stays exact.
	for _, start := range []hoststate.Tally{1<<32 - 2, ^hoststate.Tally(0) - 5<<32} {
		cur := start + 4<<32 + 3 // four attempts, three failed
		if j, f := cur.Since(start); j != 4 || f != 3 {
			t.Errorf("from %#x: %d judged, %d failed; want 4, 3", uint64(start), j, f)
		}
	}
}

// statusTransport answers every request with one status code.
type statusTransport int

func (c statusTransport) RoundTrip(*http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: int(c), Body: http.NoBody}, nil
}

func TestJudgedAttemptsAreCounted(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	o := newOutlier(t, Outlier{Consecutive: 100})
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
	s := table.Stats(u.Dial)
	start := s.Tally()
	for _, inner := range []http.RoundTripper{
		statusTransport(200), statusTransport(503), statusTransport(404),
		fakeTransport{err: errors.New("connection refused")},
	} {
		ot := &observingTransport{inner: inner, table: table, outlier: o}
		_, _ = ot.RoundTrip(request(context.Background(), u, false))
	}
	// A client that went away is not judged; nor is a health check.
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	ot := &observingTransport{inner: fakeTransport{delay: time.Minute}, table: table, outlier: o}
	if _, err := ot.RoundTrip(request(gone, u, false)); err == nil {
		t.Fatal("want cancellation error")
	}
	ot = &observingTransport{inner: statusTransport(503), table: table, outlier: o}
	_, _ = ot.RoundTrip(request(context.Background(), u, true))

	if j, f := s.Tally().Since(start); j != 4 || f != 2 {
		t.Fatalf("judged %d, failed %d; want 4 (200, 503, 404, refused), 2 (503, refused)", j, f)
	}
}

// provisionOutlierProxy provisions a reverse_proxy handler of two
// upstreams whose probe policy has the outlier block outlierJSON, and
// returns the probe and the function that cancels its context.
func provisionOutlierProxy(t *testing.T, outlierJSON string) (*probePolicy, context.CancelFunc) {
	t.Helper()
	_, p, cancel := provisionProxy(t, `{"upstreams":[{"dial":"127.0.0.1:1"},{"dial":"127.0.0.1:2"}],
		"load_balancing":{"selection_policy":{"policy":"lbx_probe","outlier":`+outlierJSON+`}}}`)
	return p, cancel
}

func TestInstallSweepLoopEndsWithContext(t *testing.T) {
	// One upstream is enough for the failure-percentage rule here; the
	// loop must sweep (and eject) while the context lives.
	p, cancel := provisionOutlierProxy(t, `{"interval":"100ms","disable_success_rate":true,
		"failure_percentage_threshold":0,"failure_percentage_min_hosts":1,"failure_percentage_min_requests":1,
		"consecutive_failures":1000,"max_ejection_percent":100}`)
	done := p.Outlier.sweepDone
	if done == nil {
		t.Fatal("install started no sweep loop")
	}
	s := p.table.Stats("127.0.0.1:1")
	p.Outlier.judge(p.table, s, "127.0.0.1:1", true)
	for deadline := time.Now().Add(10 * time.Second); !s.Ejected(monoclock.Now()); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the sweep loop did not eject a failing upstream within 10s")
		}
	}
	select {
	case <-done:
		t.Fatal("the sweep loop ended before its context")
	default:
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the sweep loop still runs 10s after its context was cancelled")
	}
}

func TestInstallStartsNoLoopWithoutIntervalRules(t *testing.T) {
	p, _ := provisionOutlierProxy(t, `{"disable_success_rate":true}`)
	if p.Outlier.sweepDone != nil {
		t.Fatal("a sweep loop was started with both interval rules off")
	}
}

func TestAdminReportShowsEjectionReason(t *testing.T) {
	o := newOutlier(t, Outlier{})
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	never, ejected := table.Stats(t.Name()+"-never:80"), table.Stats(t.Name()+"-ejected:80")
	o.eject(ejected, monoclock.Now(), hoststate.ReasonFailurePercentage)

	views := map[string]upstreamView{}
	for _, v := range buildUpstreamsPage(pageQuery{limit: maxPageLimit}).Upstreams {
		views[v.Dial] = v
	}
	if v := views[never.Dial()]; v.EjectionReason != "" || len(v.EjectionsByReason) != 3 || v.EjectionsByReason["success_rate"] != 0 {
		t.Errorf("never ejected: reason %q, by reason %v", v.EjectionReason, v.EjectionsByReason)
	}
	v := views[ejected.Dial()]
	if v.EjectionReason != "failure_percentage" || v.Ejections != 1 || v.EjectedForMs <= 0 ||
		v.EjectionsByReason["failure_percentage"] != 1 || v.EjectionsByReason["consecutive_failures"] != 0 {
		t.Fatalf("ejected: %+v", v)
	}
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]any
	if err := json.Unmarshal(raw, &fields); err != nil {
		t.Fatal(err)
	}
	if fields["ejection_reason"] != "failure_percentage" || fields["ejections_total"] != 1.0 {
		t.Fatalf("admin JSON %s", raw)
	}
}

func TestSweepEjectionEmitsEventWithReason(t *testing.T) {
	ctx, rec := lbxtest.SubscribeEvents(t, eventUpstreamEjected)
	o := Outlier{MaxEjectionPercent: percent(100)}
	o.provision(zap.NewNop(), events.New(ctx))
	sw, hosts := sweepPool(t, &o, []hostTraffic{full(100), full(100), full(100), full(100), {100, 50}})
	sw.sweep(monoclock.Now())
	evs := rec.Events()
	if len(evs) != 1 {
		t.Fatalf("%d upstream_ejected events; want 1", len(evs))
	}
	if e := evs[0]; e.Data["host"] != hosts[4].Dial() || e.Data["reason"] != "success_rate" || e.Data["for_ms"] != int64(30000) ||
		e.Data["ejections_in_a_row"] != int64(1) {
		t.Fatalf("event %s %v", e.Name(), e.Data)
	}
}
