package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// newTestSource returns a SerfUpstreams over app, set up as Provision
// would (a bare test context has no config to find the app in).
func newTestSource(app *App, su SerfUpstreams) *SerfUpstreams {
	su.app = app
	_ = su.Selector.Use(app)
	su.logger = zap.NewNop()
	su.upstreamsState = new(upstreamsState)
	su.refresh = time.Duration(su.Refresh)
	if su.refresh == 0 {
		su.refresh = defaultUpstreamsRefresh
	}
	return &su
}

// testCluster provisions and starts a cluster app on 127.0.0.1 with a
// port chosen by the kernel; mut may change it before. It stops at the
// end of the test unless the test stopped it.
func testCluster(t *testing.T, name string, mut func(*App)) *App {
	t.Helper()
	a := &App{NodeName: name, Bind: "127.0.0.1:0"}
	if mut != nil {
		mut(a)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := a.Provision(ctx); err != nil {
		cancel()
		t.Fatalf("provision %s: %v", name, err)
	}
	if err := a.Start(); err != nil {
		cancel()
		t.Fatalf("start %s: %v", name, err)
	}
	t.Cleanup(func() {
		a.Stop()
		cancel()
	})
	return a
}

// gossipAddr returns the gossip address the app's member listens on.
func (a *App) gossipAddr() string {
	st, _ := a.Status()
	return st.Addr
}

// freePort returns a TCP port that was free on 127.0.0.1 (serf binds
// TCP and UDP).
var freePort = lbxtest.FreePort

// getDials calls GetUpstreams and returns the dial addresses.
func getDials(t *testing.T, su *SerfUpstreams) []string {
	t.Helper()
	ups, err := su.GetUpstreams(httptest.NewRequest("GET", "/", nil))
	if err != nil {
		t.Fatalf("GetUpstreams: %v", err)
	}
	out := make([]string, len(ups))
	for i, u := range ups {
		out[i] = u.Dial
	}
	return out
}

// TestSerfUpstreamsFollowMembers: real serf members on loopback; the
// members tagged role=api appear, sorted; a member that leaves
// disappears; one whose tag changes disappears; one with another role is
// never listed; the list is rebuilt only when it changes, while many
// goroutines read it.
func TestSerfUpstreamsFollowMembers(t *testing.T) {
	front := testCluster(t, "front", func(a *App) { a.Tags = map[string]string{"role": "edge"} })
	api1 := lbxtest.SerfMember(t, "api-1", map[string]string{"role": "api", "http_port": "9001"}, front.gossipAddr())
	api2 := lbxtest.SerfMember(t, "api-2", map[string]string{"role": "api", "http_port": "9002"}, front.gossipAddr())
	lbxtest.SerfMember(t, "web-1", map[string]string{"role": "web", "http_port": "9003"}, front.gossipAddr())
	lbxtest.SerfMember(t, "api-noport", map[string]string{"role": "api"}, front.gossipAddr())
	_ = api1

	su := newTestSource(front, SerfUpstreams{Selector: Selector{Tags: map[string]string{"role": "api"}, PortTag: "http_port"}, Refresh: caddy.Duration(20 * time.Millisecond)})
	want := []string{"127.0.0.1:9001", "127.0.0.1:9002"}
	lbxtest.WaitFor(t, 10*time.Second, "both api members listed", func() (bool, string) {
		got := getDials(t, su)
		return strings.Join(got, ",") == strings.Join(want, ","), fmt.Sprint(got)
	})
	buildsBefore := su.builds.Load()

	// Many concurrent readers for a while: no change, no rebuild.
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	stop := time.Now().Add(300 * time.Millisecond)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				ups, err := su.GetUpstreams(httptest.NewRequest("GET", "/", nil))
				if err != nil || len(ups) != 2 || ups[0].Dial != want[0] || ups[1].Dial != want[1] {
					errs <- fmt.Sprintf("%v %v", ups, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Errorf("unstable upstreams while nothing changed: %s", e)
	}
	if b := su.builds.Load(); b != buildsBefore {
		t.Errorf("rebuilt %d times while the member list did not change", b-buildsBefore)
	}

	// api-2 leaves: gone.
	start := time.Now()
	if err := api2.Leave(); err != nil {
		t.Fatal(err)
	}
	lbxtest.WaitFor(t, 10*time.Second, "api-2 gone after it left", func() (bool, string) {
		got := getDials(t, su)
		return len(got) == 1 && got[0] == want[0], fmt.Sprint(got)
	})
	t.Logf("a member that left disappeared from the upstreams after %v", time.Since(start).Round(time.Millisecond))
	api2.Shutdown()

	// api-1 changes its role: gone too.
	start = time.Now()
	if err := api1.SetTags(map[string]string{"role": "batch", "http_port": "9001"}); err != nil {
		t.Fatal(err)
	}
	lbxtest.WaitFor(t, 10*time.Second, "api-1 gone after its tag changed", func() (bool, string) {
		got := getDials(t, su)
		return len(got) == 0, fmt.Sprint(got)
	})
	t.Logf("a member whose tag changed disappeared after %v", time.Since(start).Round(time.Millisecond))
	if b := su.builds.Load() - buildsBefore; b != 2 {
		t.Errorf("%d rebuilds for 2 changes", b)
	}
}

// TestSerfUpstreamsPortAndSelf covers the fixed port, the port tag
// fallback and exclude_self on the local member.
func TestSerfUpstreamsPortAndSelf(t *testing.T) {
	front := testCluster(t, "self", func(a *App) { a.Tags = map[string]string{"role": "api", "http_port": "7000"} })
	lbxtest.SerfMember(t, "other", map[string]string{"role": "api"}, front.gossipAddr())

	su := newTestSource(front, SerfUpstreams{Selector: Selector{Tags: map[string]string{"role": "api"}, Port: "8080", PortTag: "http_port"}})
	lbxtest.WaitFor(t, 10*time.Second, "both listed", func() (bool, string) {
		su.stale.Store(true)
		got := getDials(t, su)
		return strings.Join(got, ",") == "127.0.0.1:7000,127.0.0.1:8080", fmt.Sprint(got)
	})
	su = newTestSource(front, SerfUpstreams{Selector: Selector{Tags: map[string]string{"role": "api"}, Port: "8080", ExcludeSelf: true}})
	if got := getDials(t, su); strings.Join(got, ",") != "127.0.0.1:8080" {
		t.Errorf("exclude_self: %v", got)
	}
	// Before the app runs (or after it stopped): an error, not a panic.
	stopped := &App{poolKey: "127.0.0.1:1#nobody"}
	su = newTestSource(stopped, SerfUpstreams{Selector: Selector{Port: "80"}})
	if _, err := su.GetUpstreams(httptest.NewRequest("GET", "/", nil)); err == nil || !strings.Contains(err.Error(), "not running") {
		t.Errorf("no node: error %v", err)
	}
}

// TestSerfUpstreamsCaddy loads a real Caddy config: reverse_proxy with
// `dynamic serf` on an HTTP server, the cluster app joined to raw serf
// members fronting real backends. Requests reach both role=api backends,
// never the role=web one, and the api member that leaves stops getting
// requests.
func TestSerfUpstreamsCaddy(t *testing.T) {
	p1, p2, p3 := lbxtest.NamedBackend(t, "api-1"), lbxtest.NamedBackend(t, "api-2"), lbxtest.NamedBackend(t, "web-1")
	api1 := lbxtest.SerfMember(t, "api-1", map[string]string{"role": "api", "http_port": p1}, "")
	api2 := lbxtest.SerfMember(t, "api-2", map[string]string{"role": "api", "http_port": p2}, lbxtest.SerfAddr(api1))
	lbxtest.SerfMember(t, "web-1", map[string]string{"role": "web", "http_port": p3}, lbxtest.SerfAddr(api1))

	httpPort, gossipPort := freePort(t), freePort(t)
	cfg := fmt.Sprintf(`{
		"admin": {"disabled": true},
		"apps": {
			"http": {"servers": {"s": {
				"listen": ["127.0.0.1:%d"],
				"routes": [{"handle": [{
					"handler": "reverse_proxy",
					"dynamic_upstreams": {"source": "serf", "tags": {"role": "api"}, "port_tag": "http_port", "refresh": "50ms"},
					"load_balancing": {"selection_policy": {"policy": "round_robin"}}
				}]}]
			}}},
			"cluster": {"node_name": "front", "bind": "127.0.0.1:%d", "join": [%q]}
		}
	}`, httpPort, gossipPort, lbxtest.SerfAddr(api1))
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })

	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	url := fmt.Sprintf("http://127.0.0.1:%d/", httpPort)
	get := func() (string, int) {
		res, err := client.Get(url)
		if err != nil {
			t.Fatalf("GET: %v", err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return string(b), res.StatusCode
	}
	hits := map[string]int{}
	lbxtest.WaitFor(t, 10*time.Second, "requests reach api-1 and api-2", func() (bool, string) {
		body, code := get()
		if code == http.StatusOK {
			hits[body]++
		}
		return hits["api-1"] > 0 && hits["api-2"] > 0, fmt.Sprintf("%v (last: %d %q)", hits, code, body)
	})
	for range 40 {
		body, code := get()
		if code != http.StatusOK {
			t.Fatalf("status %d: %q", code, body)
		}
		hits[body]++
	}
	if hits["web-1"] > 0 {
		t.Errorf("the role=web member got %d requests", hits["web-1"])
	}
	t.Logf("hits with both api members: %v", hits)

	start := time.Now()
	if err := api2.Leave(); err != nil {
		t.Fatal(err)
	}
	api2.Shutdown()
	run := 0
	lbxtest.WaitFor(t, 10*time.Second, "only api-1 answers after api-2 left", func() (bool, string) {
		body, code := get()
		if code == http.StatusOK && body == "api-1" {
			run++
		} else {
			run = 0
		}
		return run >= 20, fmt.Sprintf("last %d %q", code, body)
	})
	t.Logf("api-2 left; 20 requests in a row went to api-1 within %v", time.Since(start).Round(time.Millisecond))
}

// TestSerfUpstreamsNeedClusterApp: a config with `dynamic serf` and no
// cluster app does not load, and says why.
func TestSerfUpstreamsNeedClusterApp(t *testing.T) {
	cfg := `{"admin": {"disabled": true}, "apps": {"http": {"servers": {"s": {
		"listen": ["127.0.0.1:0"],
		"routes": [{"handle": [{"handler": "reverse_proxy", "dynamic_upstreams": {"source": "serf", "port": "80"}}]}]
	}}}}}`
	var c caddy.Config
	if err := json.Unmarshal([]byte(cfg), &c); err != nil {
		t.Fatal(err)
	}
	err := caddy.Validate(&c)
	if err == nil || !strings.Contains(err.Error(), "no cluster app in this config") {
		t.Fatalf("error %v; want one saying the cluster app is missing", err)
	}
}

// TestSerfUpstreamsValidate covers the checks of the JSON config.
func TestSerfUpstreamsValidate(t *testing.T) {
	for _, tc := range []struct {
		su   SerfUpstreams
		want string
	}{
		{SerfUpstreams{}, "give a port or a port_tag"},
		{SerfUpstreams{Selector: Selector{Port: "http"}}, `port "http": want a number from 1 to 65535`},
		{SerfUpstreams{Selector: Selector{Port: "70000"}}, `port "70000"`},
		{SerfUpstreams{Selector: Selector{PortTag: "p"}, Refresh: -1}, "refresh -1ns is below the minimum 10ms"},
		{SerfUpstreams{Selector: Selector{PortTag: "p", Tags: map[string]string{"role": ""}}}, `tag "role"=""`},
	} {
		if err := tc.su.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v; want %q", tc.su, err, tc.want)
		}
	}
}

// TestSerfUpstreamsUnmarshalCaddyfile covers the syntax and every error.
func TestSerfUpstreamsUnmarshalCaddyfile(t *testing.T) {
	d := caddyfile.NewTestDispenser("serf {\n tag role api\n tag zone a\n port_tag http_port\n port 8080\n exclude_self\n refresh 2s\n}")
	var su SerfUpstreams
	if err := su.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(su)
	if want := `{"tags":{"role":"api","zone":"a"},"port":"8080","port_tag":"http_port","exclude_self":true,"refresh":2000000000}`; string(got) != want {
		t.Errorf("got %s\nwant %s", got, want)
	}
	for _, tc := range []struct{ in, want string }{
		{"serf", "give a port or a port_tag"},
		{"serf 1 2", "at most one argument"},
		{"serf abc", `port "abc"`},
		{"serf 80 {\n port 81\n}", "port specified more than once"},
		{"serf {\n port\n}", "dynamic serf: port: missing value"},
		{"serf {\n port 80 81\n}", `dynamic serf: port: one value expected, got another: "81"`},
		{"serf {\n port 0\n}", `port "0"`},
		{"serf {\n port_tag\n}", "dynamic serf: port_tag: missing value"},
		{"serf {\n port_tag a\n port_tag b\n}", "port_tag specified more than once"},
		{"serf {\n tag role\n port 1\n}", "tag: want <key> <value>, got 1"},
		{"serf {\n tag role api\n tag role web\n port 1\n}", `tag "role" specified more than once`},
		{"serf {\n exclude_self yes\n port 1\n}", `exclude_self: unexpected argument "yes"`},
		{"serf {\n refresh soon\n port 1\n}", `refresh "soon": want a positive duration`},
		{"serf {\n refresh 0s\n port 1\n}", `refresh "0s"`},
		{"serf {\n bogus\n}", `unknown option "bogus"`},
	} {
		err := new(SerfUpstreams).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
	}
}
