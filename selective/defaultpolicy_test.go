package selective

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A group's reverse_proxy that names no policy runs ewma: with one fast
// and one slow replica in the group, the slow one gets few requests
// (Caddy's default, random, gives it about half).
func TestGroupDefaultPolicyEWMA(t *testing.T) {
	e := newEnv(t)
	fast, slow := e.backend("fast"), e.backend("slow")
	slow.delay.Store(int64(30 * time.Millisecond))
	e.load(fmt.Sprintf("\tselective {\n\t\tgroup only {\n\t\t\treverse_proxy %s %s\n\t\t}\n\t}", fast.addr, slow.addr))
	by := map[string]int{}
	const n = 100
	for range n {
		r := e.do(http.MethodGet, "/")
		if r.err != nil || r.status != http.StatusOK {
			t.Fatalf("request failed: %v, status %d", r.err, r.status)
		}
		by[r.body]++
	}
	if by["slow"] > n/4 {
		t.Fatalf("answers by replica: %v; want the slow one to get at most a quarter, as ewma gives it", by)
	}
}

// defaultGroupPolicy writes ewma into a reverse_proxy with no policy, also
// inside a subroute, and leaves a named policy and other handlers alone.
func TestDefaultGroupPolicyJSON(t *testing.T) {
	routes := caddyhttp.RouteList{{HandlersRaw: []json.RawMessage{
		json.RawMessage(`{"handler":"reverse_proxy","upstreams":[{"dial":"127.0.0.1:1"}]}`),
		json.RawMessage(`{"handler":"reverse_proxy","load_balancing":{"retries":2}}`),
		json.RawMessage(`{"handler":"reverse_proxy","load_balancing":{"selection_policy":{"policy":"round_robin"}}}`),
		json.RawMessage(`{"handler":"subroute","routes":[{"handle":[{"handler":"reverse_proxy"}]}]}`),
		json.RawMessage(`{"handler":"static_response","body":"x"}`),
	}}}
	if err := defaultGroupPolicy(routes); err != nil {
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
