package rebalance

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/caddy-lbx/lbx/cluster"
)

// TestUnmarshalCaddyfileErrors covers every error path of the global
// option, each with the place it names.
func TestUnmarshalCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"rebalance extra", `unexpected argument "extra"`},
		{"rebalance {\n metric\n}", "metric: missing value"},
		{"rebalance {\n metric ram\n}", `metric "ram"`},
		{"rebalance {\n interval soon\n}", `interval "soon": want a positive duration`},
		{"rebalance {\n history -1s\n}", `history "-1s": want a positive duration`},
		{"rebalance {\n freshness 0s\n}", `freshness "0s"`},
		{"rebalance {\n threshold 0\n}", `threshold "0": want a percentage above 0%`},
		{"rebalance {\n threshold x%\n}", `threshold "x%"`},
		{"rebalance {\n shed_rate 101%\n}", `shed_rate 101%: want a percentage above 0% and at most 100%`},
		{"rebalance {\n stop_band -1\n}", `stop_band -1%: want a percentage above 0%`},
		{"rebalance {\n stop_band 30\n}", "stop_band 30% is above threshold 20%"},
		{"rebalance {\n min_connections -1\n}", `min_connections -1: want a whole number from 0 to 10000000`},
		{"rebalance {\n min_connections many\n}", `min_connections "many"`},
		{"rebalance {\n interval 1s\n interval 2s\n}", "interval specified more than once"},
		{"rebalance {\n boundary_timeout\n}", "boundary_timeout: missing value"},
		{"rebalance {\n boundary_timeout -1s\n}", "rebalance: boundary_timeout -1s is below the minimum 0s, at Testfile:2"},
		{"rebalance {\n boundary_timeout soon\n}", `boundary_timeout "soon"`},
		{"rebalance {\n boundary_timeout 1s 2s\n}", `boundary_timeout: one value expected, got another: "2s"`},
		{"rebalance {\n boundary_timeout 1s\n boundary_timeout 2s\n}", "boundary_timeout specified more than once"},
		{"rebalance {\n idle_close_after 0\n}", `idle_close_after "0": want a positive duration`},
		{"rebalance {\n idle_close_after\n}", "idle_close_after: missing value"},
		{"rebalance {\n idle_close_after 1m\n idle_close_after 2m\n}", "idle_close_after specified more than once"},
		{"rebalance {\n join_settle 0\n}", `join_settle "0": want a positive duration such as 5s, or off`},
		{"rebalance {\n join_settle never\n}", `join_settle "never"`},
		{"rebalance {\n join_settle 25h\n}", "join_settle 25h0m0s is above the maximum 24h0m0s, at Testfile:2"},
		{"rebalance {\n bogus 1\n}", `unknown option "bogus"`},
		{"rebalance {\n join 127.0.0.1:7946\n}", "rebalance: join is an option of the cluster global option now"},
	} {
		d := caddyfile.NewTestDispenser(tc.in)
		err := new(App).UnmarshalCaddyfile(d)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
		if err != nil && !strings.Contains(err.Error(), "Testfile:") {
			t.Errorf("%q: error %q does not name its line", tc.in, err)
		}
	}
}

// TestProvisionValidateErrors covers the checks that need the whole
// config: each error names the bad value.
func TestProvisionValidateErrors(t *testing.T) {
	for _, tc := range []struct {
		app  App
		want string
	}{
		// The process's own source (no test source): throughput needs a
		// server with the listener wrapper, and this config has none.
		{App{Metric: "throughput", source: nil}, "metric throughput needs the rebalance listener wrapper: add `listener_wrappers { rebalance tls }`"},
		{App{Metric: "ram"}, `metric "ram": want`},
		{App{Interval: 2e9, History: 1e9}, "history (1s) must be at least interval (2s)"},
		{App{Threshold: 10, StopBand: 15}, "stop_band 15% is above threshold 10%"},
		{App{ShedRate: 200}, "shed_rate 200%: want a percentage above 0% and at most 100%"},
		{App{BoundaryTimeout: -1e9}, "boundary_timeout -1s is below the minimum 0s"},
		{App{IdleCloseAfter: 1e6}, "idle_close_after 1ms is below the minimum 1s"},
	} {
		a := tc.app
		if tc.app.Metric != metricThroughput {
			a.source = &fakeSource{}
		}
		a.cluster = &cluster.App{NodeName: "n"}
		err := provisionApp(t, &a)

		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v; want one containing %q", tc.app, err, tc.want)
		}
	}
}

// TestListenerWrapperUnmarshalCaddyfile: the wrapper takes no arguments
// and no block; each error names its line.
func TestListenerWrapperUnmarshalCaddyfile(t *testing.T) {
	if err := new(ListenerWrapper).UnmarshalCaddyfile(caddyfile.NewTestDispenser("rebalance")); err != nil {
		t.Fatalf("bare wrapper: %v", err)
	}
	for _, tc := range []struct{ in, want string }{
		{"rebalance in", `rebalance listener wrapper: unexpected argument "in"; it takes none, at Testfile:1`},
		{"rebalance {\n direction in\n}", "rebalance listener wrapper: unexpected block; it takes no options, at Testfile:1"},
	} {
		err := new(ListenerWrapper).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
	}
}
