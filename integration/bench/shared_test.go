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

func TestParseSharedFlags(t *testing.T) {
	c, err := parseSharedFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.variants) != 2 || c.variants[0].name != "sparse" || c.variants[0].nodes != 12 || c.variants[0].rate != 30 ||
		c.variants[1].name != "dense" || c.variants[1].nodes != 3 || c.variants[1].rate != 250 || !c.variants[1].notWorse {
		t.Errorf("default variants %+v", c.variants)
	}
	if c.reportBehind {
		t.Error("reports count what an answer leaves behind by default; the brief's count includes it")
	}
	if b, err := parseSharedFlags([]string{"-report-count", "behind"}, &bytes.Buffer{}); err != nil || !b.reportBehind {
		t.Errorf("-report-count behind: %v", err)
	}
	if c.seeds != 3 || len(c.policies) != 4 || c.antagonistLoad < 1 {
		t.Errorf("defaults: %d seeds, %d policies, antagonist load %v", c.seeds, len(c.policies), c.antagonistLoad)
	}
	if on, off := c.variants[1].onMin, c.variants[1].offMin; on != 5*time.Second || off != 5*time.Second || c.variants[1].onMax != on || c.variants[1].offMax != off {
		t.Errorf("dense antagonist %v on, %v off, want 5 s and 5 s", on, off)
	}
	if v := c.variants[0]; v.onMin != time.Second || v.onMax != 2*time.Second || v.offMin != time.Second || v.offMax != 3*time.Second {
		t.Errorf("sparse antagonist %+v, want 1–2 s on, 1–3 s off", v)
	}
	// A default run takes a few minutes, -quick under one.
	perCase := c.warmup + c.duration + sharedCaseOverheadGuess
	if d := time.Duration(len(c.variants)*c.seeds*len(c.policies)) * perCase; d > 7*time.Minute {
		t.Errorf("a default run takes about %v", d)
	}
	q, err := parseSharedFlags([]string{"-quick"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Duration(len(q.variants)*q.seeds*len(q.policies)) * (q.warmup + q.duration + sharedCaseOverheadGuess); d > time.Minute {
		t.Errorf("-quick takes about %v", d)
	}
	if q.variants[0].nodes != quickSharedNodes || q.seeds != 1 {
		t.Errorf("-quick: %d nodes, %d seeds", q.variants[0].nodes, q.seeds)
	}
	q, err = parseSharedFlags([]string{"-quick", "-nodes", "4", "-seeds", "2", "-variants", "dense", "-policies", "ewma_reports,least_conn"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(q.variants) != 1 || q.variants[0].name != "dense" || q.seeds != 2 {
		t.Errorf("explicit flags lost to -quick: %+v", q)
	}
	if len(q.policies) != 2 || q.policies[0].key != "least_conn" || q.policies[1].key != "ewma_reports" {
		t.Errorf("policies %v, want least_conn then ewma_reports, in the class's order", q.policies)
	}
	for _, bad := range [][]string{
		{"-nodes", "0"}, {"-nodes", "65"}, {"-rate", "0"}, {"-dense-rate", "-1"}, {"-seeds", "0"},
		{"-duration", "500ms"}, {"-warmup", "-1s"}, {"-antagonist-load", "0"}, {"-antagonist-load", "NaN"},
		{"-variants", "medium"}, {"-variants", ","}, {"-report-count", "some"}, {"-policies", "round_robin"}, {"-policies", ""}, {"extra"},
	} {
		_, err := parseSharedFlags(bad, &bytes.Buffer{})
		if err == nil {
			t.Errorf("%q accepted", bad)
			continue
		}
		if name := strings.TrimLeft(bad[0], "-"); strings.HasPrefix(bad[0], "-") && !strings.Contains(err.Error(), name) {
			t.Errorf("%q: error %q does not name the flag", bad, err)
		}
	}
}

// TestSharedPolicies checks the contenders: stock least_conn and lb_policy
// ewma with no options, reports on where they should be, the probing slot
// skipped, and every runnable one's Caddyfile adapting.
func TestSharedPolicies(t *testing.T) {
	upstreams := []string{"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"}
	for _, p := range sharedPolicies {
		if p.skip != "" {
			t.Errorf("%s is skipped: %s", p.key, p.skip)
		}
		if p.reports != (p.key != "ewma_noreports") || p.target != (p.key == "ewma_reports" || p.key == "ewma_probing") {
			t.Errorf("%s: reports %v, target %v", p.key, p.reports, p.target)
		}
		dir := t.TempDir()
		c, err := newProxyConfig(p.policy, dir, upstreams, proxyOptions{})
		if err != nil {
			t.Fatal(err)
		}
		c.Port, c.AdminPort = 18080, 12019
		path := filepath.Join(dir, "Caddyfile")
		if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
			t.Fatal(err)
		}
		body, _ := os.ReadFile(path)
		// Defaults are the product: a bare lb_policy, or probing's path
		// alone.
		want := "lb_policy " + p.caddyPolicy + "\n"
		if p.key == "ewma_probing" {
			want = "lb_policy ewma {\n\t\t\tload_reports {\n\t\t\t\tprobe /load\n\t\t\t}\n\t\t}\n"
		}
		if !strings.Contains(string(body), want) {
			t.Errorf("%s: want %q in\n%s", p.key, want, body)
		}
		js, warn, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, nil)
		if err != nil || len(warn) > 0 {
			t.Errorf("%s: adapt: %v %v\n%s", p.key, err, warn, body)
		}
		if probes := strings.Contains(string(js), `"probe":{"path":"/load"`); probes != (p.key == "ewma_probing") {
			t.Errorf("%s: probes %v in %s", p.key, probes, js)
		}
	}
	if len(sharedPolicies) != 4 {
		t.Errorf("%d policies, want least_conn, and ewma silent, reporting and probing", len(sharedPolicies))
	}
}

func sharedRowOf(key string, p99 float64) sharedRow {
	i := 0
	for sharedPolicies[i].key != key {
		i++
	}
	p := sharedPolicies[i]
	r := sharedRow{scenRow: synthRowFor(p.policy, 5, p99, 0), Reports: p.reports, Target: p.target, HeldReports: -1}
	return r
}

// synthRowFor is synthRow for a policy that is not in allPolicies.
func synthRowFor(p policy, p50, p99, errPct float64) scenRow {
	r := scenRow{row: row{Policy: p.key, Label: p.label}}
	r.P50, r.P99, r.P999, r.ErrorPct = statOf([]float64{p50}), statOf([]float64{p99}), statOf([]float64{p99}), statOf([]float64{errPct})
	return r
}

func TestSharedVerdicts(t *testing.T) {
	rows := []sharedRow{sharedRowOf("least_conn", 80), sharedRowOf("ewma_noreports", 40), sharedRowOf("ewma_reports", 20)}
	vs := sharedVerdicts(false, rows)
	if len(vs) != 1 || !vs[0].Evaluated || !vs[0].Pass || !near(vs[0].Limit, 20) || !strings.Contains(vs[0].Detail, "backends silent") {
		t.Errorf("sparse, 20 ms against half of 40 ms: %+v", vs)
	}
	rows[2].P99 = statOf([]float64{20.5})
	if vs := sharedVerdicts(false, rows); vs[0].Pass {
		t.Errorf("sparse, 20.5 ms against half of 40 ms passed: %+v", vs)
	}
	// Dense: not worse than ewma without reports, within max(1.1 ×, + 2 ms).
	rows[2].P99 = statOf([]float64{41.9})
	if vs := sharedVerdicts(true, rows); len(vs) != 1 || !vs[0].Pass || !near(vs[0].Limit, 44) {
		t.Errorf("dense, 41.9 ms against 40 ms: %+v", vs)
	}
	rows[2].P99 = statOf([]float64{45})
	if vs := sharedVerdicts(true, rows); vs[0].Pass {
		t.Errorf("dense, 45 ms against 40 ms passed: %+v", vs)
	}
	if vs := sharedVerdicts(true, []sharedRow{rows[0], rows[2]}); vs[0].Evaluated {
		t.Errorf("dense without ewma_noreports evaluated: %+v", vs)
	}
	if vs := sharedVerdicts(false, rows[2:]); vs[0].Evaluated {
		t.Errorf("sparse with nothing to compare against evaluated: %+v", vs)
	}
	if vs := sharedVerdicts(false, rows[:2]); len(vs) != 0 {
		t.Errorf("verdicts without a target: %+v", vs)
	}
}

func TestHeldReports(t *testing.T) {
	for _, c := range []struct {
		state string
		want  int
	}{
		{`{"upstreams":[{"dial":"a","load_report":{"utilization":1}},{"dial":"b"},{"dial":"c","load_report":null}]}`, 1},
		{`{"upstreams":[]}`, 0},
		{`{"total":0}`, -1},
		{`garbage`, -1},
		{``, -1},
	} {
		if got := heldReports(json.RawMessage(c.state)); got != c.want {
			t.Errorf("heldReports(%s) = %d, want %d", c.state, got, c.want)
		}
	}
}

// cannedShared returns a case of policy key in seed with the given p99
// (ms) and per-backend arrivals and utilizations.
func cannedShared(v, key string, seed int, p99 float64, arrivals []int64, util []float64) sharedCase {
	c := sharedCase{caseResult: caseResult{Scenario: v, Policy: key, Seed: seed}, Nodes: 12, HeldReports: -1}
	c.Summary = loadmodel.Summary{Requests: 1000, OK: 999, Errors: 1, P50: 5 * time.Millisecond,
		P99: time.Duration(p99 * float64(time.Millisecond)), P999: time.Duration(2 * p99 * float64(time.Millisecond))}
	for i := range arrivals {
		c.Backends = append(c.Backends, backendResult{Name: "b" + string(rune('1'+i)), Counters: loadmodel.Counters{Arrivals: arrivals[i]}, Utilization: util[i]})
	}
	c.Antagonist.P99 = 300 * time.Millisecond
	if key != "least_conn" {
		c.HeldReports = 0
		if key == "ewma_reports" {
			c.HeldReports = 4
		}
	}
	return c
}

// TestSharedMarkdown renders the report of canned results.
func TestSharedMarkdown(t *testing.T) {
	cfg, err := parseSharedFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	pols := sharedPolicies[:3]
	var cases []sharedCase
	for seed := 1; seed <= 3; seed++ {
		s := float64(seed)
		cases = append(cases,
			cannedShared("sparse", "least_conn", seed, 200+s, []int64{250, 250, 250, 250}, []float64{0.2, 0.2, 0.6, 0.4}),
			cannedShared("sparse", "ewma_noreports", seed, 90+s, []int64{300, 300, 100, 300}, []float64{0.25, 0.25, 0.55, 0.45}),
			cannedShared("sparse", "ewma_reports", seed, 40+s, []int64{350, 350, 20, 280}, []float64{0.3, 0.3, 0.5, 0.4}))
	}
	sum := summarizeShared(cfg.variants[0], cfg, pols, cases)
	if len(sum.Rows) != 3 || sum.Rows[2].P99.Median != 42 || sum.Rows[2].P99.Min != 41 || sum.Rows[2].P99.Max != 43 {
		t.Fatalf("rows %+v", sum.Rows)
	}
	if sum.Rows[2].HeldReports != 4 || sum.Rows[0].HeldReports != -1 {
		t.Errorf("held reports %d and %d", sum.Rows[2].HeldReports, sum.Rows[0].HeldReports)
	}
	if got := sum.Rows[2].Share["b3"]; math.Abs(got-20.0/1000) > 1e-9 {
		t.Errorf("ewma_reports' share to b3 %v, want 2%%", got)
	}
	if len(sum.Verdicts) != 1 || !sum.Verdicts[0].Pass {
		t.Errorf("42 ms against half of 92 ms: %+v", sum.Verdicts)
	}
	rep := &sharedReport{Command: "go run ./bench shared", Source: "test", Seeds: 3, FirstSeed: 1, Versions: map[string]string{"go": "go1.26"},
		Notes: []string{"lbx ewma, probing skipped: not built yet"}, Variants: []sharedSummary{sum}, Cases: cases}
	var out bytes.Buffer
	if err := rep.writeMarkdown(&out); err != nil {
		t.Fatal(err)
	}
	md := out.String()
	for _, want := range []string{
		"Command: `go run ./bench shared`",
		"Note: lbx ewma, probing skipped: not built yet.",
		"| sparse | lbx ewma, backends report | 5.00 ms | 42.0 ms |",
		"- sparse: PASS lbx ewma, backends report: p99 ≤ best other ÷ 2: 42.0 ms ≤ 46.0 ms (best other: lbx ewma, backends silent 92.0 ms)",
		"## sparse — 12 nodes at 30 req/s each",
		"12 nodes × 30 req/s = 360 req/s",
		"| lbx ewma, backends report | yes | 5.00 ms | 42.0 ms [41.0–43.0 ms] |",
		"| 4 of 4 |", "| 0 of 4 |",
		"| policy | b1 | b2 | b3 (antagonist's) | b4 (1 worker) |",
		"| lbx ewma, backends report | 35.0% · 0 · 30% | 35.0% · 0 · 30% | 2.0% · 0 · 50% | 28.0% · 0 · 40% |",
		"| 0.1%, 0.1% |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Log("\n" + md)
	}
}

// TestSharedSmall runs `bench shared` end to end with 2 nodes, the
// reporting policy only and a short window: it checks that the class
// works and that the backends' reports reach lbx, never how fast
// anything was.
func TestSharedSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy proxies and runs load for a few seconds")
	}
	bin := testCaddy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := runShared(ctx, []string{"-caddy", bin, "-nodes", "2", "-rate", "20", "-variants", "sparse", "-policies", "ewma_probing,ewma_reports",
		"-seeds", "1", "-warmup", "500ms", "-duration", "1s", "-antagonist-load", "0.5"}, "go test ./integration/bench", &out, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	if len(rep.Cases) != 2 || len(rep.Variants) != 1 || len(rep.Variants[0].Rows) != 2 {
		t.Fatalf("%d cases, %d variants", len(rep.Cases), len(rep.Variants))
	}
	for _, c := range rep.Cases {
		if c.Summary.Requests != 40 || c.Summary.Errors != 0 {
			t.Errorf("%s: summary %+v, want 40 requests (2 nodes × 20 req/s × 1 s), no errors", c.Policy, c.Summary)
		}
		if c.HeldReports != 4 {
			t.Errorf("%s: node 1 held reports for %d of 4 upstreams", c.Policy, c.HeldReports)
		}
		if probed := c.Probes > 0; probed != (c.Policy == "ewma_probing") {
			t.Errorf("%s: the backends answered %d load probes", c.Policy, c.Probes)
		}
	}
}
