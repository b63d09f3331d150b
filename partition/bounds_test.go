package partition

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// provisionJSON validates a config with one partition handler whose
// fields are cfg (after its upstreams) as `caddy validate` does: Caddy
// decodes, provisions and validates every module, and starts nothing.
func provisionJSON(t *testing.T, cfg string) error {
	t.Helper()
	raw := `{"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[` +
		`{"handler":"partition","upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}]` + cfg + `}]}]}}}}}`
	var c caddy.Config
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		t.Fatal(err)
	}
	return caddy.Validate(&c)
}

// TestBoundsJSON checks every bounded option of the JSON config: a bad
// value fails Provision (which validates before it starts anything) with
// an error naming the option and the value.
func TestBoundsJSON(t *testing.T) {
	if err := provisionJSON(t, `,"poll_interval":"100ms","timeout":"24h","fail_limit":1024,"max_request_body":1073741824,"max_response_body":1,"max_merged_body":1,"retries":100`); err != nil {
		t.Fatalf("values at the bounds: %v", err)
	}
	for _, tc := range []struct{ name, cfg, want string }{
		{"poll_interval too small", `,"poll_interval":"1ns"`, "poll_interval 1ns is below the minimum 100ms"},
		{"poll_interval negative", `,"poll_interval":"-1s"`, "poll_interval -1s is below the minimum 100ms"},
		{"poll_interval huge", `,"poll_interval":"1000000h"`, "poll_interval 1000000h0m0s is above the maximum 1h0m0s"},
		{"poll_interval NaN", `,"poll_interval":"NaNs"`, `poll_interval: time: invalid duration "NaNs"`},
		{"timeout not a duration", `,"timeout":true`, `cannot unmarshal bool into Go struct field plain.FanOut.timeout`},
		{"unknown field", `,"poll_intervals":"1s"`, `unknown field "poll_intervals"`},
		{"timeout too small", `,"timeout":"1us"`, "timeout 1µs is below the minimum 1ms"},
		{"timeout negative", `,"timeout":-1`, "timeout -1ns is below the minimum 1ms"},
		{"timeout huge", `,"timeout":"25h"`, "timeout 25h0m0s is above the maximum 24h0m0s"},
		{"fail_limit negative", `,"fail_limit":-1`, "fail_limit -1 is below the minimum 0"},
		{"fail_limit huge", `,"fail_limit":1025`, "fail_limit 1025 is above the maximum 1024"},
		{"fail_limit not an int", `,"fail_limit":1e300`, "fail_limit of type int"},
		{"max_request_body negative", `,"max_request_body":-1`, "max_request_body -1 is below the minimum of 1 byte"},
		{"max_request_body huge", `,"max_request_body":1073741825`, "max_request_body 1073741825 is above the maximum 1073741824 (1 GiB)"},
		{"max_response_body negative", `,"max_response_body":-5`, "max_response_body -5 is below the minimum of 1 byte"},
		{"max_response_body huge", `,"max_response_body":1099511627776`, "max_response_body 1099511627776 is above the maximum"},
		{"max_merged_body negative", `,"max_merged_body":-1`, "max_merged_body -1 is below the minimum of 1 byte"},
		{"max_merged_body huge", `,"max_merged_body":2147483648`, "max_merged_body 2147483648 is above the maximum 1073741824 (1 GiB)"},
		{"max_response_body over max_merged_body", `,"max_response_body":67108865`, "max_response_body 67108865 is above max_merged_body 67108864 (default 67108864): no sub-response that large could be merged"},
		{"max_merged_body under max_response_body", `,"max_merged_body":1048576`, "max_response_body 8388608 is above max_merged_body 1048576"},
		{"max_merge_memory small", `,"max_merge_memory":1048575`, "max_merge_memory 1048575 is out of range: want 1048576 (1 MiB) to 1099511627776 (1 TiB)"},
		{"max_merge_memory huge", `,"max_merge_memory":1099511627777`, "max_merge_memory 1099511627777 is out of range"},
		{"max_merge_memory negative", `,"max_merge_memory":-1`, "max_merge_memory -1 is out of range"},
		{"max_merge_memory under a fan-out", `,"max_merge_memory":134217727`, "max_merge_memory 134217727 (128 MiB) is below what one fan-out may reserve, 2 × max_merged_body = 134217728 (128 MiB): raise max_merge_memory (default 1.0 GiB) or lower max_merged_body"},
		{"max_merged_body 1GiB over the default max_merge_memory", `,"max_merged_body":1073741824`, "max_merge_memory 1073741824 (1.0 GiB) is below what one fan-out may reserve, 2 × max_merged_body = 2147483648"},
		{"retries negative", `,"retries":-1`, "retries -1 is below the minimum 0"},
		{"retries huge", `,"retries":101`, "retries 101 is above the maximum 100"},
		{"proxy retries huge", `,"proxy":{"load_balancing":{"retries":1000}}`, "proxy.load_balancing.retries 1000 is above the maximum 100"},
		{"proxy response buffers", `,"proxy":{"response_buffers":1024}`, "proxy.response_buffers 1024: response buffering is not supported inside partition"},
		{"serf without a port", `,"serf":{}`, "serf: give a port or a port_tag"},
		{"upstream without a port", `,"upstreams":[{"dial":"foo","tag":"0/1"}]`, `upstreams[0]: invalid upstream address "foo": missing port; give host:port, e.g. foo:80`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := provisionJSON(t, tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v; want one containing %q", err, tc.want)
			}
		})
	}
}

// TestBoundsBeforeSideEffects checks that Provision rejects its own bad
// options before it provisions the internal reverse_proxy or starts a
// watcher: its proxy's policy would otherwise start goroutines (and, with
// this outlier interval, has been known to panic on it).
func TestBoundsBeforeSideEffects(t *testing.T) {
	// Counted: the goroutines of the internal reverse_proxy and its
	// policy, and of partition's own watchers; not any goroutine at all,
	// which an earlier test's winding down or the runtime can add (CI
	// once saw 3 after, 2 before, under -race).
	sideEffects := []string{"lbx/partition.", "lbx/lbpolicy.", "reverseproxy."}
	base := len(lbxtest.Goroutines(sideEffects...))
	err := provisionJSON(t, `,"poll_interval":"1ns","naming_file":"/nonexistent",`+
		`"proxy":{"load_balancing":{"selection_policy":{"policy":"ewma","outlier":{"interval":"-1s"}}}}`)
	if err == nil || !strings.Contains(err.Error(), "poll_interval 1ns is below the minimum 100ms") {
		t.Fatalf("error %v; want the poll_interval bound", err)
	}
	if after := lbxtest.Goroutines(sideEffects...); len(after) > base {
		t.Errorf("%d goroutines of partition, lbpolicy or reverse_proxy after a failed Provision; %d before:\n%s", len(after), base, strings.Join(after, "\n\n"))
	}
}

// TestBoundsCaddyfile checks the same bounds in the Caddyfile, where each
// error carries the line of the option.
func TestBoundsCaddyfile(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"poll_interval 1ns", "poll_interval 1ns is below the minimum 100ms, at Testfile:3"},
		{"poll_interval -1s", "poll_interval -1s is below the minimum 100ms, at Testfile:3"},
		{"poll_interval 2h", "poll_interval 2h0m0s is above the maximum 1h0m0s, at Testfile:3"},
		{"poll_interval NaNd", `partition: poll_interval "NaNd": want a duration such as 1s, at Testfile:3`},
		{"timeout 0s", "timeout 0s is below the minimum 1ms, at Testfile:3"},
		{"timeout 2d", "timeout 48h0m0s is above the maximum 24h0m0s, at Testfile:3"},
		{"fail_limit 1025", "fail_limit 1025 is above the maximum 1024, at Testfile:3"},
		{"fail_limit -1", "partition: fail_limit -1 is below the minimum 1, at Testfile:3"},
		{"max_request_body 0", "max_request_body 0 is below the minimum of 1 byte, at Testfile:3"},
		{"max_response_body 2GiB", "max_response_body 2147483648 is above the maximum 1073741824 (1 GiB): bodies are held in memory whole, at Testfile:3"},
		{"max_merged_body 1EiB", "max_merged_body 1152921504606846976 is above the maximum 1073741824"},
		{"max_merged_body NaN", `partition: max_merged_body "NaN": want a size such as 1MiB or 65536, at Testfile:3`},
		{"max_merged_body 1MiB\nmax_merged_body 2MiB", "max_merged_body specified more than once, at Testfile:4"},
		{"max_merged_body", "max_merged_body: missing value, at Testfile:3"},
		{"max_merged_body 1MiB", "max_response_body 8388608 is above max_merged_body 1048576 (default 67108864): no sub-response that large could be merged; raise max_merged_body or lower max_response_body, at Testfile:3"},
		{"max_merged_body 1MiB\nmax_response_body 2MiB", "max_response_body 2097152 is above max_merged_body 1048576 (default 67108864): no sub-response that large could be merged; raise max_merged_body or lower max_response_body, at Testfile:4"},
		{"max_response_body 100MiB", "max_response_body 104857600 is above max_merged_body 67108864 (default 67108864)"},
		{"max_merge_memory 64MiB", "max_merge_memory 67108864 (64 MiB) is below what one fan-out may reserve, 2 × max_merged_body = 134217728 (128 MiB): raise max_merge_memory (default 1.0 GiB) or lower max_merged_body, at Testfile:3"},
		{"max_merged_body 1GiB", "max_merge_memory 1073741824 (1.0 GiB) is below what one fan-out may reserve, 2 × max_merged_body = 2147483648 (2.0 GiB): raise max_merge_memory (default 1.0 GiB) or lower max_merged_body, at Testfile:3"},
		{"max_merge_memory 2TiB", "max_merge_memory 2199023255552 is out of range: want 1048576 (1 MiB) to 1099511627776 (1 TiB), at Testfile:3"},
		{"max_merge_memory NaN", `partition: max_merge_memory "NaN": want a size such as 1MiB or 65536, at Testfile:3`},
		{"max_merge_memory 1GiB\nmax_merge_memory 2GiB", "max_merge_memory specified more than once, at Testfile:4"},
		{"lb_retries 101", "lb_retries 101 is above the maximum 100, at Testfile:3"},
		{"lb_retries 1\nlb_retries 1", "lb_retries specified more than once, at Testfile:4"},
		{"to foo 0/1", `to: invalid upstream address "foo": missing port; give host:port, e.g. foo:80, at Testfile:3`},
		{"to [::1] 0/1", `missing port; give host:port, e.g. [::1]:80, at Testfile:3`},
		{"response_buffers 1MiB", "partition: response_buffers is not supported: each sub-response is held whole already (see max_response_body), at Testfile:3"},
		{"buffer_responses", "partition: buffer_responses is not supported"},
		{"health_uri /health", "partition: active health checks (health_*) are not supported; use passive health checks (fail_duration, max_fails, …) or lb_policy least_time { outlier }, at Testfile:3"},
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\n" + tc.in + "\n}"))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
	}

	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nfail_limit 1\n}")); err == nil ||
		!strings.Contains(err.Error(), "partition: no upstreams: give tagged upstreams (to <address> <N/M>), a naming_file or serf_tag, at Testfile:1") {
		t.Errorf("no upstreams: error %v", err)
	}
	h = Handler{}
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\nmax_merged_body 16MiB\nmax_response_body 16MiB\npoll_interval 100ms\n}")); err != nil {
		t.Fatal(err)
	}
	if h.MaxMergedBody != 16<<20 || h.PollInterval != caddy.Duration(minPollInterval) {
		t.Errorf("max_merged_body %d poll_interval %v", h.MaxMergedBody, h.PollInterval)
	}
}
