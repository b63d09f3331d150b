package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// TestHedgeFormsConfig checks that the hedge class's forms adapt to what
// they claim: a selective with one or two groups, no lb_policy and no
// backup_budget in them (the defaults), and the backup_request given.
// The `auto` forms are only logged when this build rejects them.
func TestHedgeFormsConfig(t *testing.T) {
	upstreams := []string{"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"}
	for _, pol := range hedgeForms() {
		dir := t.TempDir()
		c, err := newProxyConfig(pol, dir, upstreams, proxyOptions{Backup: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		c.Port, c.AdminPort = 18080, 12019
		path := filepath.Join(dir, "Caddyfile")
		if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
			t.Fatal(err)
		}
		body, _ := os.ReadFile(path)
		js, warn, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, nil)
		if pol.backupAuto && err != nil {
			t.Logf("%s: not supported by this build: %v", pol.key, err)
			continue
		}
		if err != nil || len(warn) > 0 {
			t.Errorf("%s: adapt: %v %v\n%s", pol.key, err, warn, body)
			continue
		}
		s := string(js)
		if strings.Contains(s, "selection_policy") || strings.Contains(s, "backup_budget") {
			t.Errorf("%s: want no lb_policy and no backup_budget (defaults only):\n%s", pol.key, s)
		}
		if !pol.backupAuto && !strings.Contains(s, `"backup_request":10000000`) {
			t.Errorf("%s: no backup_request of 10ms in %s", pol.key, s)
		}
		var cfg struct {
			Apps struct {
				HTTP struct {
					Servers map[string]struct {
						Routes []struct {
							Handle []struct {
								Handler string            `json:"handler"`
								Groups  []json.RawMessage `json:"groups"`
							} `json:"handle"`
						} `json:"routes"`
					} `json:"servers"`
				} `json:"http"`
			} `json:"apps"`
		}
		if err := json.Unmarshal(js, &cfg); err != nil {
			t.Fatal(err)
		}
		groups := -1
		for _, srv := range cfg.Apps.HTTP.Servers {
			for _, r := range srv.Routes {
				for _, h := range r.Handle {
					if h.Handler == "selective" {
						groups = len(h.Groups)
					}
				}
			}
		}
		if want := max(1, pol.groups); groups != want {
			t.Errorf("%s: %d selective groups, want %d:\n%s", pol.key, groups, want, s)
		}
	}
	if got := splitGroups(upstreams[:3], 2); len(got) != 2 || len(got[0].Upstream)+len(got[1].Upstream) != 3 {
		t.Errorf("splitGroups of 3 into 2: %+v", got)
	}
}

// TestHedgeVariantPolicies checks which policies the hedge class runs:
// the unhedged baselines of the run, then its forms, without the `auto`
// ones when the build rejects them.
func TestHedgeVariantPolicies(t *testing.T) {
	var hedge variant
	for _, v := range buildVariants(defaultScenDuration) {
		if v.name == "hedge-all-freeze" {
			hedge = v
		}
	}
	if hedge.name == "" {
		t.Fatal("no hedge-all-freeze variant")
	}
	keys := func(ps []policy) string {
		var k []string
		for _, p := range ps {
			k = append(k, p.key)
		}
		return strings.Join(k, ",")
	}
	if got, want := keys(variantPolicies(hedge, allPolicies, true)), "ewma,least_conn,nginx,haproxy,sel2_backup,sel1_backup,sel2_auto,sel1_auto"; got != want {
		t.Errorf("policies %s, want %s", got, want)
	}
	if got, want := keys(variantPolicies(hedge, allPolicies, false)), "ewma,least_conn,nginx,haproxy,sel2_backup,sel1_backup"; got != want {
		t.Errorf("without auto: policies %s, want %s", got, want)
	}
	for _, m := range hedge.models {
		if m.Service != 2*time.Millisecond || m.Workers != 1 || m.Freeze.Every == 0 {
			t.Errorf("hedge-all-freeze backend %+v, want 1 worker of 2 ms that freezes", m)
		}
	}
	cfg, err := parseScenarioFlags([]string{"-classes", "hedge", "-hedge-backup", "7ms"}, &strings.Builder{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.variants) != 2 || cfg.variants[0].caseSpec(cfg).proxy.Backup != 7*time.Millisecond {
		t.Errorf("-classes hedge -hedge-backup 7ms: %d variants, backup %v", len(cfg.variants), cfg.variants[0].caseSpec(cfg).proxy.Backup)
	}
	if _, err := parseScenarioFlags([]string{"-hedge-backup", "0s"}, &strings.Builder{}); err == nil {
		t.Error("-hedge-backup 0s was accepted")
	}
}

// fakeRow builds a scenRow with one seed of each metric.
func fakeRow(key, label string, p99, p999, extra, share, errPct float64) scenRow {
	one := func(x float64) stat { return statOf([]float64{x}) }
	r := scenRow{P99: one(p99), P999: one(p999), ErrorPct: one(errPct)}
	r.Policy, r.Label = key, label
	e, s := one(extra), one(share)
	r.ExtraPct, r.MarkedShare = &e, &s
	return r
}

// TestHedgeVerdicts checks the hedge criteria on made-up rows: a cut of
// the p99.9 by 2× against the best unhedged, p99 within 1.1× + 1 ms of
// the best unhedged p99, extra requests within the budget.
func TestHedgeVerdicts(t *testing.T) {
	pols := append(append([]policy{}, allPolicies...), hedgeForms()...)
	rows := []scenRow{
		fakeRow("ewma", "lbx ewma", 6, 54, 0, 0, 0),
		fakeRow("least_conn", "Caddy least_conn", 5, 60, 0, 0, 0), // best p99, not best p99.9
		fakeRow("sel2_backup", "two", 6.4, 27, 1.5, 0, 0),         // passes all: 27 ≤ 27, 6.4 ≤ 6.5, 1.5 ≤ 10
		fakeRow("sel1_backup", "one", 44, 74, 0.6, 0, 0),          // the one group: fails the tails
		fakeRow("sel2_auto", "auto", 6, 20, 12, 0, 0),             // over the budget
	}
	got := map[string]bool{}
	for _, v := range hedgeVerdicts(rows, pols, 10) {
		if !v.Evaluated {
			t.Errorf("not evaluated: %v", v)
		}
		got[v.Name] = v.Pass
	}
	want := map[string]bool{
		"two: p99.9 ≤ best unhedged ÷ 2":         true,
		"two: p99 ≤ 1.1 × best unhedged + 1 ms":  true,
		"two: extra requests ≤ budget":           true,
		"one: p99.9 ≤ best unhedged ÷ 2":         false,
		"one: p99 ≤ 1.1 × best unhedged + 1 ms":  false,
		"one: extra requests ≤ budget":           true,
		"auto: p99.9 ≤ best unhedged ÷ 2":        true,
		"auto: p99 ≤ 1.1 × best unhedged + 1 ms": true,
		"auto: extra requests ≤ budget":          false,
		"two: 0 errors in every seed":            true,
		"one: 0 errors in every seed":            true,
		"auto: 0 errors in every seed":           true,
	}
	if len(got) != len(want) {
		t.Errorf("%d verdicts, want %d: %v", len(got), len(want), got)
	}
	for k, w := range want {
		if g, ok := got[k]; !ok || g != w {
			t.Errorf("%s: pass %v (present %v), want %v", k, g, ok, w)
		}
	}
	if vs := hedgeVerdicts(rows[2:3], pols, 10); len(vs) != 1 || vs[0].Evaluated {
		t.Errorf("without unhedged rows: %v, want one verdict not evaluated", vs)
	}
}

// TestPartialVerdicts checks the success-weighted fair share and the
// partial-failure criteria on made-up rows: the ewma (45.5% to
// the flaky one, 9.1% errors at f = 20%) fails both.
func TestPartialVerdicts(t *testing.T) {
	var v variant
	for _, x := range buildVariants(defaultScenDuration) {
		if x.name == "partialfail-20-retries" {
			v = x
		}
	}
	if v.name == "" || v.concurrency != partialClients || v.models[2].FailRate != 0.2 {
		t.Fatalf("partialfail-20-retries: %+v", v)
	}
	// Capacities 250, 20 and 250 × 0.8 req/s: 200 ÷ 470.
	if got, want := fairShare(v.models, 2), 200.0/470; math.Abs(got-want) > 1e-9 {
		t.Errorf("fair share %v, want %v", got, want)
	}
	if got := fairShare([]loadmodel.Model{{Workers: 1, Service: time.Millisecond}, {Workers: 1, Service: time.Millisecond, Fail: loadmodel.Fail503}}, 1); got != 0 {
		t.Errorf("fair share of a black hole %v, want 0", got)
	}
	rows := []scenRow{
		fakeRow("ewma", "lbx ewma", 0, 0, 0, 45.5, 9.1),
		fakeRow("least_conn", "Caddy least_conn", 0, 0, 0, 30, 0),
	}
	got := map[string]verdict{}
	for _, x := range partialVerdicts(v.kind, rows, v.models, v.marked) {
		got[x.Name] = x
	}
	check := func(name string, pass bool) {
		t.Helper()
		x, ok := got[name]
		if !ok || !x.Evaluated || x.Pass != pass {
			t.Errorf("%s: %+v, want evaluated, pass %v", name, x, pass)
		}
	}
	check("lbx ewma: share to the flaky backend ≤ its success-weighted fair share", false)
	check("lbx ewma: client errors ≤ fair share × failure rate", false) // 9.1 > 42.55 × 0.2
	check("lbx ewma: 0 client errors in every seed", false)
	check("Caddy least_conn: share to the flaky backend ≤ its success-weighted fair share", true)
	check("Caddy least_conn: client errors ≤ fair share × failure rate", true)
	check("Caddy least_conn: 0 client errors in every seed", true)
	if len(got) != 6 {
		t.Errorf("%d verdicts, want 6", len(got))
	}
	if vs := partialVerdicts(targetsPartial, rows, v.models, v.marked); len(vs) != 4 {
		t.Errorf("without retries: %d verdicts, want 4 (no 0-errors criterion)", len(vs))
	}
}

// TestPoolCostNamingFile checks the naming file of `bench poolcost`: n
// lines of distinct addresses, the live ones one per partition of a
// 3-partition scheme, the rest in the 2-partition scheme that has no
// partition 1.
func TestPoolCostNamingFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "server_list")
	live := []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
	const n = 70_000 // past 65,536, where the address's second byte turns
	if err := writeNamingFile(path, n, live); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	tags := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 || seen[f[0]] {
			t.Fatalf("bad or repeated line %q", line)
		}
		seen[f[0]] = true
		tags[f[1]]++
	}
	if len(seen) != n || tags["0/3"] != 1 || tags["1/3"] != 1 || tags["2/3"] != 1 || tags["0/2"] != n-3 || tags["1/2"] != 0 {
		t.Errorf("%d replicas, tags %v; want %d, one per partition of 3, the rest 0/2", len(seen), tags, n)
	}
}

// TestPoolCostFlagsAndVerdicts checks the flags' bounds and the criteria
// on made-up results: flat p50, slow /metrics and RSS that stays up.
func TestPoolCostFlagsAndVerdicts(t *testing.T) {
	for _, bad := range [][]string{{"-sizes", "2"}, {"-sizes", "x"}, {"-rates", "0"}, {"-rates", ""}, {"-duration", "10ms"}, {"-admin-timeout", "0s"}} {
		if _, err := parsePoolCostFlags(bad, &strings.Builder{}); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	c, err := parsePoolCostFlags(nil, &strings.Builder{})
	if err != nil || len(c.sizes) != 4 || c.sizes[3] != 200_000 || len(c.rates) != 2 {
		t.Fatalf("defaults: %+v, %v", c, err)
	}
	ok := func(p string, d time.Duration) adminTiming {
		return adminTiming{Path: p, Took: d, Status: 200, Bytes: 100}
	}
	r := &poolCostResult{
		RSSStart: 40 << 20, RSSAfter: 100 << 20,
		Sizes: []poolCostSize{
			{Size: 3, Rates: []poolCostRate{{Rate: 100, P50: 1400 * time.Microsecond}}},
			{Size: 200_000, Rates: []poolCostRate{{Rate: 100, P50: 2 * time.Millisecond}},
				Admin: []adminTiming{ok("/lbx/upstreams", 300*time.Millisecond), {Path: "/metrics", Took: 10 * time.Second, TimedOut: true}}},
		},
	}
	got := map[string]bool{}
	for _, v := range r.verdicts() {
		got[v.Name] = v.Evaluated && v.Pass
	}
	want := map[string]bool{
		"p50 at 200000 replicas ≤ 2 × at 3, 100 req/s": true,
		"errors at 200000 replicas, 100 req/s":         true,
		"GET /lbx/upstreams at 200000 replicas < 1 s":  true,
		"GET /metrics at 200000 replicas < 1 s":        false,
		"RSS after shrinking ≤ 1.5 × at the start":     false,
	}
	if len(got) != len(want) {
		t.Errorf("verdicts %v", got)
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s: pass %v, want %v", k, got[k], w)
		}
	}
	if !strings.Contains(r.markdown(), "> 10s (timeout)") {
		t.Errorf("markdown lacks the timeout:\n%s", r.markdown())
	}
}

// TestPoolcostRun runs `bench poolcost` end to end at tiny sizes: it
// checks that a naming-file version is seen applied (Caddy's log line),
// that every size and view is measured and the criteria printed, never how
// fast anything was. It starts Caddy, so -short skips it (and its name
// keeps it out of the quick -run 'PoolCost' selection).
func TestPoolcostRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and runs load")
	}
	bin := testCaddy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := runPoolCost(ctx, []string{"-caddy", bin, "-sizes", "3,40", "-rates", "50", "-warmup", "0s", "-duration", "1s", "-apply-timeout", "30s"},
		"go test", &out, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	for _, want := range []string{"| 3 |", "| 40 |", "GET /metrics at 40 replicas < 1 s", "RSS after shrinking", "applied in"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}
