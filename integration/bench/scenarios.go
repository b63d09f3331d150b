package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// `bench scenarios` runs the scenario classes of issue 11: named variants
// of backend pools (persistent degradation, mixed capacity, stalls on
// every backend, homogeneous high load, fast failure, a large pool, a load
// step and a recovery), every policy side by side in each, over several
// seeds, and prints one table per variant with a verdict for lbx ewma
// against the issue's targets.

// Measured capacity of the classes' backend model on the 2-core VM the
// project is built on: a backend with 1 worker and a mean service time of
// 4 ms ± 25% holds its worker ≈4.6 ms per request (Go's timers wake
// ≈0.6 ms late) and serves ≈217 req/s when saturated; at 8 ms ≈8.65 ms and
// ≈115 req/s; at 16 ms ≈16.9 ms and ≈59 req/s. The rates of the variants
// below are utilization targets times these capacities; every run measures
// the 4 ms capacity again (calibrate) and prints it, so a reader can tell
// when a machine differs.
const (
	cap4ms  = 217.0
	cap8ms  = 115.0
	cap16ms = 59.0
)

// The classes' backend model: one worker, so a single slow request blocks
// the backend (the configuration where ewma lost in issue 11).
const (
	classService = 4 * time.Millisecond
	classJitter  = 0.25
	slowFactor   = 10
)

// healthy returns the classes' healthy backend model with the given mean
// service time.
func healthy(service time.Duration) loadmodel.Model {
	return loadmodel.Model{Workers: 1, Service: service, Jitter: classJitter}
}

// degraded returns the classes' degraded backend model: ten times the
// service time of a healthy one, and a stall of 50–100 ms in every period
// of 2 s.
func degraded(service time.Duration) loadmodel.Model {
	m := healthy(slowFactor * service)
	m.Freeze = loadmodel.Freeze{Every: 2 * time.Second, Min: 50 * time.Millisecond, Max: 100 * time.Millisecond}
	return m
}

// verdictKind selects the targets a variant is judged by, besides the p99
// and p50 targets every variant has.
type verdictKind int

const (
	// targetsPlain: p99 and p50 against the least-connections policies,
	// with 0 errors.
	targetsPlain verdictKind = iota
	// targetsDegraded adds p99 ≤ best stock ÷ 3 and ≤ 2 × direct.
	targetsDegraded
	// targetsFastFail replaces 0 errors by: share to the failing backend
	// < 2% and client errors ≤ 2%.
	targetsFastFail
	// targetsFastFailRetries: share < 2% and 0 client errors.
	targetsFastFailRetries
)

// variant is one named configuration of a scenario class.
type variant struct {
	name, class string
	// title is a one-line description, about what the variant models
	// and why.
	title, about string
	// models are the backends (names and seeds are filled per seed).
	models []loadmodel.Model
	// marked flags the backends whose share is reported, markLabel names
	// them ("degraded", "slower", "failing").
	marked    []bool
	markLabel string
	// rate is the load through a proxy; directRate what the direct
	// baseline sends to one healthy backend (its share under ideal
	// balancing); load the utilization the rate aims at, in words.
	rate, directRate float64
	load             string
	steps            []loadmodel.Step
	windows          []window
	// recoverAt is when the marked backend recovers, relative to the
	// measured window (0: it does not).
	recoverAt time.Duration
	proxy     proxyOptions
	kind      verdictKind
	notes     []string
	// stock, if set, keeps only these of the run's policies, and forms
	// are configurations of this variant's own, run after them (the
	// classes of issue 24).
	stock []string
	forms []policy
	// concurrency, if more than 0, replaces the open loop by that many
	// closed-loop clients (rate is then only descriptive).
	concurrency int
}

// scenConfig is `bench scenarios`' configuration, from flags.
type scenConfig struct {
	variants  []variant
	seeds     int
	firstSeed int
	warmup    time.Duration
	duration  time.Duration
	timeout   time.Duration
	policies  []policy
	caddyBin  string
	jsonPath  string
	quick     bool
	// reports: the backends send ORCA load reports (-reports).
	reports bool
	// hedgeBackup is the hedge class's backup_request; autoOK whether the
	// Caddy under test accepts `backup_request auto` (set when it runs).
	hedgeBackup time.Duration
	autoOK      bool
	// hedgeLoad is the hedge class's utilization target.
	hedgeLoad float64
}

// Defaults of `bench scenarios`.
const (
	defaultScenSeeds    = 3
	defaultScenWarmup   = 2 * time.Second
	defaultScenDuration = 6 * time.Second
)

// quickVariants are the variants of -quick.
var quickVariants = []string{"degraded-1of4", "fastfail-503-retries", "recovery"}

// parseScenarioFlags reads `bench scenarios`' flags.
func parseScenarioFlags(args []string, stderr io.Writer) (*scenConfig, error) {
	fs := flag.NewFlagSet("bench scenarios", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" scenarios [flags]\n\n"+
			"Runs the scenario classes of issues 11 and 24, every policy side by side in each\n"+
			"variant, over several seeds; prints a Markdown table per variant and a\n"+
			"verdict for lbx ewma against the targets.\n\n"+
			"Classes and their variants:\n")
		for _, c := range classNames() {
			fmt.Fprintf(stderr, "  %-12s %s\n", c, strings.Join(classVariants(c), ", "))
		}
		fmt.Fprintf(stderr, "\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &scenConfig{}
	var classes, pols string
	fs.StringVar(&classes, "classes", "all", "comma-separated classes or variants to run (all: every class)")
	fs.IntVar(&c.seeds, "seeds", defaultScenSeeds, "seeds per variant; a seed selects the stalls and the jitter of every backend; tables show medians and ranges over seeds")
	fs.IntVar(&c.firstSeed, "first-seed", 1, "the first seed; seeds run from it up")
	fs.DurationVar(&c.warmup, "warmup", defaultScenWarmup, "unmeasured warm-up at the variant's rate before each measured window")
	fs.DurationVar(&c.duration, "duration", defaultScenDuration, "measured window per case")
	fs.DurationVar(&c.timeout, "timeout", defaultTimeout, "per-request client timeout; a timeout is an error, counted at its full duration")
	fs.StringVar(&pols, "policies", strings.Join(policyKeys(), ","), "policies to compare (those whose proxy is not installed are skipped)")
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.StringVar(&c.jsonPath, "json", "", "also write raw per-case results and the aggregates as JSON to this file")
	fs.DurationVar(&c.hedgeBackup, "hedge-backup", defaultHedgeBackup, "backup_request of the hedge class's hedged forms (near the healthy p95 of its backends)")
	fs.Float64Var(&c.hedgeLoad, "hedge-load", hedgeLoad, "utilization the hedge class's rate aims at (issue 24: 0.45; lower it on a machine short of CPU and say so)")
	fs.BoolVar(&c.reports, "reports", false, "every backend sends ORCA load reports of its own queue (issue 27): the classes as lbx meets backends that report")
	fs.BoolVar(&c.quick, "quick", false, "smoke test: "+strings.Join(quickVariants, ", ")+"; ewma and least_conn; 1 seed; 0.5s warm-up, 2s window (flags given explicitly still win)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if c.quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["classes"] {
			classes = strings.Join(quickVariants, ",")
		}
		if !set["policies"] {
			pols = "ewma,least_conn"
		}
		if !set["seeds"] {
			c.seeds = 1
		}
		if !set["warmup"] {
			c.warmup = 500 * time.Millisecond
		}
		if !set["duration"] {
			c.duration = 2 * time.Second
		}
	}
	switch {
	case c.seeds < 1:
		return nil, fmt.Errorf("-seeds must be at least 1, got %d", c.seeds)
	case c.firstSeed < 0:
		return nil, fmt.Errorf("-first-seed must not be negative, got %d", c.firstSeed)
	case c.duration < time.Second:
		return nil, fmt.Errorf("-duration must be at least 1s (the dynamics need thirds and halves of it), got %v", c.duration)
	case c.warmup < 0:
		return nil, fmt.Errorf("-warmup must not be negative, got %v", c.warmup)
	case c.timeout <= 0:
		return nil, fmt.Errorf("-timeout must be positive, got %v", c.timeout)
	case !(c.hedgeLoad > 0) || c.hedgeLoad >= 1:
		return nil, fmt.Errorf("-hedge-load must be above 0 and below 1, got %v", c.hedgeLoad)
	case c.hedgeBackup < time.Millisecond || c.hedgeBackup > time.Minute:
		return nil, fmt.Errorf("-hedge-backup must be between 1ms and 1m, got %v", c.hedgeBackup)
	}
	var err error
	if c.policies, err = parsePolicies(pols); err != nil {
		return nil, err
	}
	if c.variants, err = selectVariants(classes, buildVariants(c.duration)); err != nil {
		return nil, err
	}
	for i := range c.variants {
		if v := &c.variants[i]; v.kind == targetsHedge {
			v.rate = math.Round(c.hedgeLoad * 4 * cap2ms)
			v.directRate = v.rate / 4
			v.load = fmt.Sprintf("%.0f%% of capacity (4 × ≈%.0f req/s)", 100*c.hedgeLoad, cap2ms)
		}
	}
	return c, nil
}

// classOrder lists the classes in the order of issue 11.
var classOrder = []string{"degraded", "mixed", "stalls", "homogeneous", "fastfail", "largepool", "dynamics", "hedge", "partialfail"}

func classNames() []string { return classOrder }

// classVariants returns the names of a class's variants.
func classVariants(class string) []string {
	var out []string
	for _, v := range buildVariants(defaultScenDuration) {
		if v.class == class {
			out = append(out, v.name)
		}
	}
	return out
}

// selectVariants picks from all the variants that list names: classes
// (all their variants), variants, or "all".
func selectVariants(list string, all []variant) ([]variant, error) {
	var out []variant
	seen := map[string]bool{}
	add := func(v variant) {
		if !seen[v.name] {
			seen[v.name] = true
			out = append(out, v)
		}
	}
	for _, name := range strings.Split(list, ",") {
		name = strings.ToLower(strings.TrimSpace(name))
		if name == "" {
			continue
		}
		found := false
		for _, v := range all {
			if name == "all" || v.class == name || v.name == name {
				add(v)
				found = true
			}
		}
		if !found {
			var names []string
			for _, v := range all {
				names = append(names, v.name)
			}
			return nil, fmt.Errorf("unknown class or variant %q (classes: %s; variants: %s)",
				name, strings.Join(classOrder, ", "), strings.Join(names, ", "))
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no class or variant selected")
	}
	return out, nil
}

// pool returns n healthy backends of the classes' model with service
// time svc.
func pool(n int, svc time.Duration) []loadmodel.Model {
	ms := make([]loadmodel.Model, n)
	for i := range ms {
		ms[i] = healthy(svc)
	}
	return ms
}

// lastMarked flags the last k of n backends.
func lastMarked(n, k int) []bool {
	m := make([]bool, n)
	for i := n - k; i < n; i++ {
		m[i] = true
	}
	return m
}

// buildVariants returns every variant, for a measured window of duration
// (the dynamics are timed in thirds and halves of it).
func buildVariants(duration time.Duration) []variant {
	var vs []variant

	// 1. Persistent degradation. The healthy backends alone would be 50%
	// busy; a degraded one serves ≈23 req/s (40 ms, minus its stalls), so
	// a round-robin quarter share overloads it.
	for _, k := range []int{1, 2} {
		ms := pool(4, classService)
		for i := 4 - k; i < 4; i++ {
			ms[i] = degraded(classService)
		}
		rate := math.Round(0.5 * float64(4-k) * cap4ms)
		vs = append(vs, variant{
			name: fmt.Sprintf("degraded-%dof4", k), class: "degraded",
			title: fmt.Sprintf("%d of 4 backends persistently degraded", k),
			about: "A degraded backend serves 10× slower than a healthy one and stalls 50–100 ms every ~2 s " +
				"(a sick machine that keeps passing health checks). A balancer should keep nearly all traffic off it.",
			models: ms, marked: lastMarked(4, k), markLabel: "degraded",
			rate: rate, directRate: rate / float64(4-k),
			load: "the healthy backends alone ≈50% busy",
			kind: targetsDegraded,
		})
	}

	// 2. Mixed capacity: two fast backends (4 ms) and two slower ones,
	// at 65% of the pool's total capacity. Capacity-proportional shares
	// run every backend ≈65% busy.
	for _, ratio := range []int{2, 4} {
		slowSvc, slowCap := 8*time.Millisecond, cap8ms
		if ratio == 4 {
			slowSvc, slowCap = 16*time.Millisecond, cap16ms
		}
		ms := append(pool(2, classService), pool(2, slowSvc)...)
		total := 2*cap4ms + 2*slowCap
		rate := math.Round(0.65 * total)
		base := variant{
			class: "mixed", models: ms, marked: lastMarked(4, 2), markLabel: "slower",
			rate: rate, directRate: math.Round(0.65 * cap4ms),
			load:  fmt.Sprintf("65%% of the pool's capacity; capacity-proportional shares send %.0f%% to the slower pair", 100*2*slowCap/total),
			notes: []string{"direct hits b1, a fast backend, at its capacity-proportional share (65% of its capacity)"},
			about: fmt.Sprintf("Two backends of 4 ms and two of %v (%d:1), no stalls: mixed machine sizes. "+
				"A balancer that chases the fastest backend overloads the fast pair; one that splits by count overloads the slow pair.", slowSvc, ratio),
		}
		plain := base
		plain.name, plain.title = fmt.Sprintf("mixed-%dto1", ratio), fmt.Sprintf("mixed capacity %d:1, no weights", ratio)
		vs = append(vs, plain)
		w := base
		w.name, w.title = fmt.Sprintf("mixed-%dto1-weighted", ratio), fmt.Sprintf("mixed capacity %d:1, weighted %d %d 1 1", ratio, ratio, ratio)
		w.proxy.Weights = []int{ratio, ratio, 1, 1}
		w.notes = append(slices.Clone(base.notes), fmt.Sprintf("lbx ewma gets `weights %d %d 1 1`, nginx and HAProxy the same server weights; "+
			"Caddy's stock least_conn, random_choose and round_robin take no weights and run unweighted", ratio, ratio))
		vs = append(vs, w)
	}

	// 3. Stalls on every backend (whole-backend freezes, as GC pauses),
	// each backend on its own schedule, at 65% of capacity.
	for _, st := range []struct {
		name, title  string
		every, lo, h time.Duration
	}{
		{"stalls-long", "every backend stalls 50–150 ms about every 2 s", 2 * time.Second, 50 * time.Millisecond, 150 * time.Millisecond},
		{"stalls-short", "every backend stalls 10–30 ms about every 500 ms", 500 * time.Millisecond, 10 * time.Millisecond, 30 * time.Millisecond},
	} {
		ms := pool(4, classService)
		for i := range ms {
			ms[i].Freeze = loadmodel.Freeze{Every: st.every, Min: st.lo, Max: st.h}
		}
		rate := math.Round(0.65 * 4 * cap4ms)
		vs = append(vs, variant{
			name: st.name, class: "stalls", title: st.title,
			about: "Every backend freezes now and then, as a process does in a GC pause; the stall's latency samples arrive after it ended. " +
				"A balancer should steer around a backend while it is stalled and give it its share back at once afterwards.",
			models: ms, rate: rate, directRate: rate / 4,
			load:  "65% of capacity (stalls take 4–5% of it)",
			notes: []string{"direct hits b1, which stalls like every backend here"},
		})
	}

	// 4. Homogeneous high load.
	{
		rate := math.Round(0.85 * 4 * cap4ms)
		vs = append(vs, variant{
			name: "homogeneous-85", class: "homogeneous", title: "4 equal backends, 85% busy",
			about:  "Equal backends under high load: nothing to avoid, so a latency-aware policy must not do worse than counting connections.",
			models: pool(4, classService), rate: rate, directRate: rate / 4,
			load: "85% of capacity",
		})
	}

	// 5. Fast failure: one backend answers every request at once with a
	// 503 or a reset, while its health check passes. The rate is 50% of
	// the three healthy backends' capacity.
	for _, ff := range []struct {
		mode    loadmodel.FailMode
		retries bool
	}{{loadmodel.Fail503, false}, {loadmodel.Fail503, true}, {loadmodel.FailReset, false}, {loadmodel.FailReset, true}} {
		ms := pool(4, classService)
		ms[3].Fail = ff.mode
		rate := math.Round(0.5 * 3 * cap4ms)
		v := variant{
			class: "fastfail", models: ms, marked: lastMarked(4, 1), markLabel: "failing",
			rate: rate, directRate: rate / 3,
			load:  "the three good backends ≈50% busy",
			proxy: proxyOptions{HealthCheck: true},
			kind:  targetsFastFail,
		}
		what := "answers every request at once with 503"
		v.name = "fastfail-503"
		if ff.mode == loadmodel.FailReset {
			what = "resets every connection at once (RST)"
			v.name = "fastfail-reset"
		}
		v.about = "A black hole: one backend " + what + " while GET /health answers 200. " +
			"It has the fewest requests in flight and the lowest latency, so least-connections and naive latency-aware policies feed it."
		v.title = "1 of 4 " + what + ", health check passes"
		v.notes = []string{"every proxy actively checks GET /health every " + healthInterval +
			" (nginx OSS has no active checks: its passive defaults apply)"}
		if ff.retries {
			v.name += "-retries"
			v.title += ", with retries"
			v.proxy.Retries = true
			v.kind = targetsFastFailRetries
			v.notes = append(v.notes, "retries: Caddy `lb_retries 2`, `lb_retry_match` on `{http.reverse_proxy.status_code} in [502, 503, 504]` "+
				"and on `{http.reverse_proxy.is_transport_error}` (without it Caddy retries no reset); "+
				"nginx `proxy_next_upstream error timeout http_502 http_503 http_504`, 3 tries; "+
				"HAProxy `retries 2`, `retry-on conn-failure empty-response response-timeout 502 503 504`, `option redispatch 1`")
		} else {
			v.title += ", no retries"
			v.notes = append(v.notes, "no retries configured: each proxy's defaults")
		}
		v.notes = append(v.notes, "the share counts attempts at the backends, so with retries one client request can count twice")
		vs = append(vs, v)
	}

	// 6. A larger pool: 24 backends, 3 degraded as in class 1, the healthy
	// ones ≈50% busy. 16 ms backends keep the rate (≈620 req/s) and so the
	// proxies' CPU near the other classes': at 4 ms the same utilization
	// would need ≈2300 req/s, more than two shared cores can proxy.
	{
		ms := pool(24, 16*time.Millisecond)
		for i := 21; i < 24; i++ {
			ms[i] = degraded(16 * time.Millisecond)
		}
		rate := math.Round(0.5 * 21 * cap16ms)
		vs = append(vs, variant{
			name: "largepool-24", class: "largepool", title: "24 backends, 3 persistently degraded",
			about: "A larger pool with a few sick machines. (ewma's `choices auto` scans pools of up to 32, so this is a scan; two random choices are simulated in lbpolicy's tests.) " +
				"Backends serve 16 ms (degraded: 160 ms and 50–100 ms stalls every ~2 s).",
			models: ms, marked: lastMarked(24, 3), markLabel: "degraded",
			rate: rate, directRate: rate / 21,
			load: "the healthy backends alone ≈50% busy",
			kind: targetsDegraded,
		})
	}

	// 7. Dynamics. The load step runs 4 equal backends at ≈40% for the
	// first third of the window, ≈80% for the middle third, then ≈40%
	// again.
	{
		rate := math.Round(0.4 * 4 * cap4ms)
		third := duration / 3
		vs = append(vs, variant{
			name: "loadstep", class: "dynamics", title: "the rate doubles for the middle third of the window",
			about: "4 equal backends; the load doubles at a third of the window and falls back at two thirds. " +
				"A balancer must absorb a burst without herding.",
			models: pool(4, classService), rate: rate, directRate: rate / 4,
			load:    fmt.Sprintf("≈40%%, then ≈80%% from %v to %v of the window", third.Round(time.Millisecond), (2 * third).Round(time.Millisecond)),
			steps:   []loadmodel.Step{{At: third, Rate: 2 * rate}, {At: 2 * third, Rate: rate}},
			windows: []window{{name: "step", from: third, to: 2 * third}},
		})
	}
	// The recovery: one of 4 is degraded (as in class 1) until the middle
	// of the window, then healthy. The rate keeps the three others ≈50%
	// busy, ≈37% once all four serve.
	{
		ms := pool(4, classService)
		ms[3] = degraded(classService)
		half := duration / 2
		rate := math.Round(0.5 * 3 * cap4ms)
		vs = append(vs, variant{
			name: "recovery", class: "dynamics", title: "1 of 4 degraded until the middle of the window, then healthy",
			about: "A degraded backend recovers: how fast does it get its share back? " +
				"Its share is counted from its arrivals per 100 ms after the recovery.",
			models: ms, marked: lastMarked(4, 1), markLabel: "recovering",
			rate: rate, directRate: rate / 3,
			load:      fmt.Sprintf("the three others ≈50%% busy; all four ≈37%% after the recovery at %v of the window", half.Round(time.Millisecond)),
			recoverAt: half,
		})
	}
	return append(vs, issue24Variants()...)
}

// seedModels returns the variant's backend models for a seed: names b1…bn,
// and per backend its own freeze schedule and jitter sequence. The
// recovering backend's change is timed from the epoch: the warm-up plus
// the variant's recoverAt.
func seedModels(v variant, seed int, warmup time.Duration) []loadmodel.Model {
	ms := slices.Clone(v.models)
	for i := range ms {
		base := uint64(seed)*1_000_003 + uint64(i+1)*7919
		ms[i].Name = fmt.Sprintf("b%d", i+1)
		ms[i].Seed = base ^ 0x6a09e667f3bcc908
		ms[i].Freeze.Seed = base ^ 0xbb67ae8584caa73b
		if v.recoverAt > 0 && v.marked[i] {
			ms[i].Change = loadmodel.Change{At: warmup + v.recoverAt, Service: classService}
		}
	}
	return ms
}

// caseSpec returns the case of variant v under cfg.
func (v variant) caseSpec(cfg *scenConfig) caseSpec {
	cs := caseSpec{
		scenario:    v.name,
		rate:        v.rate,
		steps:       v.steps,
		directRate:  v.directRate,
		warmup:      cfg.warmup,
		duration:    cfg.duration,
		timeout:     cfg.timeout,
		marked:      v.marked,
		markLabel:   v.markLabel,
		windows:     v.windows,
		buckets:     v.recoverAt > 0,
		proxy:       v.proxy,
		concurrency: v.concurrency,
		reports:     cfg.reports,
	}
	if v.kind == targetsHedge {
		cs.proxy.Backup = cfg.hedgeBackup
	}
	return cs
}

// caseOverhead estimates what a case costs besides its warm-up and
// measured window: starting and stopping a proxy, draining the backends
// (≈0.1 s measured on the 2-core VM; more after a case that left queues).
func caseOverhead(p policy) time.Duration {
	if p.kind == kindDirect {
		return 100 * time.Millisecond
	}
	return 500 * time.Millisecond
}

// estimate returns the expected wall time of the run's cases.
func estimate(cfg *scenConfig, pols []policy) (cases int, d time.Duration) {
	for _, v := range cfg.variants {
		for _, p := range variantPolicies(v, pols, cfg.autoOK) {
			cases += cfg.seeds
			d += time.Duration(cfg.seeds) * (cfg.warmup + cfg.duration + caseOverhead(p))
		}
	}
	return cases, d
}

// calibration is a measurement of the classes' backend model on this
// machine.
type calibration struct {
	Service  string  `json:"service"`
	Capacity float64 `json:"capacity_req_per_s"`
	HoldMs   float64 `json:"hold_ms"`
	Assumed  float64 `json:"assumed_capacity_req_per_s"`
}

// calibrate measures how many requests per second a 1-worker backend of
// the classes' model serves when saturated (four clients in a closed loop
// for d), and the mean time it holds its worker.
func calibrate(ctx context.Context, d time.Duration) (calibration, error) {
	m := healthy(classService)
	m.Name = "calibrate"
	b, err := loadmodel.StartBackend(m)
	if err != nil {
		return calibration{}, err
	}
	defer b.Close()
	client := loadmodel.NewClient(2 * time.Second)
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.URL(), nil)
				if err != nil {
					return
				}
				req.Header.Set(loadmodel.PhaseHeader, loadmodel.PhaseMeasure.String())
				resp, err := client.Do(req)
				if err != nil {
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	c := b.Counters(loadmodel.PhaseMeasure)
	if c.Served == 0 {
		return calibration{}, errors.New("calibration: the backend served nothing")
	}
	return calibration{
		Service:  fmt.Sprintf("1 worker, %v ±%.0f%%", classService, 100*classJitter),
		Capacity: float64(c.Served) / elapsed.Seconds(),
		HoldMs:   ms(c.MeanService),
		Assumed:  cap4ms,
	}, nil
}

// runScenarios is `bench scenarios`: it parses args, runs every variant's
// cases, writes the Markdown report to out (and JSON if asked), and logs
// progress to progress. It stops every process and backend it started
// before returning, also when ctx is cancelled.
func runScenarios(ctx context.Context, args []string, cmdline string, out, progress io.Writer) (*scenReport, error) {
	cfg, err := parseScenarioFlags(args, progress)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	tmp, err := os.MkdirTemp("", "lbx-bench-scenarios-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)

	t, source, versions, notes, pols, err := setupTools(ctx, cfg.caddyBin, cfg.policies, tmp, progress)
	if err != nil {
		return nil, err
	}
	rep := &scenReport{
		Command:   cmdline,
		Source:    source,
		runHeader: startRun(began),
		GOMAXPROC: runtime.GOMAXPROCS(0),
		Versions:  versions,
		Notes:     notes,
		Seeds:     cfg.seeds,
		FirstSeed: cfg.firstSeed,
		Warmup:    cfg.warmup.String(),
		Duration:  cfg.duration.String(),
		Timeout:   cfg.timeout.String(),
	}
	if cal, err := calibrate(ctx, time.Second); err == nil {
		rep.Calibration = &cal
		fmt.Fprintf(progress, "calibration: a %s backend serves %.0f req/s saturated (holds its worker %.2f ms); the rates assume %.0f\n",
			cal.Service, cal.Capacity, cal.HoldMs, cal.Assumed)
	} else if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if needsAuto(cfg.variants) {
		var why string
		if cfg.autoOK, why = caddyAcceptsAuto(ctx, t.caddy, filepath.Join(tmp, "auto-check")); !cfg.autoOK {
			rep.Notes = append(rep.Notes, "backup_request auto forms skipped: not supported by this build ("+why+")")
			fmt.Fprintf(progress, "backup_request auto forms skipped: not supported by this build (%s)\n", why)
		}
	}
	nCases, est := estimate(cfg, pols)
	rep.estimated(est)
	fmt.Fprintf(progress, "%d variants × their policies × %d seeds = %d cases, estimated %v\n",
		len(cfg.variants), cfg.seeds, nCases, est.Round(time.Second))

	var runErr error
	done := 0
	for vi, v := range cfg.variants {
		cases, err := runVariant(ctx, cfg, t, v, vi, pols, filepath.Join(tmp, v.name), progress, &done, nCases)
		rep.Cases = append(rep.Cases, cases...)
		if err != nil {
			runErr = fmt.Errorf("variant %s: %w", v.name, err)
			break
		}
		rep.Variants = append(rep.Variants, summarizeVariant(v, cfg, pols, cases))
	}
	rep.finish()
	if err := writeRun(rep, &rep.Notes, len(rep.Variants) > 0, out, cfg.jsonPath, runErr); err != nil {
		return nil, err
	}
	return rep, nil
}

// runVariant runs every seed of a variant: per seed it starts the
// backends with that seed's models and runs every policy once, in an
// order rotated from seed to seed (and variant to variant).
func runVariant(ctx context.Context, cfg *scenConfig, t tools, v variant, vi int, pols []policy, dir string, progress io.Writer, done *int, total int) ([]caseResult, error) {
	var cases []caseResult
	cs := v.caseSpec(cfg)
	pols = variantPolicies(v, pols, cfg.autoOK)
	for r := range cfg.seeds {
		seed := cfg.firstSeed + r
		cr, err := runSeed(ctx, t, cs, seedModels(v, seed, cfg.warmup), pols, (r+vi)%len(pols), seed, dir, func(c caseResult) {
			*done++
			fmt.Fprintf(progress, "[%d/%d] %s seed %d %-16s %s\n", *done, total, v.name, seed, c.Policy, c.oneLine())
		})
		cases = append(cases, cr...)
		if err != nil {
			return cases, err
		}
	}
	return cases, nil
}

// runSeed starts backends of the models and runs every policy once, the
// first at index first.
func runSeed(ctx context.Context, t tools, cs caseSpec, models []loadmodel.Model, pols []policy, first, seed int, dir string, each func(caseResult)) ([]caseResult, error) {
	backends := make([]*loadmodel.Backend, 0, len(models))
	defer func() {
		for _, b := range backends {
			b.Close()
		}
	}()
	for _, m := range models {
		b, err := loadmodel.StartBackend(m)
		if err != nil {
			return nil, err
		}
		b.SetLoadReports(cs.reports)
		backends = append(backends, b)
	}
	var cases []caseResult
	for i := range pols {
		pol := pols[(first+i)%len(pols)]
		caseDir := filepath.Join(dir, fmt.Sprintf("seed%d-%s", seed, pol.key))
		if err := os.MkdirAll(caseDir, 0o755); err != nil {
			return cases, err
		}
		cr, err := runCase(ctx, t, cs, pol, backends, caseDir)
		if err != nil {
			return cases, fmt.Errorf("%s, seed %d: %w", pol.key, seed, err)
		}
		cr.Seed = seed
		cases = append(cases, cr)
		each(cr)
	}
	return cases, nil
}
