package rebalance

import (
	"encoding/json"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// bigTags are tags that, with the load tag, do not fit in serf's 512
// bytes.
var bigTags = `{"a": "` + strings.Repeat("x", 250) + `", "b": "` + strings.Repeat("y", 250) + `"}`

// TestAppBoundsJSON: every option of the app, decoded from JSON as Caddy
// decodes it, then provisioned and validated: each bad value is refused
// with the option's name and why, before anything sized by it is
// allocated (interval 1ns and history 1000000h once ran out of memory).
func TestAppBoundsJSON(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`"interval": "1ns"`, "interval 1ns is below the minimum 100ms"},
		{`"interval": "99ms"`, "interval 99ms is below the minimum 100ms"},
		{`"interval": "-1s"`, "interval -1s is below the minimum 100ms"},
		{`"interval": "11m"`, "interval 11m0s is above the maximum 10m0s"},
		{`"interval": "soon"`, `interval: time: invalid duration "soon"`},
		{`"interval": true`, "appJSON.interval of type"},
		{`"history": "1000000h"`, "history 1000000h0m0s is above the maximum 24h0m0s"},
		{`"history": "1ns"`, "history 1ns is below the minimum 100ms"},
		{`"interval": "100ms", "history": "24h"`, "history 24h0m0s over interval 100ms is 864000 samples, above the maximum 3600"},
		{`"interval": "2s", "history": "1s"`, "history (1s) must be at least interval (2s)"},
		{`"freshness": "1ns"`, "freshness 1ns is below the minimum 100ms"},
		{`"freshness": "-5s"`, "freshness -5s is below the minimum 100ms"},
		{`"freshness": "25h"`, "freshness 25h0m0s is above the maximum 24h0m0s"},
		{`"interval": "2s", "freshness": "1s"`, "freshness 1s is below interval 2s"},
		{`"threshold": 1e18`, "threshold 1e+18%: want a percentage above 0% and at most 1000%"},
		{`"threshold": 1001`, "threshold 1001%: want a percentage above 0% and at most 1000%"},
		{`"threshold": -5`, "threshold -5%: want a percentage above 0%"},
		{`"threshold": "20"`, "appJSON.threshold of type float64"},
		{`"stop_band": 1e18`, "stop_band 1e+18%: want a percentage"},
		{`"stop_band": -1`, "stop_band -1%: want a percentage above 0%"},
		{`"threshold": 10, "stop_band": 15`, "stop_band 15% is above threshold 10%"},
		{`"stop_band": 30`, "stop_band 30% is above threshold 20%"},
		{`"shed_rate": 101`, "shed_rate 101%: want a percentage above 0% and at most 100%"},
		{`"shed_rate": -0.5`, "shed_rate -0.5%: want a percentage"},
		{`"shed_rate": 1e308`, "shed_rate 1e+308%: want a percentage"},
		{`"min_connections": -1`, "min_connections -1: want a whole number from 0 to 10000000"},
		{`"min_connections": 1000000000`, "min_connections 1000000000: want a whole number from 0 to 10000000"},
		{`"min_connections": 1e30`, "number 1e30 into Go struct field appJSON.min_connections"},
		{`"min_connections": 1.5`, "number 1.5 into Go struct field appJSON.min_connections"},
		{`"boundary_timeout": "-1s"`, "boundary_timeout -1s is below the minimum 0s"},
		{`"boundary_timeout": "25h"`, "boundary_timeout 25h0m0s is above the maximum 24h0m0s"},
		{`"boundary_timeout": "x"`, "boundary_timeout: time: invalid duration"},
		{`"join_settle": "25h"`, "join_settle 25h0m0s is above the maximum 24h0m0s"},
		{`"idle_close_after": "500ms"`, "idle_close_after 500ms is below the minimum 1s"},
		{`"idle_close_after": "-1s"`, "idle_close_after -1s is below the minimum 1s"},
		{`"idle_close_after": "25h"`, "idle_close_after 25h0m0s is above the maximum 24h0m0s"},
		{`"metric": "ram"`, `metric "ram": want`},
		{`"metric": "node_cpu"`, `metric "node_cpu": want connections, throughput or cpu`},
		{`"metric": "cpu", "cpu": "bogus"`, `cpu "bogus": want node or process`},
		{`"cpu": "NODE"`, `cpu "NODE": want node or process`},
		{`"cpu": "node"`, `cpu "node": cpu is only used with metric cpu, and metric is connections`},
		{`"metric": "throughput", "cpu": "process"`, `cpu "process": cpu is only used with metric cpu, and metric is throughput`},
		{`"cpu": 1`, "appJSON.cpu of type string"},
		{`"bogus": 1`, `unknown field "bogus"`},
	} {
		t.Run(tc.json, func(t *testing.T) {
			raw := []byte(`{` + tc.json + `}`)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			a := new(App)
			err := caddy.StrictUnmarshalJSON(raw, a)
			if err == nil {
				a.source = &fakeSource{}
				a.cluster = &cluster.App{NodeName: "bounds"}
				err = provisionApp(t, a)
			}
			runtime.ReadMemStats(&after)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v; want one containing %q", err, tc.want)
			}
			// The window would be history/interval samples of 8 bytes.
			if grown := after.TotalAlloc - before.TotalAlloc; grown > 4<<20 {
				t.Errorf("provisioning and validating allocated %d bytes", grown)
			}
		})
	}
	// The bounds themselves are accepted.
	a := new(App)
	err := caddy.StrictUnmarshalJSON([]byte(`{"interval": "100ms",
		"history": "360s", "freshness": "24h", "threshold": 1000, "stop_band": 1000, "shed_rate": 100,
		"min_connections": 10000000, "boundary_timeout": "24h", "join_settle": "24h", "idle_close_after": "24h"}`), a)
	if err == nil {
		a.source = &fakeSource{}
		a.cluster = &cluster.App{NodeName: "bounds"}
		err = provisionApp(t, a)
	}
	if err != nil {
		t.Errorf("the bounds: %v", err)
	}
}

// TestProvisionWritesDefaults: Provision writes each option's default
// into its field, as Caddy's modules do, and the decision's parameters
// are those fields as ratios; a config given as the defaults it wrote
// runs the same.
func TestProvisionWritesDefaults(t *testing.T) {
	a := &App{source: &fakeSource{}, cluster: &cluster.App{NodeName: "defaults"}}
	if err := provisionApp(t, a); err != nil {
		t.Fatal(err)
	}
	minConns := defaultMinConnections
	want := App{
		Metric: metricConnections, Interval: caddy.Duration(time.Second), History: caddy.Duration(10 * time.Second),
		Freshness: caddy.Duration(5 * time.Second), Threshold: 20, StopBand: 10, ShedRate: 0.5,
		MinConnections: &minConns, JoinSettle: caddy.Duration(5 * time.Second), IdleCloseAfter: caddy.Duration(2 * time.Minute),
	}
	got, wantJSON := caddyconfig.JSON(a, nil), caddyconfig.JSON(want, nil)
	if string(got) != string(wantJSON) {
		t.Errorf("options after Provision %s; want %s", got, wantJSON)
	}
	p := a.params()
	if p.Threshold != 0.2 || p.StopBand != 0.1 || p.ShedRate != 0.005 || p.MinConnections != minConns ||
		p.Freshness != 5*time.Second || p.EffectiveJoinSettle() != 5*time.Second || p.Metric != metricConnections {
		t.Errorf("params %+v", p)
	}
	again := new(App)
	if err := caddy.StrictUnmarshalJSON(got, again); err != nil {
		t.Fatal(err)
	}
	again.source, again.cluster = &fakeSource{}, &cluster.App{NodeName: "defaults"}
	if err := provisionApp(t, again); err != nil {
		t.Fatalf("the defaults, given: %v", err)
	}
	if again.params() != p {
		t.Errorf("the defaults, given, run with %+v; want %+v", again.params(), p)
	}
}

// TestLoadTagMustFit: cluster tags that fit serf's 512 bytes alone but
// not with the load tag are refused by the rebalance app, which
// publishes it.
func TestLoadTagMustFit(t *testing.T) {
	var tags map[string]string
	if err := json.Unmarshal([]byte(bigTags), &tags); err != nil {
		t.Fatal(err)
	}
	c := &cluster.App{NodeName: "fit", Tags: tags}
	if err := c.CheckTagsFit(nil); err != nil {
		t.Fatalf("the tags alone: %v", err)
	}
	a := &App{source: &fakeSource{}, cluster: c}
	err := provisionApp(t, a)
	if err == nil || !strings.Contains(err.Error(), "with the ones lbx publishes, take 570 bytes encoded, above serf's limit of 512") {
		t.Fatalf("error %v; want the load tag's room refused", err)
	}
}

// TestAppBoundsCaddyfile: the same bounds from the Caddyfile, each error
// with its line.
func TestAppBoundsCaddyfile(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"rebalance {\n interval 1ns\n}", "interval 1ns is below the minimum 100ms, at Testfile:2"},
		{"rebalance {\n interval 1h\n}", "interval 1h0m0s is above the maximum 10m0s, at Testfile:2"},
		{"rebalance {\n history 1000000h\n}", "history 1000000h0m0s is above the maximum 24h0m0s, at Testfile:2"},
		{"rebalance {\n interval 100ms\n history 1h\n}", "history 1h0m0s over interval 100ms is 36000 samples, above the maximum 3600"},
		{"rebalance {\n interval 5s\n history 1s\n}", "history (1s) must be at least interval (5s)"},
		{"rebalance {\n freshness 1ns\n}", "freshness 1ns is below the minimum 100ms, at Testfile:2"},
		{"rebalance {\n interval 10s\n freshness 2s\n}", "freshness 2s is below interval 10s"},
		{"rebalance {\n threshold 1e18\n}", "threshold 1e+18%: want a percentage above 0% and at most 1000%, at Testfile:2"},
		{"rebalance {\n threshold NaN\n}", "threshold NaN%: want a percentage above 0% and at most 1000%, at Testfile:2"},
		{"rebalance {\n threshold Inf%\n}", "threshold +Inf%: want a percentage"},
		{"rebalance {\n threshold -5\n}", "threshold -5%: want a percentage"},
		{"rebalance {\n stop_band NaN\n}", "stop_band NaN%: want a percentage"},
		{"rebalance {\n shed_rate Inf\n}", "shed_rate +Inf%: want a percentage above 0% and at most 100%"},
		{"rebalance {\n threshold 10\n stop_band 15\n}", "stop_band 15% is above threshold 10%"},
		{"rebalance {\n min_connections 99999999999\n}", "min_connections 99999999999: want a whole number from 0 to 10000000, at Testfile:2"},
		{"rebalance {\n boundary_timeout 25h\n}", "boundary_timeout 25h0m0s is above the maximum 24h0m0s, at Testfile:2"},
		{"rebalance {\n idle_close_after 100ms\n}", "idle_close_after 100ms is below the minimum 1s, at Testfile:2"},
		{"rebalance {\n idle_close_after 25h\n}", "idle_close_after 25h0m0s is above the maximum 24h0m0s, at Testfile:2"},
		{"rebalance {\n metric ram\n}", `metric "ram": want connections, throughput or cpu, at Testfile:2`},
		{"rebalance {\n metric cpu\n cpu bogus\n}", `cpu "bogus": want node or process, at Testfile:3`},
		{"rebalance {\n cpu bogus\n metric cpu\n}", `cpu "bogus": want node or process, at Testfile:2`},
		{"rebalance {\n metric connections\n cpu node\n}", `cpu "node": cpu is only used with metric cpu, and metric is connections, at Testfile:`},
		{"rebalance {\n cpu process\n}", `cpu "process": cpu is only used with metric cpu, and metric is connections, at Testfile:`},
		{"rebalance {\n metric throughput\n cpu node\n}", `cpu "node": cpu is only used with metric cpu, and metric is throughput`},
		{"rebalance {\n metric cpu\n cpu\n}", "cpu: missing value"},
		{"rebalance {\n metric cpu\n cpu node process\n}", `cpu: one value expected, got another: "process"`},
		{"rebalance {\n metric cpu\n cpu node\n cpu node\n}", "cpu specified more than once"},
	} {
		err := new(App).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
		if err != nil && !strings.Contains(err.Error(), "Testfile:") {
			t.Errorf("%q: error %q does not name its line", tc.in, err)
		}
	}
}

// TestRefreshBounds: refresh of lb_policy cluster_load, in JSON (the
// field named when it does not decode) and the Caddyfile.
func TestRefreshBounds(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`{"refresh": "1ns"}`, "lb_policy cluster_load: refresh 1ns is below the minimum 10ms"},
		{`{"refresh": "1000h"}`, "lb_policy cluster_load: refresh 1000h0m0s is above the maximum 1h0m0s"},
		{`{"refresh": 1.5}`, "clusterLoadJSON.refresh of type"},
		{`{"port": "0"}`, `port "0": want a number from 1 to 65535`},
	} {
		var p ClusterLoadSelection
		err := caddy.StrictUnmarshalJSON([]byte(tc.json), &p)
		if err == nil {
			err = p.Validate()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("cluster_load %s: error %v; want one containing %q", tc.json, err, tc.want)
		}
	}
	for _, tc := range []struct {
		in   string
		u    caddyfile.Unmarshaler
		want string
	}{
		{"cluster_load {\n refresh 1ns\n}", new(ClusterLoadSelection), "lb_policy cluster_load: refresh 1ns is below the minimum 10ms, at Testfile:2"},
	} {
		err := tc.u.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
	}
}

// TestDuplicateGlobalBlock: a second `rebalance` block names its file
// and line (it used to say "at :0").
func TestDuplicateGlobalBlock(t *testing.T) {
	src := "{\n\tcluster\n\trebalance {\n\t\tinterval 1s\n\t}\n\trebalance {\n\t\tinterval 2s\n\t}\n}\n\n:8080\n"
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
	if err == nil || !strings.Contains(err.Error(), "rebalance specified more than once; use one rebalance block") || !strings.Contains(err.Error(), "Caddyfile:6") {
		t.Fatalf("error %v; want the duplicate named at Caddyfile:6", err)
	}
}

// TestThroughputWarningSkipsCaddysOwnServer: the warning about servers
// without the listener wrapper names the operator's servers, not the one
// Caddy's automatic HTTPS adds for its redirects.
func TestThroughputWarningSkipsCaddysOwnServer(t *testing.T) {
	counted, plain, redirects := new(caddyhttp.Server), new(caddyhttp.Server), new(caddyhttp.Server)
	conns := newProcessConns()
	if err := conns.servers.add(counted, new(ListenerWrapper)); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.WarnLevel)
	a := &App{logger: zap.New(core), conns: conns, checkWrapper: true, httpApp: &caddyhttp.App{Servers: map[string]*caddyhttp.Server{
		"srv0": counted, autoHTTPSRedirectServer: redirects,
	}}}
	if err := a.checkThroughputWrapper(); err != nil {
		t.Fatal(err)
	}
	if logs.Len() != 0 {
		t.Errorf("warned: %v", logs.All()[0].ContextMap())
	}
	// An operator's server without the wrapper is still named.
	a.httpApp.Servers["srv1"] = plain
	if err := a.checkThroughputWrapper(); err != nil {
		t.Fatal(err)
	}
	if logs.Len() != 1 || fmt.Sprint(logs.All()[0].ContextMap()["servers"]) != "[srv1]" {
		t.Errorf("warnings %v; want one naming srv1 alone", logs.All())
	}
}

// TestReloadTagsTooLarge: a reload through POST /load whose tags would
// not fit serf's 512 bytes fails with a clear error, and the running
// config keeps serving and gossiping its load.
func TestReloadTagsTooLarge(t *testing.T) {
	adminPort, httpPort, gossipPort := freePort(t), freePort(t), freePort(t)
	config := func(tags string) []byte {
		return fmt.Appendf(nil, `{
			"admin": {"listen": "127.0.0.1:%d"},
			"apps": {
				"http": {"servers": {"s": {
					"listen": ["127.0.0.1:%d"],
					"routes": [{"handle": [{"handler": "static_response", "body": "ok"}]}]
				}}},
				"cluster": {"node_name": "tags", "bind": "127.0.0.1:%d", "tags": %s},
				"rebalance": {"interval": "100ms", "history": "100ms"}
			}
		}`, adminPort, httpPort, gossipPort, tags)
	}
	if err := caddy.Load(config(`{"zone": "a"}`), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })
	var n *node
	nodes.Range(func(_, v any) bool {
		if v.(*node).name == "tags" {
			n = v.(*node)
		}
		return true
	})
	if n == nil {
		t.Fatal("no node")
	}
	gossips := func() (bool, string) {
		tags := selfTags(n)
		_, _, ok := shed.ParseLoadTag(tags[shed.LoadTag])
		return ok && tags["zone"] == "a", fmt.Sprintf("tags %v", tags)
	}
	lbxtest.WaitFor(t, 5*time.Second, "the node gossips its load", gossips)

	status, body, err := lbxtest.PostLoad(http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d", adminPort), "application/json", config(bigTags))
	if err != nil {
		t.Fatal(err)
	}
	if status == http.StatusOK || !strings.Contains(string(body), "above serf's limit of 512") {
		t.Fatalf("POST /load: %d %s; want an error naming serf's limit", status, body)
	}
	var apiErr struct{ Error string }
	if json.Unmarshal(body, &apiErr) == nil {
		t.Logf("POST /load: %d %s", status, apiErr.Error)
	}
	// The running config serves and still gossips, with its own tags.
	got, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", httpPort))
	if err != nil {
		t.Fatalf("the old config does not serve: %v", err)
	}
	got.Body.Close()
	seq := selfTags(n)[shed.LoadTag]
	lbxtest.WaitFor(t, 5*time.Second, "the node still publishes new load reports", func() (bool, string) {
		ok, why := gossips()
		return ok && selfTags(n)[shed.LoadTag] != seq, why
	})
}

// selfTags returns the tags n's cluster member gossips, as its serf sees
// them.
func selfTags(n *node) map[string]string {
	s := n.driver()
	if s == nil {
		return nil
	}
	ms, _ := s.cluster.Members()
	for _, m := range ms {
		if m.Self {
			return m.Tags
		}
	}
	return nil
}

// FuzzAppJSON: decoding, provisioning and validating any JSON as the
// rebalance app never panics, and never allocates in proportion to the
// values it carries (a window, a buffer): whatever passes is within the
// bounds.
func FuzzAppJSON(f *testing.F) {
	for _, seed := range []string{
		`{}`,
		`{"interval": "1ns"}`,
		`{"history": "1000000h"}`,
		`{"interval": "100ms", "history": "24h"}`,
		`{"threshold": 1e18, "stop_band": -1, "shed_rate": 1e308}`,
		`{"min_connections": -9223372036854775808}`,
		`{"freshness": "-9223372036854775807ns", "boundary_timeout": "2562047h"}`,
		`{"metric": "cpu", "interval": 9223372036854775807}`,
		`{"metric": "cpu", "cpu": "node"}`,
		`{"metric": "throughput", "cpu": "process"}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		a := new(App)
		if caddy.StrictUnmarshalJSON(raw, a) != nil {
			return
		}
		a.cluster = &cluster.App{NodeName: "fuzz"}
		a.source = &fakeSource{}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		err := provisionApp(t, a)
		runtime.ReadMemStats(&after)
		if grown := after.TotalAlloc - before.TotalAlloc; grown > 4<<20 {
			t.Fatalf("%s: provisioning allocated %d bytes", raw, grown)
		}
		if err != nil {
			return
		}
		if w := windowSize(time.Duration(a.History), time.Duration(a.Interval)); w > maxWindowSamples || time.Duration(a.Interval) < minInterval {
			t.Fatalf("%s: accepted with a window of %d samples at interval %v", raw, w, time.Duration(a.Interval))
		}
	})
}
