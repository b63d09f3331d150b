package partition

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func ejectFor(s *hoststate.Stats, now int64, d time.Duration) int64 {
	until, _, _ := s.Eject(now, 0, func(int64) time.Duration { return d }, hoststate.ReasonConsecutiveFailures)
	return until
}

// TestCapacityRespectsEjection: a replica lbx's outlier detection ejected
// is not usable; a scheme whose partition has no other replica loses its
// capacity until the ejection ends. The state is the process-wide one of
// the address, shared with the selection policies' tables.
func TestCapacityRespectsEjection(t *testing.T) {
	hosts := hoststate.NewTable(hoststate.Config{})
	entry := func(dial, tag string) Entry {
		tg, err := ParseTag(tag)
		if err != nil {
			t.Fatal(err)
		}
		return Entry{Dial: dial, Tag: tg}
	}
	a, b, c, d := "cap-a.test:1", "cap-b.test:1", "cap-c.test:1", "cap-d.test:1"
	l, err := buildLayout([]Entry{entry(d, "0/1"), entry(a, "0/2"), entry(b, "1/2"), entry(c, "1/2")}, nil, hosts)
	if err != nil {
		t.Fatal(err)
	}
	one, two := l.schemes[0], l.schemes[1]

	policy := hoststate.NewTable(hoststate.Config{}) // as a selection policy's
	defer policy.Release()
	if policy.Stats(a) != l.byAddr[a].stats {
		t.Fatal("the layout's state of an address is not the one selection policies share")
	}
	if n := hoststate.References(a); n != 2 {
		t.Errorf("%d references on %s; want 2 (the handler's and the policy's)", n, a)
	}

	now := monoclock.Now()
	if one.capacity(now) != 1 || two.capacity(now) != 1 {
		t.Fatalf("capacities %d, %d; want 1, 1", one.capacity(now), two.capacity(now))
	}
	// One of two replicas of p1 out: the scheme still has capacity 1.
	ejectFor(policy.Stats(b), now, time.Minute)
	if got := two.capacity(now); got != 1 {
		t.Errorf("with %s ejected: capacity %d; want 1", b, got)
	}
	// The only replica of p0 out: capacity 0, and every draw picks the
	// other scheme.
	until := ejectFor(policy.Stats(a), now, time.Minute)
	if got := two.capacity(now); got != 0 {
		t.Errorf("with %s ejected: capacity %d; want 0", a, got)
	}
	if got, want := two.describe(now, nil), "2 partitions: capacity 0 (no usable replica for p0 (1 ejected))"; got != want {
		t.Errorf("describe: %q; want %q", got, want)
	}
	for i := range 100 {
		if s := l.choose(func(n int) int { return i % n }, now); s != one {
			t.Fatalf("draw %d chose the scheme of %d partitions", i, s.count)
		}
	}
	// When the ejection ends, the capacity comes back.
	if got := two.capacity(until + 1); got != 1 {
		t.Errorf("after the ejection: capacity %d; want 1", got)
	}

	hosts.Release()
	if n := hoststate.References(a); n != 1 {
		t.Errorf("after the handler's release, %d references on %s; want the policy's 1", n, a)
	}
}

// TestSourceLeavesEjectedOut: for policies that do not know ejection, the
// upstream source offers ejected replicas only when nothing else is left.
func TestSourceLeavesEjectedOut(t *testing.T) {
	hosts := hoststate.NewTable(hoststate.Config{})
	defer hosts.Release()
	a, b := "src-a.test:1", "src-b.test:1"
	reps := []*replica{
		{dial: a, hostport: a, stats: hosts.Stats(a)},
		{dial: b, hostport: b, stats: hosts.Stats(b)},
	}
	ejectFor(reps[0].stats, monoclock.Now(), time.Minute)

	dials := func(st *subState, triedLast string) []string {
		t.Helper()
		repl := caddy.NewReplacer()
		if triedLast != "" {
			repl.Set("http.reverse_proxy.upstream.hostport", triedLast)
		}
		ctx := context.WithValue(context.Background(), subStateKey{}, st)
		ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, repl)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://x/", nil)
		ups, err := source{}.GetUpstreams(req)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, u := range ups {
			out = append(out, u.Dial)
		}
		return out
	}
	st := &subState{replicas: reps, skipEjected: true}
	if got := dials(st, ""); fmt.Sprint(got) != fmt.Sprint([]string{b}) {
		t.Errorf("first attempt: %v; want only %s", got, b)
	}
	// b was tried: the ejected a is all that is left untried.
	if got := dials(st, b); fmt.Sprint(got) != fmt.Sprint([]string{a}) {
		t.Errorf("retry: %v; want %s", got, a)
	}
	// Policies that know ejection (ewma) see every replica.
	if got := dials(&subState{replicas: reps}, ""); len(got) != 2 {
		t.Errorf("without skipEjected: %v; want both", got)
	}
}

// TestSkipEjectedFollowsThePolicy: a provisioned handler leaves ejected
// replicas out of the pool for a selection policy that does not skip them
// itself, and hands lbx's ewma (the default) and panic every replica.
func TestSkipEjectedFollowsThePolicy(t *testing.T) {
	// reverse_proxy's Provision needs a config to load the events app into.
	parent, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := caddy.NewContext(parent)
	defer cancel()
	for _, tc := range []struct {
		proxy string
		want  bool
	}{
		{``, false},
		{`,"proxy":{"load_balancing":{"selection_policy":{"policy":"ewma"}}}`, false},
		{`,"proxy":{"load_balancing":{"selection_policy":{"policy":"panic","selection_policy":{"policy":"least_conn"}}}}`, false},
		{`,"proxy":{"load_balancing":{"selection_policy":{"policy":"least_conn"}}}`, true},
		{`,"proxy":{"load_balancing":{"selection_policy":{"policy":"first"}}}`, true},
	} {
		mod, err := ctx.LoadModuleByID("http.handlers.partition", json.RawMessage(
			`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}]`+tc.proxy+`}`))
		if err != nil {
			t.Fatalf("%s: %v", tc.proxy, err)
		}
		h := mod.(*Handler)
		if h.skipEjected != tc.want {
			t.Errorf("%s: skipEjected %v, want %v", tc.proxy, h.skipEjected, tc.want)
		}
		if err := h.Cleanup(); err != nil {
			t.Errorf("%s: cleanup: %v", tc.proxy, err)
		}
	}
}

// upstreamsStatus is the part of GET /lbx/upstreams these tests read.
type upstreamsStatus struct {
	Upstreams []struct {
		Dial           string  `json:"dial"`
		EjectedForMs   float64 `json:"ejected_for_ms"`
		EjectionReason string  `json:"ejection_reason"`
	} `json:"upstreams"`
}

// lbxUpstreams reads GET /lbx/upstreams from the test Caddy's admin API.
func lbxUpstreams(t *testing.T) upstreamsStatus {
	t.Helper()
	res, err := adminClient.Get(fmt.Sprintf("http://localhost:%d/lbx/upstreams", adminPort))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var rep upstreamsStatus
	if err := json.NewDecoder(res.Body).Decode(&rep); err != nil {
		t.Fatalf("decoding /lbx/upstreams: %v", err)
	}
	return rep
}

// TestOutlierEjectionInsidePartition: lb_policy least_time's outlier ejection
// works inside partition. One replica of a two-replica partition answers
// 503 at once; it is also the only replica of partition 1 of a
// 3-partition scheme. After two failed attempts in a row it is ejected
// (the admin API shows it); requests keep succeeding, retried on the
// other replica; and the 3-partition scheme, left without a usable
// replica for partition 1, gets no traffic while the 2-partition scheme
// has capacity. On a reload to the 3-partition scheme alone the ejection
// is still in force: no scheme has capacity, 503.
func TestOutlierEjectionInsidePartition(t *testing.T) {
	e := newEnv(t)
	good0, good1, x0, x2 := e.backend("good0"), e.backend("good1"), e.backend("x0"), e.backend("x2")
	bad := e.backend("bad")
	bad.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	opts := []string{
		"lb_policy ewma {\n\t\t\toutlier {\n\t\t\t\tconsecutive_failures 2\n\t\t\t\tbase_ejection_time 1m\n\t\t\t}\n\t\t}",
		"lb_retry_match {\n\t\t\texpression `{http.reverse_proxy.status_code} == 503`\n\t\t}",
	}
	e.load(partitionSite([]string{
		good0.addr + " 0/2", bad.addr + " 1/2", good1.addr + " 1/2",
		x0.addr + " 0/3", bad.addr + " 1/3", x2.addr + " 2/3",
	}, opts...))

	ejected := func() (float64, string) {
		for _, u := range lbxUpstreams(t).Upstreams {
			if u.Dial == bad.addr {
				return u.EjectedForMs, u.EjectionReason
			}
		}
		return 0, ""
	}
	sent := 0
	waitFor(t, 10*time.Second, "the 503 replica to be ejected", func() (bool, string) {
		res := e.get("/")
		sent++
		if res.status != http.StatusOK {
			t.Fatalf("request %d: status %d %q; requests must keep succeeding", sent, res.status, res.body)
		}
		ms, reason := ejected()
		return ms > 0, fmt.Sprintf("%d requests, bad: %d hits, ejected for %vms (%s)", sent, bad.hits.Load(), ms, reason)
	})
	ms, reason := ejected()
	t.Logf("ejected after %d requests and %d attempts on it, for %.0fms (%s)", sent, bad.hits.Load(), ms, reason)
	if reason != "consecutive_failures" || ms < 30e3 {
		t.Errorf("ejection %vms for %q; want about a minute for consecutive_failures", ms, reason)
	}

	const n = 100
	before := hits(good0, good1, x0, x2, bad)
	for i := range n {
		res := e.get("/")
		st := res.header.Get(StatusHeader)
		if res.status != http.StatusOK || strings.Contains(st, "failed") {
			t.Fatalf("request %d: status %d %q (%s)", i, res.status, res.body, st)
		}
		if strings.Contains(st, "p2=") {
			t.Fatalf("request %d went to the 3-partition scheme, whose p1 has no usable replica (%s)", i, st)
		}
		if !strings.Contains(res.body, `"p1":"good1"`) {
			t.Fatalf("request %d: p1 not answered by good1: %s", i, res.body)
		}
	}
	d := delta(before, hits(good0, good1, x0, x2, bad))
	t.Logf("after the ejection, %d requests: good0 %d, good1 %d, x0 %d, x2 %d, bad %d", n, d[0], d[1], d[2], d[3], d[4])
	if d[0] != n || d[1] != n || d[2] != 0 || d[3] != 0 || d[4] != 0 {
		t.Errorf("hits %v; want good0 and good1 %d each, the 3-partition scheme and the ejected replica none", d, n)
	}

	// The ejection is per address and survives a reload: with only the
	// 3-partition scheme left, nothing has capacity.
	e.load(partitionSite([]string{x0.addr + " 0/3", bad.addr + " 1/3", x2.addr + " 2/3"}, opts...))
	res := e.get("/")
	if want := "no partition scheme has capacity: 3 partitions: capacity 0 (no usable replica for p1 (1 ejected))\n"; res.status != http.StatusServiceUnavailable || res.body != want {
		t.Errorf("status %d body %q; want 503 %q", res.status, res.body, want)
	}
}
