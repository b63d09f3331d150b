package cluster_test

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	dto "github.com/prometheus/client_model/go"

	_ "github.com/caddy-lbx/lbx" // every lbx module
	"github.com/caddy-lbx/lbx/lbxtest"
)

// adminConfigRequests counts the requests Caddy's admin endpoint served
// on /config/ (caddy_admin_http_requests_total, counted by the admin
// server itself).
func adminConfigRequests(t *testing.T) float64 {
	return gather(t, "caddy_admin_http_requests_total", func(l map[string]string) bool { return l["path"] == "/config/" })
}

// gather sums the series of the metric name whose labels match.
func gather(t *testing.T, name string, match func(map[string]string) bool) float64 {
	t.Helper()
	ctx := caddy.ActiveContext()
	mfs, err := ctx.GetMetricsRegistry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if match(labels) {
				sum += value(m)
			}
		}
	}
	return sum
}

func value(m *dto.Metric) float64 {
	if c := m.GetCounter(); c != nil {
		return c.GetValue()
	}
	return m.GetGauge().GetValue()
}

// TestHostileMembers: a cluster bound to loopback, with and without a
// key, whose members (real serf members run by the test) advertise this
// node's admin endpoint, this node's own site port, a port outside the
// allowlist, a 20 KB name, and ports that churn between those; a member
// with 1,000 tags cannot even start (serf's 512-byte limit). Public
// requests that carry the admin endpoint's Host go through `dynamic
// serf` (round robin, and with lb_policy cluster_load and allow_ports)
// and partition's serf_tag: the admin endpoint serves 0 of them,
// counted by the admin server itself; the only answers come from the
// honest backends; the refusals are in /lbx/cluster and the counter.
func TestHostileMembers(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and serf members")
	}
	for _, keyed := range []bool{true, false} {
		t.Run(fmt.Sprintf("key=%v", keyed), func(t *testing.T) {
			// A port FreePort picked may be taken by another process's
			// outgoing connection before Caddy binds it (CI runs both
			// modules' tests at once): start over on new ports, a new
			// cluster, at most 3 times.
			for attempt := 1; !hostileMembers(t, keyed, attempt < 3); attempt++ {
				t.Logf("attempt %d: a port was taken before Caddy bound it; again on new ports", attempt)
			}
		})
	}
}

// hostileMembers runs the scenario; it reports false, having done nothing
// else, when Caddy could not bind a port it was given and mayRetry.
func hostileMembers(t *testing.T, keyed, mayRetry bool) bool {
	var key []byte
	keyLine := ""
	if keyed {
		key = make([]byte, 32)
		rand.Read(key)
		keyLine = "encrypt_key " + base64.StdEncoding.EncodeToString(key)
	}
	adminPort, gossipPort := lbxtest.FreePort(t), lbxtest.FreePort(t)
	s1, s2, s3 := lbxtest.FreePort(t), lbxtest.FreePort(t), lbxtest.FreePort(t)
	good, other := lbxtest.NamedBackend(t, "good"), lbxtest.NamedBackend(t, "other")
	outside := strconv.Itoa(lbxtest.FreePort(t)) // nothing listens there

	seed, err := lbxtest.StartSerfMember(t, "good", map[string]string{"role": "api", "http_port": good, "partition": "0/1"}, key, "")
	if err != nil {
		t.Fatal(err)
	}
	join := lbxtest.SerfAddr(seed)
	evil := map[string]string{
		"evil-admin":   strconv.Itoa(adminPort),
		"evil-site":    strconv.Itoa(s1),
		"evil-outside": outside,
		"other":        other, // honest, but outside the allowlist of s2
	}
	for name, port := range evil {
		if _, err := lbxtest.StartSerfMember(t, name, map[string]string{"role": "api", "http_port": port, "partition": "0/1"}, key, join); err != nil {
			t.Fatal(err)
		}
	}
	longName := strings.Repeat("n", 20000)
	if _, err := lbxtest.StartSerfMember(t, longName, map[string]string{"role": "api", "http_port": good, "partition": "0/1"}, key, join); err != nil {
		t.Fatalf("the 20 KB name: %v", err)
	}
	many := make(map[string]string, 1000)
	for i := range 1000 {
		many["t"+strconv.Itoa(i)] = "v"
	}
	if _, err := lbxtest.StartSerfMember(t, "many-tags", many, key, join); err == nil || !strings.Contains(err.Error(), "512") {
		t.Fatalf("a member with 1,000 tags started (err %v); want serf to refuse tags over 512 bytes", err)
	}
	churn, err := lbxtest.StartSerfMember(t, "churn", map[string]string{"role": "api", "http_port": outside, "partition": "0/1"}, key, join)
	if err != nil {
		t.Fatal(err)
	}

	cfg := fmt.Sprintf(`{
	admin 127.0.0.1:%[1]d
	cluster {
		node_name front
		bind 127.0.0.1:%[2]d
		join %[3]s
		%[4]s
	}
	rebalance {
		interval 200ms
	}
}
:%[5]d {
	bind 127.0.0.1
	reverse_proxy {
		dynamic serf {
			tag role api
			port_tag http_port
			refresh 50ms
		}
	}
}
:%[6]d {
	bind 127.0.0.1
	reverse_proxy {
		dynamic serf {
			tag role api
			port_tag http_port
			refresh 50ms
			allow_ports %[8]s
		}
		lb_policy cluster_load {
			port_tag http_port
		}
	}
}
:%[7]d {
	bind 127.0.0.1
	partition {
		serf_tag partition {
			port_tag http_port
			tag role api
		}
		poll_interval 100ms
	}
}
`, adminPort, gossipPort, join, keyLine, s1, s2, s3, good)
	adapted, warn, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cfg), nil)
	if err != nil {
		t.Fatalf("adapt: %v (%v)", err, warn)
	}
	if err := caddy.Load(adapted, true); err != nil {
		if mayRetry && strings.Contains(err.Error(), "address already in use") {
			return false
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })

	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	adminHost := fmt.Sprintf("localhost:%d", adminPort)
	get := func(port int, host string) (int, string) {
		req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d/config/", port), nil)
		req.Host = host
		res, err := client.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(res.Body, 1<<16))
		return res.StatusCode, string(b)
	}

	// The count at the admin endpoint sees a request that does reach it.
	before := adminConfigRequests(t)
	if code, body := get(adminPort, adminHost); code != http.StatusOK || !strings.Contains(body, "apps") {
		t.Fatalf("direct admin request: %d %.80q", code, body)
	}
	if after := adminConfigRequests(t); after != before+1 {
		t.Fatalf("admin /config/ requests %v → %v after one direct request; the count does not count", before, after)
	}

	// Every member is seen before the traffic starts.
	lbxtest.WaitFor(t, 10*time.Second, "front sees every member", func() (bool, string) {
		code, body := get(s2, adminHost)
		n := seenMembers(t, client, adminPort)
		return code == http.StatusOK && body == "good" && n == 8, fmt.Sprintf("%d %q, %d members", code, body, n)
	})
	before = adminConfigRequests(t)

	// Churn the churning member's port among the admin port, the own
	// site port and the port nothing listens on, while traffic runs.
	done := make(chan struct{})
	go func() {
		defer close(done)
		ports := []string{strconv.Itoa(adminPort), strconv.Itoa(s1), outside, strconv.Itoa(s2), strconv.Itoa(s3)}
		for i := range 15 { // SetTags waits for the broadcast: it paces the churn
			churn.SetTags(map[string]string{"role": "api", "http_port": ports[i%len(ports)], "partition": "0/1"})
		}
	}()
	answers := map[string]int{}
	sent := 0
	for running := true; running && sent < 20000; sent++ {
		select {
		case <-done:
			running = false
		default:
		}
		port := []int{s1, s2, s3}[sent%3]
		host := adminHost
		if sent%2 == 1 {
			host = fmt.Sprintf("127.0.0.1:%d", adminPort)
		}
		code, body := get(port, host)
		if strings.Contains(body, `"apps"`) {
			t.Fatalf("site %d answered with the admin API's config: %.120q", port, body)
		}
		if len(body) > 40 {
			body = body[:40]
		}
		key := fmt.Sprintf("%d %s", code, body)
		if port == s2 {
			key = "s2 " + key
		}
		answers[key]++
	}
	<-done
	t.Logf("%d requests while the churning member changed its port 15 times; answers: %v", sent, answers)
	if got := adminConfigRequests(t) - before; got != 0 {
		t.Errorf("the admin endpoint served %v of the public requests; want 0", got)
	}
	for a := range answers {
		if strings.HasPrefix(a, "s2 ") && a != "s2 200 good" {
			t.Errorf("the allowlisted site answered %q; want only the member at allow_ports %s", a, good)
		}
	}

	// The refusals are in the view and the counter.
	view := clusterView(t, client, adminPort)
	want := map[string]string{
		"evil-admin":   "own_listener",
		"evil-site":    "own_listener",
		"evil-outside": "port_not_allowed",
		"other":        "port_not_allowed",
	}
	for name, reason := range want {
		if !hasRefusal(view, name, reason) {
			t.Errorf("/lbx/cluster: member %s has no refusal %s: %v", name, reason, view[name])
		}
	}
	var shown string
	for name := range view {
		if strings.HasPrefix(name, "nnnn") {
			shown = name
		}
	}
	if len(shown) > 131 || !hasRefusal(view, shown, "bad_name") {
		t.Errorf("the 20 KB name is shown as %d bytes with refusals %v; want at most 131 and bad_name", len(shown), view[shown])
	}
	for _, reason := range []string{"own_listener", "port_not_allowed", "bad_name"} {
		n := gather(t, "caddy_lbx_cluster_members_refused_total", func(l map[string]string) bool { return l["reason"] == reason })
		if n < 1 {
			t.Errorf("caddy_lbx_cluster_members_refused_total{reason=%q} = %v; want ≥ 1", reason, n)
		}
	}
	return true
}

// memberRefusals is a member's refusals in /lbx/cluster, by member name.
type memberRefusals map[string][]struct {
	Dial   string `json:"dial"`
	Reason string `json:"reason"`
}

func clusterView(t *testing.T, client *http.Client, adminPort int) memberRefusals {
	t.Helper()
	req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d/lbx/cluster", adminPort), nil)
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var v struct {
		Nodes []struct {
			Members []struct {
				Name    string `json:"name"`
				Refused []struct {
					Dial   string `json:"dial"`
					Reason string `json:"reason"`
				} `json:"refused"`
			} `json:"members"`
		} `json:"nodes"`
	}
	if err := json.NewDecoder(res.Body).Decode(&v); err != nil {
		t.Fatal(err)
	}
	out := memberRefusals{}
	for _, n := range v.Nodes {
		for _, m := range n.Members {
			out[m.Name] = append(out[m.Name], m.Refused...)
		}
	}
	return out
}

func seenMembers(t *testing.T, client *http.Client, adminPort int) int {
	return len(clusterView(t, client, adminPort))
}

func hasRefusal(v memberRefusals, name, reason string) bool {
	for _, r := range v[name] {
		if r.Reason == reason {
			return true
		}
	}
	return false
}
