package lbpolicy

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// DefaultRoutesPolicy writes ewma into a reverse_proxy with no policy, also
// inside a subroute, and leaves a named policy and other handlers alone.
func TestDefaultRoutesPolicyJSON(t *testing.T) {
	routes := caddyhttp.RouteList{{HandlersRaw: []json.RawMessage{
		json.RawMessage(`{"handler":"reverse_proxy","upstreams":[{"dial":"127.0.0.1:1"}]}`),
		json.RawMessage(`{"handler":"reverse_proxy","load_balancing":{"retries":2}}`),
		json.RawMessage(`{"handler":"reverse_proxy","load_balancing":{"selection_policy":{"policy":"round_robin"}}}`),
		json.RawMessage(`{"handler":"subroute","routes":[{"handle":[{"handler":"reverse_proxy"}]}]}`),
		json.RawMessage(`{"handler":"static_response","body":"x"}`),
	}}}
	if err := DefaultRoutesPolicy(routes); err != nil {
		t.Fatal(err)
	}
	got := routes[0].HandlersRaw
	for i, want := range []string{
		`"selection_policy":{"policy":"ewma"}`,
		`"selection_policy":{"policy":"ewma"}`,
		`"selection_policy":{"policy":"round_robin"}`,
		`"selection_policy":{"policy":"ewma"}`,
		`"body":"x"`,
	} {
		if !strings.Contains(string(got[i]), want) {
			t.Errorf("handler %d: %s; want it to contain %s", i, got[i], want)
		}
	}
	if !strings.Contains(string(got[1]), `"retries":2`) {
		t.Errorf("handler 1 lost its load_balancing options: %s", got[1])
	}
	if strings.Contains(string(got[4]), "selection_policy") {
		t.Errorf("a static_response got a policy: %s", got[4])
	}
}
