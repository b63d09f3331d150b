package lbpolicy

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func newOutlier(t *testing.T, o Outlier) *Outlier {
	o.provision(zap.NewNop(), events.Emitter{})
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	return &o
}

func TestMayEjectCap(t *testing.T) {
	o := newOutlier(t, Outlier{})
	cases := []struct {
		ejected, total int
		want           bool
	}{
		{0, 1, true},   // one-host pool: one may always be ejected
		{1, 1, false},  // all hosts ejected
		{0, 4, true},   // 10% of 4 < 1: still one
		{1, 4, false},  // exactly at the cap
		{1, 20, true},  // 10% of 20 = 2
		{2, 20, false}, // exactly at the cap
	}
	for _, c := range cases {
		if got := o.mayEject(c.ejected, c.total); got != c.want {
			t.Errorf("mayEject(%d of %d) = %v, want %v", c.ejected, c.total, got, c.want)
		}
	}
	half := 50.0
	o = newOutlier(t, Outlier{MaxEjectionPercent: &half})
	if !o.mayEject(1, 4) || o.mayEject(2, 4) {
		t.Error("50% of 4 must allow exactly 2")
	}
}

func TestEjectionTimeBackoff(t *testing.T) {
	o := newOutlier(t, Outlier{BaseEjectionTime: caddy.Duration(30 * time.Second), MaxEjectionTime: caddy.Duration(100 * time.Second)})
	for m, want := range map[int64]time.Duration{1: 30 * time.Second, 2: 60 * time.Second, 3: 90 * time.Second, 4: 100 * time.Second, 50: 100 * time.Second} {
		if got := o.ejectionTime(m); got != want {
			t.Errorf("ejection %d: %v, want %v", m, got, want)
		}
	}
}

func TestJudgeEjectsAfterConsecutiveFailures(t *testing.T) {
	o := newOutlier(t, Outlier{Consecutive: 3, BaseEjectionTime: caddy.Duration(time.Hour)})
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	names := []string{t.Name() + "-a", t.Name() + "-b", t.Name() + "-c", t.Name() + "-d", t.Name() + "-e", t.Name() + "-f", t.Name() + "-g", t.Name() + "-h", t.Name() + "-i", t.Name() + "-j"}
	for _, n := range names {
		table.Stats(n)
	}
	a, b := table.Stats(names[0]), table.Stats(names[1])

	o.judge(table, a, names[0], true)
	o.judge(table, a, names[0], true)
	o.judge(table, a, names[0], false) // a success resets the count
	o.judge(table, a, names[0], true)
	o.judge(table, a, names[0], true)
	if a.Ejected(monoclock.Now()) {
		t.Fatal("ejected without 3 failures in a row")
	}
	o.judge(table, a, names[0], true)
	if !a.Ejected(monoclock.Now()) {
		t.Fatal("3 failures in a row must eject")
	}
	// 10% of 10 upstreams: a second ejection is refused at the cap.
	for range 5 {
		o.judge(table, b, names[1], true)
	}
	if b.Ejected(monoclock.Now()) {
		t.Fatal("ejected beyond max_ejection_percent")
	}
	if snap := a.Snapshot(monoclock.Now()); snap.Ejections != 1 || snap.EjectedFor < 59*time.Minute {
		t.Fatalf("snapshot after one ejection: %+v", snap)
	}
}

func TestEjectionMultiplierGrowsAndDecays(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	s := table.Stats(t.Name())
	base := 10 * time.Second
	dur := func(m int64) time.Duration { return base * time.Duration(m) }
	now := monoclock.Now()
	until, m, ok := s.Eject(now, base, dur, hoststate.ReasonConsecutiveFailures)
	if !ok || m != 1 || until != now+int64(base) {
		t.Fatalf("first ejection: multiplier %d, for %v", m, time.Duration(until-now))
	}
	// still ejected: a second rule (or handler) ejecting it changes nothing
	if u, m2, ok := s.Eject(now+1, base, dur, hoststate.ReasonSuccessRate); ok || u != until || m2 != 1 {
		t.Fatalf("ejecting an ejected upstream: ok %v, until %d (want %d), multiplier %d", ok, u, until, m2)
	}
	// ejected again right after returning: twice as long
	now = until + 1
	until, m, _ = s.Eject(now, base, dur, hoststate.ReasonSuccessRate)
	if m != 2 || until-now != int64(2*base) {
		t.Fatalf("second ejection in a row: multiplier %d, for %v", m, time.Duration(until-now))
	}
	// behaved for 2 base periods since returning: the multiplier drops by 2
	now = until + int64(2*base)
	if _, m, _ = s.Eject(now, base, dur, hoststate.ReasonFailurePercentage); m != 1 {
		t.Fatalf("after behaving for two periods the multiplier must be back to 1, got %d", m)
	}
	snap := s.Snapshot(now).Outlier
	if want := [hoststate.NumEjectReasons]uint64{1, 1, 1}; snap.ByReason != want || !snap.HasEjected || snap.LastReason != hoststate.ReasonFailurePercentage {
		t.Fatalf("ejections by reason %v, last %v (%v); want %v, failure_percentage", snap.ByReason, snap.LastReason, snap.HasEjected, want)
	}
}

func TestOutlierCaddyfile(t *testing.T) {
	good := `outlier {
		consecutive_failures 3
		failure_status 500 502
		base_ejection_time 10s
		max_ejection_time 1m
		max_ejection_percent 50%
	}`
	var o Outlier
	d := caddyfile.NewTestDispenser(good)
	d.Next()
	if err := o.unmarshalCaddyfile(d, "lb_policy ewma: outlier"); err != nil {
		t.Fatal(err)
	}
	if o.Consecutive != 3 || len(o.FailureStatus) != 2 || o.FailureStatus[0] != 500 ||
		time.Duration(o.BaseEjectionTime) != 10*time.Second || time.Duration(o.MaxEjectionTime) != time.Minute || *o.MaxEjectionPercent != 50 {
		t.Fatalf("parsed %+v", o)
	}
	for _, bad := range []struct{ in, want string }{
		{"outlier x", `lb_policy ewma: outlier: unexpected argument "x"; options go in a block, at Testfile:1`},
		{"outlier {\n nope 1\n}", `lb_policy ewma: outlier: unknown option "nope" (want consecutive_failures, failure_status, base_ejection_time, max_ejection_time, max_ejection_percent, interval, success_rate_min_hosts, success_rate_min_requests, success_rate_stdev_factor, failure_percentage_threshold, failure_percentage_min_hosts, failure_percentage_min_requests, success_rate or health_check_restore), at Testfile:2`},
		{"outlier {\n consecutive_failures 0\n}", "consecutive_failures 0 is below the minimum 1"},
		{"outlier {\n consecutive_failures\n}", "lb_policy ewma: outlier: consecutive_failures: missing value, at Testfile:2"},
		{"outlier {\n failure_status 700\n}", "is not an HTTP status code"},
		{"outlier {\n base_ejection_time -1s\n}", "base_ejection_time -1s is below the minimum 1ms"},
		{"outlier {\n max_ejection_time soon\n}", `lb_policy ewma: outlier: max_ejection_time "soon": want a duration such as 1s, at Testfile:2`},
		{"outlier {\n max_ejection_percent 120%\n}", `lb_policy ewma: outlier: max_ejection_percent "120%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{"outlier {\n consecutive_failures 2\n consecutive_failures 3\n}", "specified more than once"},
		{"outlier {\n consecutive_failures 2 3\n}", `lb_policy ewma: outlier: consecutive_failures: one value expected, got another: "3", at Testfile:2`},
	} {
		t.Run(bad.in, func(t *testing.T) {
			var o Outlier
			unmarshalOption(t, bad.in, bad.want, func(d *caddyfile.Dispenser) error { return o.unmarshalCaddyfile(d, "lb_policy ewma: outlier") })
		})
	}
	inverted := Outlier{BaseEjectionTime: caddy.Duration(time.Minute), MaxEjectionTime: caddy.Duration(time.Second)}
	inverted.provision(zap.NewNop(), events.Emitter{})
	if err := inverted.validate(); err == nil {
		t.Error("max_ejection_time shorter than base_ejection_time must be rejected")
	}
}

func TestOutlierIntervalRulesCaddyfile(t *testing.T) {
	good := `outlier {
		interval 5s
		success_rate off
		success_rate_min_hosts 3
		success_rate_min_requests 20
		success_rate_stdev_factor 1.5
		failure_percentage_threshold 85%
		failure_percentage_min_hosts 4
		failure_percentage_min_requests 10
	}`
	var o Outlier
	d := caddyfile.NewTestDispenser(good)
	d.Next()
	if err := o.unmarshalCaddyfile(d, "lb_policy ewma: outlier"); err != nil {
		t.Fatal(err)
	}
	if time.Duration(o.Interval) != 5*time.Second || !o.DisableSuccessRate || o.SuccessRateMinHosts != 3 ||
		o.SuccessRateMinRequests != 20 || o.SuccessRateStdevFactor != 1.5 ||
		o.FailurePercentageThreshold == nil || *o.FailurePercentageThreshold != 85 ||
		o.FailurePercentageMinHosts != 4 || o.FailurePercentageMinRequests != 10 {
		t.Fatalf("parsed %+v", o)
	}
	for in, check := range map[string]func(Outlier) bool{
		"outlier {\n success_rate on\n}":                  func(o Outlier) bool { return !o.DisableSuccessRate },
		"outlier {\n health_check_restore off\n}":         func(o Outlier) bool { return o.KeepEjectedOnHealthCheck },
		"outlier {\n health_check_restore on\n}":          func(o Outlier) bool { return !o.KeepEjectedOnHealthCheck },
		"outlier {\n failure_percentage_threshold off\n}": func(o Outlier) bool { return o.FailurePercentageThreshold == nil },
		"outlier {\n failure_percentage_threshold 0\n}": func(o Outlier) bool {
			return o.FailurePercentageThreshold != nil && *o.FailurePercentageThreshold == 0
		},
	} {
		var o Outlier
		d := caddyfile.NewTestDispenser(in)
		d.Next()
		if err := o.unmarshalCaddyfile(d, "lb_policy ewma: outlier"); err != nil || !check(o) {
			t.Errorf("%q: parsed %+v, error %v", in, o, err)
		}
	}
	for _, bad := range []struct{ in, want string }{
		{"outlier {\n interval\n}", "lb_policy ewma: outlier: interval: missing value, at Testfile:2"},
		{"outlier {\n interval 0s\n}", `interval 0s is below the minimum 100ms`},
		{"outlier {\n interval often\n}", `lb_policy ewma: outlier: interval "often": want a duration such as 1s, at Testfile:2`},
		{"outlier {\n interval 1s 2s\n}", `lb_policy ewma: outlier: interval: one value expected, got another: "2s", at Testfile:2`},
		{"outlier {\n success_rate\n}", "lb_policy ewma: outlier: success_rate: missing value, at Testfile:2"},
		{"outlier {\n success_rate maybe\n}", `lb_policy ewma: outlier: success_rate "maybe": want 'on' or 'off', at Testfile:2`},
		{"outlier {\n success_rate off on\n}", `lb_policy ewma: outlier: success_rate: one value expected, got another: "on", at Testfile:2`},
		{"outlier {\n health_check_restore\n}", "lb_policy ewma: outlier: health_check_restore: missing value, at Testfile:2"},
		{"outlier {\n health_check_restore never\n}", `lb_policy ewma: outlier: health_check_restore "never": want 'on' or 'off', at Testfile:2`},
		{"outlier {\n success_rate_min_hosts\n}", "lb_policy ewma: outlier: success_rate_min_hosts: missing value, at Testfile:2"},
		{"outlier {\n success_rate_min_hosts 0\n}", `success_rate_min_hosts 0 is below the minimum 1`},
		{"outlier {\n success_rate_min_hosts 2.5\n}", `lb_policy ewma: outlier: success_rate_min_hosts "2.5": want a whole number, at Testfile:2`},
		{"outlier {\n success_rate_min_requests\n}", "lb_policy ewma: outlier: success_rate_min_requests: missing value, at Testfile:2"},
		{"outlier {\n success_rate_min_requests -1\n}", `success_rate_min_requests -1 is below the minimum 1`},
		{"outlier {\n success_rate_stdev_factor\n}", "lb_policy ewma: outlier: success_rate_stdev_factor: missing value, at Testfile:2"},
		{"outlier {\n success_rate_stdev_factor 0\n}", `success_rate_stdev_factor must be above 0`},
		{"outlier {\n success_rate_stdev_factor -1.9\n}", `success_rate_stdev_factor -1.9 is below the minimum 0`},
		{"outlier {\n success_rate_stdev_factor NaN\n}", `success_rate_stdev_factor NaN is not a finite number`},
		{"outlier {\n success_rate_stdev_factor Inf\n}", `success_rate_stdev_factor +Inf is not a finite number`},
		{"outlier {\n success_rate_stdev_factor wide\n}", `lb_policy ewma: outlier: success_rate_stdev_factor "wide": want a number, at Testfile:2`},
		{"outlier {\n failure_percentage_threshold\n}", "lb_policy ewma: outlier: failure_percentage_threshold: missing value, at Testfile:2"},
		{"outlier {\n failure_percentage_threshold 101%\n}", `lb_policy ewma: outlier: failure_percentage_threshold "101%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{"outlier {\n failure_percentage_threshold many\n}", `lb_policy ewma: outlier: failure_percentage_threshold "many": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{"outlier {\n failure_percentage_threshold 50 60\n}", `lb_policy ewma: outlier: failure_percentage_threshold: one value expected, got another: "60", at Testfile:2`},
		{"outlier {\n failure_percentage_min_hosts\n}", "lb_policy ewma: outlier: failure_percentage_min_hosts: missing value, at Testfile:2"},
		{"outlier {\n failure_percentage_min_hosts 0\n}", `failure_percentage_min_hosts 0 is below the minimum 1`},
		{"outlier {\n failure_percentage_min_requests\n}", "lb_policy ewma: outlier: failure_percentage_min_requests: missing value, at Testfile:2"},
		{"outlier {\n failure_percentage_min_requests x\n}", `lb_policy ewma: outlier: failure_percentage_min_requests "x": want a whole number, at Testfile:2`},
		{"outlier {\n interval 1s\n interval 2s\n}", "interval specified more than once"},
	} {
		t.Run(bad.in, func(t *testing.T) {
			var o Outlier
			unmarshalOption(t, bad.in, bad.want, func(d *caddyfile.Dispenser) error { return o.unmarshalCaddyfile(d, "lb_policy ewma: outlier") })
		})
	}
}

func TestOutlierIntervalRulesDefaultsAndValidate(t *testing.T) {
	o := newOutlier(t, Outlier{})
	if time.Duration(o.Interval) != 10*time.Second || o.DisableSuccessRate || o.SuccessRateMinHosts != 5 ||
		o.SuccessRateMinRequests != 100 || o.SuccessRateStdevFactor != 1.9 || o.FailurePercentageThreshold != nil ||
		o.FailurePercentageMinHosts != 5 || o.FailurePercentageMinRequests != 50 {
		t.Fatalf("defaults %+v", *o)
	}
	if !o.sweeps() {
		t.Fatal("success-rate ejection must be on by default")
	}
	if o := newOutlier(t, Outlier{DisableSuccessRate: true}); o.sweeps() {
		t.Fatal("with success_rate off and no failure_percentage_threshold nothing is swept")
	}
	if o := newOutlier(t, Outlier{DisableSuccessRate: true, FailurePercentageThreshold: percent(50)}); !o.sweeps() {
		t.Fatal("failure_percentage_threshold turns sweeping on")
	}
	nan := math.NaN()
	for _, bad := range []struct {
		o    Outlier
		want string
	}{
		{Outlier{Interval: caddy.Duration(-time.Second)}, "interval -1s is below the minimum 100ms"},
		{Outlier{SuccessRateMinHosts: -1}, "success_rate_min_hosts -1 is below the minimum 1"},
		{Outlier{SuccessRateMinRequests: -5}, "success_rate_min_requests -5 is below the minimum 1"},
		{Outlier{SuccessRateStdevFactor: -1}, "success_rate_stdev_factor -1 is below the minimum 0"},
		{Outlier{SuccessRateStdevFactor: nan}, "success_rate_stdev_factor NaN is not a finite number"},
		{Outlier{SuccessRateStdevFactor: math.Inf(1)}, "success_rate_stdev_factor +Inf is not a finite number"},
		{Outlier{FailurePercentageThreshold: percent(120)}, "failure_percentage_threshold 120% is not a percentage"},
		{Outlier{FailurePercentageThreshold: &nan}, "failure_percentage_threshold NaN% is not a percentage"},
		{Outlier{FailurePercentageMinHosts: -2}, "failure_percentage_min_hosts -2 is below the minimum 1"},
		{Outlier{FailurePercentageMinRequests: -3}, "failure_percentage_min_requests -3 is below the minimum 1"},
	} {
		o := bad.o
		o.provision(zap.NewNop(), events.Emitter{})
		if err := o.validate(); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%+v: error %v, want it to mention %q", bad.o, err, bad.want)
		}
	}
}

// TestCapHoldsUnderConcurrentFailures: upstreams failing at the same
// moment must not overshoot max_ejection_percent between counting the
// ejected ones and ejecting.
func TestCapHoldsUnderConcurrentFailures(t *testing.T) {
	for round := range 200 {
		o := newOutlier(t, Outlier{Consecutive: 1, MaxEjectionPercent: percent(20), BaseEjectionTime: caddy.Duration(time.Hour)})
		table := hoststate.NewTable(hoststate.Config{})
		stats := make([]*hoststate.Stats, 10)
		for i := range stats {
			stats[i] = table.Stats(fmt.Sprintf("%s-%d-%d", t.Name(), round, i))
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, s := range stats {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				o.judge(table, s, fmt.Sprint(i), true)
			}()
		}
		close(start)
		wg.Wait()
		if n, _ := table.CountEjected(monoclock.Now()); n != 2 {
			t.Fatalf("round %d: %d of 10 ejected with a cap of 20%%", round, n)
		}
		table.Release()
	}
}
