package lbpolicy

import (
	"testing"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// FuzzSelectionPolicyJSON loads a reverse_proxy handler whose selection
// policy is the fuzzed JSON, so that least_time (under either name) and
// panic are provisioned where they install their transport and start their
// sweep loops: no input may panic, allocate without bound, or hang.
func FuzzSelectionPolicyJSON(f *testing.F) {
	for _, seed := range []string{
		`{"policy":"ewma"}`,
		`{"policy":"least_time"}`,
		`{"policy":"least_time","choices":"all","decay":"10s","weights":[1,2],"panic_threshold":40,"outlier":{"interval":"-1s"}}`,
		`{"policy":"ewma","choices":"all","decay":"10s","weights":[1,2],"panic_threshold":40}`,
		`{"policy":"ewma","outlier":{"interval":"-1s"}}`,
		`{"policy":"ewma","outlier":{"interval":1,"base_ejection_time":1e18,"max_ejection_time":-5}}`,
		`{"policy":"ewma","slow_start":{"window":"1s","aggression":1e308,"min_weight_percent":0.0001}}`,
		`{"policy":"ewma","retry_budget":{"percent":101,"min_concurrent":-1}}`,
		`{"policy":"ewma","choices":1000000000,"weights":[1000000000000]}`,
		`{"policy":"panic","threshold":30,"outlier":{"consecutive_failures":1},"selection_policy":{"policy":"least_conn"}}`,
		`{"policy":"panic","selection_policy":{"policy":"panic"}}`,
		`{"policy":"panic","selection_policy":{"policy":"ewma","outlier":{"interval":"1ns"}}}`,
		`{"policy":"panic","outlier":{},"selection_policy":{"policy":"least_time"}}`,
		`{"policy":"panic","outlier":{"interval":"-1s"}}`,
		`{"policy":"least_time","load_reports":{"max_age":"10s","forward_header":true}}`,
		`{"policy":"ewma","load_reports":{"max_age":-1}}`,
		`{"policy":"least_time","load_reports":{"max_age":1e18,"forward_header":1}}`,
		`{"policy":"panic","outlier":{},"load_reports":{"max_age":"2s"},"selection_policy":{"policy":"least_conn"}}`,
		`{"policy":"panic","load_reports":{},"selection_policy":{"policy":"least_time"}}`,
		`{"policy":"panic","load_reports":{}}`,
		`{"policy":"least_time","load_reports":{"probe":{"path":"/load","per_request":1,"max_rate":1000,"timeout":"10ms"}}}`,
		`{"policy":"ewma","load_reports":{"probe":{"path":"//x/../load","per_request":1e308,"max_rate":-1,"timeout":-1}}}`,
		`{"policy":"least_time","load_reports":{"probe":{"path":"http://10.0.0.1/","max_rate":1e18}}}`,
		`{"policy":"least_time","load_reports":{"probe":{}}}`,
		`{"policy":"panic","outlier":{},"load_reports":{"probe":{"path":"/load"}},"selection_policy":{"policy":"least_conn"}}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, policy []byte) {
		proxy := append([]byte(`{"handler":"reverse_proxy","upstreams":[{"dial":"127.0.0.1:1"},{"dial":"127.0.0.1:2"}],"load_balancing":{"selection_policy":`), policy...)
		lbxtest.ValidateHostile(t, lbxtest.HandlerConfig(append(proxy, "}}"...)))
	})
}
