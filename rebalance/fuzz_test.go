package rebalance

import (
	"testing"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// FuzzRebalanceHTTPJSON (the app alone is FuzzAppJSON) validates a config with the rebalance app and a
// route whose reverse_proxy takes its upstreams from the fuzzed serf
// source and its policy from the fuzzed cluster_load policy.
func FuzzRebalanceHTTPJSON(f *testing.F) {
	for _, seed := range [][2]string{
		{`{"source":"serf","port":"8080"}`, `{"policy":"cluster_load","port":"8080"}`},
		{`{"source":"serf","port":"99999","refresh":-1}`, `{"policy":"cluster_load","refresh":1}`},
		{`{"source":"serf","port_tag":"","tags":{"":""}}`, `{"policy":"cluster_load","port":"0"}`},
		{`{"source":"serf","refresh":1e300}`, `{"policy":"cluster_load","port":"-1","refresh":"x"}`},
	} {
		f.Add([]byte(seed[0]), []byte(seed[1]))
	}
	f.Fuzz(func(t *testing.T, source, policy []byte) {
		proxy := `{"handler":"reverse_proxy","dynamic_upstreams":` + string(source) +
			`,"load_balancing":{"selection_policy":` + string(policy) + `}}`
		config := `{"admin":{"disabled":true},"apps":{"rebalance":{"bind":"127.0.0.1:0"},` +
			`"http":{"servers":{"fuzz":{"listen":["127.0.0.1:0"],"routes":[{"handle":[` + proxy + `]}]}}}}}`
		lbxtest.ValidateHostile(t, []byte(config))
	})
}
