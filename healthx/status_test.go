package healthx

import (
	"context"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// TestFailureStatusChargesEstimate: with outlier detection, an instant
// response with a failure status is a failed attempt for the latency
// estimate too (the host is expected to be at least twice as slow), so a black hole does
// not look fast; without outlier detection it is an answer like any other.
func TestFailureStatusChargesEstimate(t *testing.T) {
	for _, tc := range []struct {
		name         string
		outlier      *Outlier
		wantFailures uint64
	}{
		{"with outlier detection", newOutlier(t, Outlier{}), 1},
		{"without", nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			table := hoststate.NewTable(hoststate.Config{})
			t.Cleanup(table.Release)
			u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
			ok := &ObservingTransport{inner: fakeTransport{delay: 2 * time.Millisecond}, table: table, outlier: tc.outlier}
			hole := &ObservingTransport{inner: answer{503, ""}, table: table, outlier: tc.outlier}
			if _, err := ok.RoundTrip(request(context.Background(), u, false)); err != nil {
				t.Fatal(err)
			}
			before := table.Stats(u.Dial).Snapshot(hoststate.Now()).Estimate
			if _, err := hole.RoundTrip(request(context.Background(), u, false)); err != nil {
				t.Fatal(err)
			}
			snap := table.Stats(u.Dial).Snapshot(hoststate.Now())
			if snap.Failures != tc.wantFailures {
				t.Fatalf("failures = %d, want %d", snap.Failures, tc.wantFailures)
			}
			st := table.Stats(u.Dial)
			if e := table.Expected(st, hoststate.Now(), table.Baseline()); tc.wantFailures == 1 && e < 2*float64(before) {
				t.Fatalf("expected latency after an instant 503 = %v, want at least twice %v", time.Duration(e), before)
			}
			if tc.wantFailures == 0 && snap.Estimate >= before {
				t.Fatalf("estimate after an instant answer = %v, want below %v", snap.Estimate, before)
			}
		})
	}
}
