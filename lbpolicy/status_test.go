package lbpolicy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// TestFailureStatusChargesEstimate: an instant response with a failure
// status is a failed attempt for the latency estimate (the host is then
// expected at least twice as slow), so a black hole does not look fast:
// 502, 503 and 504 without an outlier block, the block's failure_status
// with one. Any other status is an answer like any other, and a fast one
// lowers the estimate.
func TestFailureStatusChargesEstimate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		outlier func(t *testing.T) *Outlier
		status  int
		failed  bool
	}{
		{"no outlier block, 503", nil, 503, true},
		{"no outlier block, 502", nil, 502, true},
		{"no outlier block, 504", nil, 504, true},
		{"no outlier block, 404", nil, 404, false},
		{"no outlier block, 500", nil, 500, false},
		{"default failure_status, 503", func(t *testing.T) *Outlier { return newOutlier(t, Outlier{}) }, 503, true},
		{"default failure_status, 404", func(t *testing.T) *Outlier { return newOutlier(t, Outlier{}) }, 404, false},
		{"failure_status 500, 500", func(t *testing.T) *Outlier { return newOutlier(t, Outlier{FailureStatus: []int{500}}) }, 500, true},
		{"failure_status 500, 503", func(t *testing.T) *Outlier { return newOutlier(t, Outlier{FailureStatus: []int{500}}) }, 503, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var outlier *Outlier
			if tc.outlier != nil {
				outlier = tc.outlier(t)
			}
			table := hoststate.NewTable(hoststate.Config{})
			t.Cleanup(table.Release)
			u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
			ok := &observingTransport{inner: fakeTransport{delay: 2 * time.Millisecond}, table: table, outlier: outlier}
			instant := &observingTransport{inner: answer{tc.status, ""}, table: table, outlier: outlier}
			if _, err := ok.RoundTrip(request(context.Background(), u, false)); err != nil {
				t.Fatal(err)
			}
			before := table.Stats(u.Dial).Snapshot(monoclock.Now()).Estimate
			if _, err := instant.RoundTrip(request(context.Background(), u, false)); err != nil {
				t.Fatal(err)
			}
			snap := table.Stats(u.Dial).Snapshot(monoclock.Now())
			if want := map[bool]uint64{true: 1}[tc.failed]; snap.Failures != want {
				t.Fatalf("failures = %d after an instant %d, want %d", snap.Failures, tc.status, want)
			}
			st := table.Stats(u.Dial)
			if e := table.Expected(st, monoclock.Now(), table.Baseline()); tc.failed && e < 2*float64(before) {
				t.Fatalf("expected latency after an instant %d = %v, want at least twice %v", tc.status, time.Duration(e), before)
			}
			if !tc.failed && snap.Estimate >= before {
				t.Fatalf("estimate after an instant %d = %v, want below %v", tc.status, snap.Estimate, before)
			}
		})
	}
}

// TestFailureStatusDefaultsAreOneList: an outlier block without
// failure_status gets the list that also applies without a block, as a
// copy of its own.
func TestFailureStatusDefaultsAreOneList(t *testing.T) {
	o := newOutlier(t, Outlier{})
	if fmt.Sprint(o.FailureStatus) != fmt.Sprint(defaultFailureStatus) || fmt.Sprint(defaultFailureStatus) != "[502 503 504]" {
		t.Fatalf("outlier default %v, rule without outlier %v", o.FailureStatus, defaultFailureStatus)
	}
	o.FailureStatus[0] = 500
	if defaultFailureStatus[0] != 502 {
		t.Fatal("an outlier block's list is the shared default")
	}
}
