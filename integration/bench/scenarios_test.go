package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-lbx/lbx"
	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// The Caddy binary the end-to-end tests share, built once.
var (
	caddyOnce sync.Once
	caddyBin  string
	caddyErr  error
	caddyDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if caddyDir != "" {
		os.RemoveAll(caddyDir)
	}
	os.Exit(code)
}

// testCaddy builds ./cmd/caddy once for the tests of this package.
func testCaddy(t *testing.T) string {
	t.Helper()
	caddyOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if caddyDir, caddyErr = os.MkdirTemp("", "lbx-bench-test-"); caddyErr != nil {
			return
		}
		var root string
		if root, caddyErr = moduleRoot(ctx); caddyErr != nil {
			return
		}
		caddyBin, caddyErr = buildCaddy(ctx, root, caddyDir, &bytes.Buffer{})
	})
	if caddyErr != nil {
		t.Fatal(caddyErr)
	}
	return caddyBin
}

// row builds a synthetic aggregate with the given medians (ms, %).
func synthRow(key string, p50, p99, errPct float64, share ...float64) scenRow {
	p, _ := policyByKey(key)
	r := scenRow{row: row{Policy: key, Label: p.label}}
	r.P50 = statOf([]float64{p50})
	r.P99 = statOf([]float64{p99})
	r.ErrorPct = statOf([]float64{errPct})
	if len(share) > 0 {
		s := statOf(share)
		r.MarkedShare = &s
	}
	return r
}

func verdictByName(t *testing.T, vs []verdict, prefix string) verdict {
	t.Helper()
	for _, v := range vs {
		if strings.HasPrefix(v.Name, prefix) {
			return v
		}
	}
	t.Fatalf("no verdict %q in %+v", prefix, vs)
	return verdict{}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestP99Limit(t *testing.T) {
	for _, c := range []struct{ best, want float64 }{
		{5, 7},     // best + 2 ms wins below 20 ms
		{20, 22},   // both equal
		{30, 33},   // 1.1 × best wins above 20 ms
		{0.5, 2.5}, //
	} {
		if got := p99Limit(c.best); !near(got, c.want) {
			t.Errorf("p99Limit(%v) = %v, want %v", c.best, got, c.want)
		}
	}
}

func TestVerdictsPlain(t *testing.T) {
	rows := []scenRow{
		synthRow("ewma", 5.2, 16.9, 0),
		synthRow("round_robin", 5, 9, 0), // lower, but not a least-connections policy
		synthRow("least_conn", 5, 20, 0),
		synthRow("nginx", 4, 15, 0),
		synthRow("haproxy", 6, 25, 0),
	}
	vs := verdicts(targetsPlain, nil, rows)
	if len(vs) != 3 {
		t.Fatalf("%d verdicts, want p99, p50, errors: %+v", len(vs), vs)
	}
	p99 := verdictByName(t, vs, "p99 ≤ max")
	if !p99.Evaluated || !p99.Pass || !near(p99.Limit, 17) || !strings.Contains(p99.Detail, "nginx least_conn") {
		t.Errorf("p99 verdict %+v, want a pass against nginx's 15 ms + 2 = 17 ms", p99)
	}
	p50 := verdictByName(t, vs, "p50")
	if !p50.Pass || !near(p50.Limit, 5.25) {
		t.Errorf("p50 verdict %+v, want 5.2 ≤ 1.05 × 5", p50)
	}
	if e := verdictByName(t, vs, "0 errors"); !e.Pass {
		t.Errorf("errors verdict %+v", e)
	}

	rows[0] = synthRow("ewma", 5.3, 17.1, 0.05)
	vs = verdicts(targetsPlain, nil, rows)
	for _, name := range []string{"p99 ≤ max", "p50", "0 errors"} {
		if v := verdictByName(t, vs, name); !v.Evaluated || v.Pass {
			t.Errorf("%s: %+v, want a miss", name, v)
		}
	}
	if s := verdictByName(t, vs, "p99 ≤ max").String(); !strings.HasPrefix(s, "MISS") || !strings.Contains(s, "17.1 ms ≤ 17.0 ms") {
		t.Errorf("rendered %q", s)
	}

	// Only the policies that ran count; without any, no verdict.
	vs = verdicts(targetsPlain, nil, []scenRow{synthRow("ewma", 5, 40, 0), synthRow("haproxy", 5, 30, 0)})
	if v := verdictByName(t, vs, "p99 ≤ max"); v.Pass || !v.Evaluated || !near(v.Limit, 33) {
		t.Errorf("p99 against HAProxy alone: %+v, want a miss against 33 ms", v)
	}
	if v := verdictByName(t, vs, "p50"); v.Evaluated {
		t.Errorf("p50 without least_conn evaluated: %+v", v)
	}
	vs = verdicts(targetsPlain, nil, []scenRow{synthRow("ewma", 5, 40, 0), synthRow("round_robin", 5, 30, 0)})
	if v := verdictByName(t, vs, "p99 ≤ max"); v.Evaluated || !strings.HasPrefix(v.String(), "n/a") {
		t.Errorf("p99 without least-connections policies: %+v", v)
	}
	if vs := verdicts(targetsPlain, nil, []scenRow{synthRow("least_conn", 5, 5, 0)}); vs != nil {
		t.Errorf("verdicts without ewma: %+v", vs)
	}
}

func TestVerdictsDegraded(t *testing.T) {
	rows := []scenRow{
		synthRow("ewma", 3, 3, 0),
		synthRow("round_robin", 5, 9.3, 0), // the best stock policy here
		synthRow("least_conn", 5, 20, 0),
		synthRow("random_choose_2", 5, 12, 0),
		synthRow("direct", 3, 1.4, 0),
	}
	vs := verdicts(targetsDegraded, nil, rows)
	third := verdictByName(t, vs, "p99 ≤ best stock ÷ 3")
	if !third.Pass || !near(third.Limit, 3.1) || !strings.Contains(third.Detail, "round_robin") {
		t.Errorf("÷3 verdict %+v, want 3 ≤ 9.3 / 3 against round_robin", third)
	}
	direct := verdictByName(t, vs, "p99 ≤ 2 × direct")
	if direct.Pass || !near(direct.Limit, 2.8) {
		t.Errorf("direct verdict %+v, want a miss: 3 > 2 × 1.4", direct)
	}
	rows = rows[:4]
	if v := verdictByName(t, verdicts(targetsDegraded, nil, rows), "p99 ≤ 2 × direct"); v.Evaluated {
		t.Errorf("direct verdict without direct: %+v", v)
	}
}

func TestVerdictsFastFail(t *testing.T) {
	lc := synthRow("least_conn", 5, 8, 30, 30)
	for _, c := range []struct {
		kind              verdictKind
		errPct, share     float64
		wantErr, wantShar bool
	}{
		{targetsFastFail, 2, 1.9, true, true},
		{targetsFastFail, 2.1, 2, false, false}, // share must be strictly below 2%
		{targetsFastFailRetries, 0, 0.5, true, true},
		{targetsFastFailRetries, 0.02, 0.5, false, true},
	} {
		vs := verdicts(c.kind, nil, []scenRow{synthRow("ewma", 5, 8, c.errPct, c.share), lc})
		for _, v := range vs {
			if v.Name == "0 errors" {
				t.Errorf("fast-failure variant judged by 0 errors: %+v", vs)
			}
		}
		errName := "client errors ≤ 2%"
		if c.kind == targetsFastFailRetries {
			errName = "0 client errors"
		}
		if v := verdictByName(t, vs, errName); v.Pass != c.wantErr {
			t.Errorf("%+v: %+v", c, v)
		}
		if v := verdictByName(t, vs, "share to the failing backend"); v.Pass != c.wantShar {
			t.Errorf("%+v: %+v", c, v)
		}
	}
}

func TestVerdictsWindow(t *testing.T) {
	e, lc := synthRow("ewma", 5, 8, 0), synthRow("least_conn", 5, 8, 0)
	e.Windows = map[string]stat{"step": statOf([]float64{30})}
	lc.Windows = map[string]stat{"step": statOf([]float64{20})}
	vs := verdicts(targetsPlain, []window{{name: "step"}}, []scenRow{e, lc})
	if v := verdictByName(t, vs, "p99 within the step"); !v.Evaluated || v.Pass || !near(v.Limit, 22) {
		t.Errorf("step verdict %+v, want 30 > 22", v)
	}
}

func TestStatOf(t *testing.T) {
	s := statOf([]float64{4, math.NaN(), 1, 3, 2})
	if s.N != 4 || s.Median != 2.5 || s.Min != 1 || s.Max != 4 {
		t.Errorf("statOf = %+v", s)
	}
	if s := statOf([]float64{math.NaN()}); s.N != 0 || !math.IsNaN(s.Median) {
		t.Errorf("statOf(NaN) = %+v", s)
	}
	if got := fmtStat(statOf([]float64{2, 1, 3}), fmtMs); got != "2.00 ms [1.00–3.00 ms]" {
		t.Errorf("fmtStat = %q", got)
	}
	b, err := json.Marshal(statOf([]float64{math.Inf(1)}))
	if err != nil || !strings.Contains(string(b), `"median":null`) {
		t.Errorf("json of an infinite stat: %s, %v", b, err)
	}
}

func TestRecoveryOf(t *testing.T) {
	// Four backends, 40 buckets; the last recovers at bucket 10 and gets
	// nothing for 500 ms, then a fair quarter.
	bs := make([][]int64, 4)
	for b := range bs {
		bs[b] = make([]int64, 40)
		for k := range bs[b] {
			bs[b][k] = 10
			if b == 3 && k < 15 {
				bs[b][k] = 0
			}
		}
	}
	r := recoveryOf(bs, 3, 10, 40)
	// First second: 5 buckets of 0 and 5 of 10, against 30 a bucket from
	// the others.
	if want := 50.0 / 350; !near(r.First, want) {
		t.Errorf("first share %v, want %v", r.First, want)
	}
	if !near(r.Next, 0.25) {
		t.Errorf("next share %v, want 0.25", r.Next)
	}
	// 80% of a fair quarter over 3 buckets: [14, 17) has 20 of 110 (18%),
	// [15, 18) 30 of 120 (25%).
	if r.Regain != 500 {
		t.Errorf("regain %v ms, want 500", r.Regain)
	}
	if r.Available != 3000 {
		t.Errorf("available %v ms", r.Available)
	}
	// Never regained; a window that ends early.
	for k := range bs[3] {
		bs[3][k] = 0
	}
	if r := recoveryOf(bs, 3, 10, 25); !math.IsNaN(r.Regain) || r.First != 0 || !math.IsNaN(recoveryOf(bs, 3, 30, 25).First) {
		t.Errorf("never regained: %+v", r)
	}
}

func TestParseScenarioFlags(t *testing.T) {
	c, err := parseScenarioFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.variants) != 24 || c.seeds != 3 || c.warmup != 2*time.Second || c.duration != 6*time.Second || len(c.policies) != len(allPolicies) {
		t.Errorf("defaults: %d variants, %d seeds, %v, %v, %d policies", len(c.variants), c.seeds, c.warmup, c.duration, len(c.policies))
	}
	names := func(c *scenConfig) string {
		var n []string
		for _, v := range c.variants {
			n = append(n, v.name)
		}
		return strings.Join(n, ",")
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-classes", "mixed"}, "mixed-2to1,mixed-2to1-weighted,mixed-4to1,mixed-4to1-weighted"},
		{[]string{"-classes", "stalls-short, Degraded"}, "stalls-short,degraded-1of4,degraded-2of4"},
		{[]string{"-classes", "dynamics,recovery"}, "loadstep,recovery"},
		{[]string{"-quick"}, strings.Join(quickVariants, ",")},
		{[]string{"-quick", "-classes", "fastfail"}, "fastfail-503,fastfail-503-retries,fastfail-reset,fastfail-reset-retries"},
	} {
		c, err := parseScenarioFlags(tc.args, &bytes.Buffer{})
		if err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		if got := names(c); got != tc.want {
			t.Errorf("%q: variants %s, want %s", tc.args, got, tc.want)
		}
	}
	c, err = parseScenarioFlags([]string{"-quick", "-seeds", "2", "-policies", "ewma,nginx_least_conn"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if c.seeds != 2 || c.duration != 2*time.Second || c.warmup != 500*time.Millisecond || len(c.policies) != 2 || c.policies[1].key != "nginx" {
		t.Errorf("quick with explicit flags: %+v", c)
	}
	refusesAll(t, "parseScenarioFlags", parseScenarioFlags, [][]string{
		{"-classes", "stall"},
		{"-classes", ","},
		{"-seeds", "0"},
		{"-first-seed", "-1"},
		{"-duration", "500ms"},
		{"-warmup", "-1s"},
		{"-timeout", "0s"},
		{"-policies", "fastest"},
		{"extra"},
	})
}

// TestVariants checks every variant's definition: valid models for every
// seed, distinct schedules per backend and per seed, and the load the
// comments promise.
func TestVariants(t *testing.T) {
	seen := map[string]bool{}
	for _, v := range buildVariants(6 * time.Second) {
		if seen[v.name] {
			t.Errorf("variant %s twice", v.name)
		}
		seen[v.name] = true
		if !strings.HasPrefix(v.name, v.class) && v.class != "dynamics" {
			t.Errorf("variant %s of class %s", v.name, v.class)
		}
		if v.marked != nil && len(v.marked) != len(v.models) {
			t.Errorf("%s: %d marks for %d backends", v.name, len(v.marked), len(v.models))
		}
		if w := v.proxy.Weights; w != nil && len(w) != len(v.models) {
			t.Errorf("%s: %d weights for %d backends", v.name, len(w), len(v.models))
		}
		if v.concurrency > 0 {
			// A closed loop (issue 24's partialfail): no rate, no direct.
			if v.rate != 0 || slices.ContainsFunc(variantPolicies(v, allPolicies, true), func(p policy) bool { return p.kind == kindDirect }) {
				t.Errorf("%s: a closed loop with rate %v or a direct baseline", v.name, v.rate)
			}
		} else if !(v.rate > 0) || !(v.directRate > 0) || v.directRate > v.rate {
			t.Errorf("%s: rate %v, direct %v", v.name, v.rate, v.directRate)
		}
		a, b := seedModels(v, 1, 2*time.Second), seedModels(v, 2, 2*time.Second)
		if a[0].Freeze.Seed == a[1].Freeze.Seed || a[0].Freeze.Seed == b[0].Freeze.Seed || a[0].Seed == b[0].Seed {
			t.Errorf("%s: seeds do not differ per backend and per seed", v.name)
		}
		for _, m := range a {
			if err := m.Validate(); err != nil {
				t.Errorf("%s: %v", v.name, err)
			}
		}
		l := loadmodel.Load{URL: "http://127.0.0.1/", Rate: v.rate, Duration: 6 * time.Second, Steps: v.steps, Concurrency: v.concurrency}
		if err := l.Validate(); err != nil {
			t.Errorf("%s: %v", v.name, err)
		}
	}
	if len(seen) != 24 {
		t.Errorf("%d variants", len(seen))
	}
	// The recovering backend changes at the warm-up plus half the window.
	for _, v := range buildVariants(6 * time.Second) {
		if v.name == "recovery" {
			m := seedModels(v, 1, 2*time.Second)[3]
			if m.Change.At != 5*time.Second || m.Change.Service != classService || m.Change.Freeze.Enabled() {
				t.Errorf("recovery change %+v", m.Change)
			}
		}
	}
}

// TestProxyConfigs renders every proxy's config with every option and
// checks it: Caddy's through Caddy's own Caddyfile adapter (with lbx
// registered), nginx's and HAProxy's with their own config checks when
// they are installed.
func TestProxyConfigs(t *testing.T) {
	opts := []proxyOptions{
		{},
		{Weights: []int{4, 4, 1, 1}},
		{HealthCheck: true},
		{HealthCheck: true, Retries: true, Weights: []int{2, 2, 1, 1}},
	}
	upstreams := []string{"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"}
	for _, pol := range allPolicies {
		if pol.kind == kindDirect {
			continue
		}
		for i, o := range opts {
			dir := t.TempDir()
			c, err := newProxyConfig(pol, dir, upstreams, o)
			if err != nil {
				t.Fatal(err)
			}
			c.Port, c.AdminPort = 18080, 12019
			switch pol.kind {
			case kindCaddy:
				path := filepath.Join(dir, "Caddyfile")
				if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
					t.Fatal(err)
				}
				body, _ := os.ReadFile(path)
				js, warn, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, nil)
				if err != nil || len(warn) > 0 {
					t.Errorf("%s, options %d: adapt: %v %v\n%s", pol.key, i, err, warn, body)
					continue
				}
				s := string(js)
				if o.Retries && (!strings.Contains(s, `"retries":2`) || !strings.Contains(s, "is_transport_error") || !strings.Contains(s, "status_code} in [502, 503, 504]")) {
					t.Errorf("%s: no retries in %s", pol.key, s)
				}
				if o.HealthCheck != strings.Contains(s, `"uri":"/health"`) {
					t.Errorf("%s: health checks %v, config %s", pol.key, o.HealthCheck, s)
				}
				weighted := strings.Contains(s, `"weights":[`)
				if weighted != (o.Weights != nil && pol.weights) {
					t.Errorf("%s, weights %v: config %s", pol.key, o.Weights, s)
				}
			case kindNginx:
				path := filepath.Join(dir, "nginx.conf")
				if err := writeTemplate(nginxTemplate, path, c); err != nil {
					t.Fatal(err)
				}
				body, _ := os.ReadFile(path)
				if strings.Contains(string(body), "weight=4") != (o.Weights != nil && o.Weights[0] == 4) ||
					strings.Contains(string(body), "http_503") != o.Retries {
					t.Errorf("nginx, options %d:\n%s", i, body)
				}
				if bin, err := exec.LookPath("nginx"); err == nil {
					out, err := exec.Command(bin, "-t", "-q", "-e", filepath.Join(dir, "nginx-error.log"), "-p", dir+"/", "-c", path).CombinedOutput()
					if err != nil {
						t.Errorf("nginx -t, options %d: %v\n%s\n%s", i, err, out, body)
					}
				}
			case kindHAProxy:
				path := filepath.Join(dir, "haproxy.cfg")
				if err := writeTemplate(haproxyTemplate, path, c); err != nil {
					t.Fatal(err)
				}
				body, _ := os.ReadFile(path)
				if strings.Contains(string(body), "check inter") != o.HealthCheck || strings.Contains(string(body), "retry-on") != o.Retries {
					t.Errorf("haproxy, options %d:\n%s", i, body)
				}
				if bin, err := exec.LookPath("haproxy"); err == nil {
					if out, err := exec.Command(bin, "-c", "-q", "-f", path).CombinedOutput(); err != nil {
						t.Errorf("haproxy -c, options %d: %v\n%s\n%s", i, err, out, body)
					}
				}
			}
		}
	}
	for _, pol := range hedgePolicies() {
		dir := t.TempDir()
		c, err := newProxyConfig(pol, dir, upstreams, proxyOptions{Backup: 10 * time.Millisecond, BackupBudget: 10})
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, "Caddyfile")
		if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
			t.Fatal(err)
		}
		body, _ := os.ReadFile(path)
		js, warn, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, nil)
		if err != nil || len(warn) > 0 {
			t.Errorf("%s: adapt: %v %v\n%s", pol.key, err, warn, body)
			continue
		}
		s := string(js)
		if strings.Contains(s, `"handler":"selective"`) != pol.selective || strings.Contains(s, `"backup_request":10000000`) != pol.backup {
			t.Errorf("%s: %s", pol.key, s)
		}
	}
	ewma, _ := policyByKey("ewma")
	if _, err := newProxyConfig(ewma, t.TempDir(), upstreams, proxyOptions{Weights: []int{1}}); err == nil {
		t.Error("a weight count that does not match the upstreams was accepted")
	}
}

// TestScenariosQuick runs `bench scenarios -quick` end to end with short
// windows: it checks that the command works and reports what it should,
// never how fast anything was.
func TestScenariosQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy proxies and runs load for several seconds")
	}
	bin := testCaddy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	jsonPath := filepath.Join(t.TempDir(), "out.json")
	var out bytes.Buffer
	rep, err := runScenarios(ctx, []string{"-quick", "-caddy", bin, "-warmup", "300ms", "-duration", "1s", "-json", jsonPath},
		"go test ./integration/bench", &out, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	if len(rep.Variants) != len(quickVariants) {
		t.Fatalf("%d variants, want %d", len(rep.Variants), len(quickVariants))
	}
	for _, v := range rep.Variants {
		if len(v.Rows) != 2 || len(v.Verdicts) == 0 {
			t.Errorf("%s: %d rows, %d verdicts", v.Name, len(v.Rows), len(v.Verdicts))
		}
		for _, r := range v.Rows {
			if r.Throughput <= 0 || r.P99.N != 1 {
				t.Errorf("%s/%s has no measurements: %+v", v.Name, r.Policy, r)
			}
			if v.Name == "recovery" && r.Recovery == nil {
				t.Errorf("recovery/%s has no recovery", r.Policy)
			}
			if v.MarkLabel != "" && r.MarkedShare == nil {
				t.Errorf("%s/%s has no share to the %s backends", v.Name, r.Policy, v.MarkLabel)
			}
		}
	}
	if len(rep.Cases) != 2*len(quickVariants) {
		t.Errorf("%d cases", len(rep.Cases))
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var back scenReport
	if err := json.Unmarshal(b, &back); err != nil || len(back.Cases) != len(rep.Cases) {
		t.Errorf("JSON output: %v, %d cases", err, len(back.Cases))
	}
	for _, want := range []string{"Command: `go test ./integration/bench`", "## Summary", "## degraded-1of4", "## fastfail-503-retries",
		"| lbx ewma |", "| Caddy least_conn |", "Verdict for lbx ewma", "time to 80% of fair", "total wall time", "Calibration:"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}
