package partition

import (
	"testing"

	"github.com/caddy-lbx/lbx/internal/testutil"
)

// FuzzPartitionJSON validates a config whose one handler is the fuzzed
// partition handler JSON: no input may panic, allocate without bound, or
// hang.
func FuzzPartitionJSON(f *testing.F) {
	for _, seed := range []string{
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/2"},{"dial":"127.0.0.1:2","tag":"1/2"}]}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"fail_limit":1,"timeout":"1s","max_request_body":1024,"max_response_body":1024,"merge":{"merger":"json"},"retries":1}`,
		`{"naming_file":"/nonexistent","poll_interval":1}`,
		`{"naming_file":"/nonexistent","poll_interval":-1}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1000000000"}]}`,
		`{"upstreams":[{"dial":"localhost","tag":"0/1"}]}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"max_response_body":-1,"timeout":-1,"fail_limit":-1,"retries":-1}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"max_response_body":9223372036854775807}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"proxy":{"load_balancing":{"selection_policy":{"policy":"ewma","outlier":{"interval":"-1s"}}}}}`,
		`{"serf":{"tags":{"role":"x"},"port":"99999"}}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, handler []byte) {
		if len(handler) == 0 || handler[0] != '{' {
			return
		}
		h := append([]byte(`{"handler":"partition",`), handler[1:]...)
		testutil.ValidateHostile(t, testutil.HandlerConfig(h))
	})
}
