package caddyfileadapt

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestValidateJSON loads JSON configs with caddy.Validate, which decodes,
// provisions and validates every module without starting any server. It
// covers what adapting cannot see: the number of upstreams (a selection
// policy's Caddyfile has no access to them) and JSON written by hand.
func TestValidateJSON(t *testing.T) {
	for _, tt := range []struct {
		name      string
		upstreams int
		policy    string // the selection_policy object
		wantErr   string // "" if the config is valid
	}{
		{
			name:      "ewma defaults",
			upstreams: 3,
			policy:    `{"policy": "ewma"}`,
		},
		{
			name:      "ewma every option",
			upstreams: 3,
			policy:    `{"policy": "ewma", "choices": "all", "decay": "30s", "weights": [1, 1, 2], "panic_threshold": 25}`,
		},
		{
			name:      "ewma choices as a number",
			upstreams: 3,
			policy:    `{"policy": "ewma", "choices": 2}`,
		},
		{
			name:      "ewma choices 0 is the default",
			upstreams: 3,
			policy:    `{"policy": "ewma", "choices": 0}`,
		},
		{
			name:      "ewma weights one per upstream",
			upstreams: 2,
			policy:    `{"policy": "ewma", "weights": [1, 3]}`,
		},
		{
			name:      "ewma slow start",
			upstreams: 3,
			policy:    `{"policy": "ewma", "slow_start": {"window": "30s", "min_weight_percent": 5, "aggression": 2}}`,
		},
		{
			name:      "ewma slow start without a window",
			upstreams: 3,
			policy:    `{"policy": "ewma", "slow_start": {"min_weight_percent": 5}}`,
			wantErr:   "slow_start: window 0s is below the minimum 1ms",
		},
		{
			name:      "ewma slow start floor 0",
			upstreams: 3,
			policy:    `{"policy": "ewma", "slow_start": {"window": "30s", "min_weight_percent": 0}}`,
			wantErr:   "slow_start: min_weight_percent must be above 0%: a host at weight 0 would never be tried",
		},
		{
			name:      "panic with outlier around a stock policy",
			upstreams: 3,
			policy:    `{"policy": "panic", "outlier": {"consecutive_failures": 3}, "selection_policy": {"policy": "least_conn"}}`,
		},
		{
			name:      "panic with outlier around ewma",
			upstreams: 3,
			policy:    `{"policy": "panic", "outlier": {}, "selection_policy": {"policy": "ewma"}}`,
			wantErr:   "panic: configure outlier ejection inside the ewma policy, not around it",
		},
		{
			name:      "ewma too few weights",
			upstreams: 3,
			policy:    `{"policy": "ewma", "weights": [1, 2]}`,
			wantErr:   "ewma: 2 weights given for 3 upstreams",
		},
		{
			name:      "ewma too many weights",
			upstreams: 1,
			policy:    `{"policy": "ewma", "weights": [1, 2]}`,
			wantErr:   "ewma: 2 weights given for 1 upstreams",
		},
		{
			name:      "least_time too few weights",
			upstreams: 3,
			policy:    `{"policy": "least_time", "weights": [1, 2]}`,
			wantErr:   "least_time: 2 weights given for 3 upstreams",
		},
		{
			name:      "panic with outlier around least_time",
			upstreams: 3,
			policy:    `{"policy": "panic", "outlier": {}, "selection_policy": {"policy": "least_time"}}`,
			wantErr:   "panic: configure outlier ejection inside the least_time policy, not around it",
		},
		{
			name:      "ewma weight 0",
			upstreams: 2,
			policy:    `{"policy": "ewma", "weights": [1, 0]}`,
			wantErr:   "ewma: weights[1]: weight 0 is below the minimum 1",
		},
		{
			name:      "ewma choices 1",
			upstreams: 3,
			policy:    `{"policy": "ewma", "choices": 1}`,
			wantErr:   `choices 1: must be a number of 2 or more, "all" or "auto"`,
		},
		{
			name:      "ewma choices -1",
			upstreams: 3,
			policy:    `{"policy": "ewma", "choices": -1}`,
			wantErr:   `choices -1: must be a number of 2 or more, "all" or "auto"`,
		},
		{
			name:      "ewma choices unknown word",
			upstreams: 3,
			policy:    `{"policy": "ewma", "choices": "most"}`,
			wantErr:   `choices "most": must be a number of 2 or more, "all" or "auto"`,
		},
		{
			name:      "ewma panic_threshold 150",
			upstreams: 3,
			policy:    `{"policy": "ewma", "panic_threshold": 150}`,
			wantErr:   "ewma: panic_threshold 150% is not a percentage from 0% to 100%",
		},
		{
			name:      "ewma panic_threshold negative",
			upstreams: 3,
			policy:    `{"policy": "ewma", "panic_threshold": -5}`,
			wantErr:   "ewma: panic_threshold -5% is not a percentage from 0% to 100%",
		},
		{
			name:      "ewma negative decay",
			upstreams: 3,
			policy:    `{"policy": "ewma", "decay": "-1s"}`,
			wantErr:   "ewma: decay -1s is below the minimum 1ms",
		},
		{
			name:      "panic defaults",
			upstreams: 3,
			policy:    `{"policy": "panic"}`,
		},
		{
			name:      "panic threshold 150",
			upstreams: 3,
			policy:    `{"policy": "panic", "threshold": 150}`,
			wantErr:   "panic: threshold 150% is not a percentage from 0% to 100%",
		},
		{
			name:      "panic wrapping least_conn",
			upstreams: 3,
			policy:    `{"policy": "panic", "threshold": 30, "selection_policy": {"policy": "least_conn"}}`,
		},
		{
			// The wrapped policy is loaded and validated: its errors
			// surface.
			name:      "panic wrapping an invalid ewma",
			upstreams: 3,
			policy:    `{"policy": "panic", "selection_policy": {"policy": "ewma", "weights": [1, 2]}}`,
			wantErr:   "ewma: 2 weights given for 3 upstreams",
		},
		{
			// cluster_load reads its loads through the cluster app (and
			// refuses to start without a rebalance app publishing them).
			name:      "cluster_load without the cluster app",
			upstreams: 2,
			policy:    `{"policy": "cluster_load", "port_tag": "http_port"}`,
			wantErr:   "lb_policy cluster_load: no cluster app in this config",
		},
		{
			name:      "cluster_load port out of range",
			upstreams: 2,
			policy:    `{"policy": "cluster_load", "port": "0"}`,
			wantErr:   `lb_policy cluster_load: port "0": want a number from 1 to 65535`,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var cfg caddy.Config
			if err := json.Unmarshal(proxyConfig(tt.upstreams, tt.policy), &cfg); err != nil {
				t.Fatal(err)
			}
			err := caddy.Validate(&cfg)
			if err != nil {
				t.Logf("caddy.Validate: %v", err)
			}
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("want a valid config, got: %v", err)
			case tt.wantErr != "" && err == nil:
				t.Fatalf("config validated; want an error containing %q", tt.wantErr)
			case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("wrong error\n got: %v\nwant it to contain: %s", err, tt.wantErr)
			}
		})
	}
}

// proxyConfig returns a Caddy JSON config with one reverse_proxy to n
// upstreams, load balanced by the given selection_policy object. Nothing
// in it listens or dials: caddy.Validate does not start servers.
func proxyConfig(n int, policy string) []byte {
	ups := make([]string, n)
	for i := range ups {
		ups[i] = fmt.Sprintf(`{"dial": "10.0.0.%d:8080"}`, i+1)
	}
	return []byte(`{
		"admin": {"disabled": true},
		"apps": {"http": {"servers": {"srv0": {
			"listen": [":8884"],
			"automatic_https": {"disable": true},
			"routes": [{"handle": [{
				"handler": "reverse_proxy",
				"load_balancing": {"selection_policy": ` + policy + `},
				"upstreams": [` + strings.Join(ups, ", ") + `]
			}]}]
		}}}}
	}`)
}

// TestValidateRebalanceThroughput adapts Caddyfiles with `metric
// throughput` and validates them as `caddy validate` does: with the
// rebalance listener wrapper in the servers option the config is valid;
// without it, it is refused with the fix.
func TestValidateRebalanceThroughput(t *testing.T) {
	const withWrapper = `{
	servers {
		listener_wrappers {
			rebalance
			tls
		}
	}
	cluster {
		bind 127.0.0.1:0
	}
	rebalance {
		metric throughput
	}
}

http://:8884 {
	respond "ok"
}
`
	withoutWrapper := strings.Replace(withWrapper, "listener_wrappers {\n\t\t\trebalance\n\t\t\ttls\n\t\t}", "trusted_proxies static private_ranges", 1)
	if withoutWrapper == withWrapper {
		t.Fatal("the test's Caddyfile did not change")
	}
	for _, tt := range []struct {
		name, caddyfile, wantErr string
	}{
		{"with the wrapper", withWrapper, ""},
		{"without the wrapper", withoutWrapper, "metric throughput needs the rebalance listener wrapper: add `listener_wrappers { rebalance tls }`"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(tt.caddyfile), nil)
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			var cfg caddy.Config
			if err := json.Unmarshal(out, &cfg); err != nil {
				t.Fatal(err)
			}
			err = caddy.Validate(&cfg)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("want a valid config, got: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v; want one containing %q", err, tt.wantErr)
			}
		})
	}
}
