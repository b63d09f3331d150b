package main

// `bench shared` is issue 27's class "shared backends, sparse views": many
// lbx Caddy nodes, each a process of its own behind its own open-loop
// client at a low rate, proxy to the same 4 backends, so that each node
// sees only a few answers per backend per second. An outside client (the
// antagonist) loads one backend directly in short bursts, and another
// backend runs on fewer workers. No node sees the antagonist's requests in
// its own counts, and at a few answers per second its latency estimates
// lag a burst of a second or two; the backends' own load reports
// (Endpoint-Load-Metrics) show it at once. Policies run side by side per
// seed: stock least_conn, lbx ewma with backends that do not report, the
// same with backends that do, and with backends that report and are
// probed for load.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// sharedPolicy is a contender of the class: a Caddy configuration, and
// whether the backends send load reports while it runs.
type sharedPolicy struct {
	policy
	// reports turns the backends' load reports on for the policy's cases.
	reports bool
	// target marks the policies the class's verdict judges (reports or
	// probing); the others are what they are judged against.
	target bool
	// skip, when set, says why the policy does not run (a feature not
	// built yet); the report notes it.
	skip string
}

// sharedPolicies are the class's contenders, in the order of the report.
// Defaults are the product: `lb_policy ewma` has no options. Stock
// least_conn runs with reporting backends, as it would in front of them:
// it ignores the header (and passes it on to the client, which lbx does
// not).
//
// Probing adds only its path, loadmodel.LoadReportPath, which every
// backend answers at once with its report.
var sharedPolicies = []sharedPolicy{
	{policy: policy{key: "least_conn", label: "Caddy least_conn", kind: kindCaddy, caddyPolicy: "least_conn"}, reports: true},
	{policy: policy{key: "ewma_noreports", label: "lbx ewma, backends silent", kind: kindCaddy, caddyPolicy: "ewma"}},
	{policy: policy{key: "ewma_reports", label: "lbx ewma, backends report", kind: kindCaddy, caddyPolicy: "ewma"}, reports: true, target: true},
	{policy: policy{key: "ewma_probing", label: "lbx ewma, reports and probes", kind: kindCaddy, caddyPolicy: "ewma",
		options: []string{"load_reports {", "probe " + loadmodel.LoadReportPath, "}"}}, reports: true, target: true},
}

func sharedPolicyKeys() []string {
	keys := make([]string, len(sharedPolicies))
	for i, p := range sharedPolicies {
		keys[i] = p.key
	}
	return keys
}

// parseSharedPolicies selects policies by key, in the class's order.
func parseSharedPolicies(list string) ([]sharedPolicy, error) {
	want := map[string]bool{}
	for _, k := range strings.Split(list, ",") {
		k = strings.ToLower(strings.TrimSpace(k))
		if k == "" {
			continue
		}
		if !slices.Contains(sharedPolicyKeys(), k) {
			return nil, fmt.Errorf("-policies: unknown policy %q (known: %s)", k, strings.Join(sharedPolicyKeys(), ", "))
		}
		want[k] = true
	}
	var out []sharedPolicy
	for _, p := range sharedPolicies {
		if want[p.key] {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("-policies: no policy selected")
	}
	return out, nil
}

// The class's backends: b1–b3 have 2 workers of 4 ms ± 25%, b4 one (half
// the capacity); b3 is the antagonist's. A 1-worker backend of this model
// serves ≈217 req/s saturated on the project's 2-core VM (cap4ms), so b1–b3
// ≈434 req/s and b4 ≈217: ≈1520 req/s in all.
const (
	sharedWorkers        = 2
	sharedReducedWorkers = 1
	sharedAntagonized    = 2 // index of b3
	sharedReduced        = 3 // index of b4
)

// sharedModels returns the class's backends for a seed: each draws its
// own jitter.
func sharedModels(seed int) []loadmodel.Model {
	ms := make([]loadmodel.Model, 4)
	for i := range ms {
		ms[i] = loadmodel.Model{Name: fmt.Sprintf("b%d", i+1), Workers: sharedWorkers, Service: classService, Jitter: classJitter,
			Seed: uint64(seed)*1_000_003 + uint64(i+1)*7919}
	}
	ms[sharedReduced].Workers = sharedReducedWorkers
	return ms
}

// sharedVariant is one density of the class.
type sharedVariant struct {
	name, title, about string
	// nodes proxies, each driven at rate req/s.
	nodes int
	rate  float64
	// The antagonist's bursts and pauses.
	onMin, onMax, offMin, offMax time.Duration
	// notWorse judges the target by "not worse than ewma without
	// reports" (dense views), instead of "half the best other's p99".
	notWorse bool
}

// sharedConfig is `bench shared`'s configuration, from flags.
type sharedConfig struct {
	variants  []sharedVariant
	policies  []sharedPolicy
	seeds     int
	firstSeed int
	warmup    time.Duration
	duration  time.Duration
	timeout   time.Duration
	// antagonistLoad is the antagonist's rate while on, as a multiple of
	// its backend's capacity.
	antagonistLoad float64
	// reportBehind makes the backends' reports count the requests an
	// answer leaves behind, not those with it (-report-count).
	reportBehind bool
	caddyBin     string
	jsonPath     string
	quick        bool
}

// Defaults of `bench shared`: 12 nodes at 30 req/s is 360 req/s, ≈7.5
// answers per backend per second at each node and ≈24% of the pool's
// capacity; the dense variant, 3 nodes at 250 req/s, is ≈62 answers per
// backend per second per node and ≈49%. With the antagonist at 1.1 × b3's
// capacity while on, both stay well under what 2 cores can proxy.
const (
	defaultSharedNodes      = 12
	defaultSharedRate       = 30
	defaultDenseNodes       = 3
	defaultDenseRate        = 250
	defaultSharedSeeds      = 3
	defaultSharedWarmup     = 3 * time.Second
	defaultSharedDuration   = 10 * time.Second
	defaultAntagonistLoad   = 1.1
	quickSharedNodes        = 6
	sharedStartAttempts     = 2
	sharedCaseOverheadGuess = 3 * time.Second
)

// sharedVariants returns the variants for the flags' node counts and
// rates.
func sharedVariants(nodes int, rate float64, denseNodes int, denseRate float64) []sharedVariant {
	return []sharedVariant{
		{
			name: "sparse", title: fmt.Sprintf("%d nodes at %g req/s each: sparse views", nodes, rate),
			about: "Each node sees a few answers per backend per second, so its latency estimates and its own requests in flight " +
				"tell it little and late about a burst on b3 that other clients cause. The backends' reports carry their queues to every node with each answer.",
			nodes: nodes, rate: rate,
			onMin: time.Second, onMax: 2 * time.Second, offMin: time.Second, offMax: 3 * time.Second,
		},
		{
			name: "dense", title: fmt.Sprintf("%d nodes at %g req/s each: dense views", denseNodes, denseRate),
			about: "The setting measured before issue 27: each node sees dozens of answers per backend per second, enough for latency alone " +
				"to follow a 5 s burst. Reports must not make it worse.",
			nodes: denseNodes, rate: denseRate,
			onMin: 5 * time.Second, onMax: 5 * time.Second, offMin: 5 * time.Second, offMax: 5 * time.Second,
			notWorse: true,
		},
	}
}

// parseSharedFlags reads `bench shared`'s flags.
func parseSharedFlags(args []string, stderr io.Writer) (*sharedConfig, error) {
	fs := flag.NewFlagSet("bench shared", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" shared [flags]\n\n"+
			"Runs issue 27's class \"shared backends, sparse views\": many lbx Caddy nodes, each at a low\n"+
			"open-loop rate, share 4 backends; an antagonist loads one in bursts, one has half the\n"+
			"workers. Policies side by side per seed; prints Markdown tables and a verdict.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &sharedConfig{}
	var variants, pols string
	var nodes, denseNodes int
	var rate, denseRate float64
	fs.IntVar(&nodes, "nodes", defaultSharedNodes, "Caddy nodes of the sparse variant, each its own process and client")
	fs.Float64Var(&rate, "rate", defaultSharedRate, "open-loop rate of each node of the sparse variant, req/s")
	fs.IntVar(&denseNodes, "dense-nodes", defaultDenseNodes, "Caddy nodes of the dense variant")
	fs.Float64Var(&denseRate, "dense-rate", defaultDenseRate, "open-loop rate of each node of the dense variant, req/s")
	fs.StringVar(&variants, "variants", "sparse,dense", "variants to run: sparse, dense")
	fs.StringVar(&pols, "policies", strings.Join(sharedPolicyKeys(), ","), "policies to compare (those not built yet are skipped with a note)")
	fs.IntVar(&c.seeds, "seeds", defaultSharedSeeds, "seeds per variant; a seed selects the backends' jitter and the antagonist's bursts; tables show medians and ranges over seeds")
	fs.IntVar(&c.firstSeed, "first-seed", 1, "the first seed; seeds run from it up")
	fs.DurationVar(&c.warmup, "warmup", defaultSharedWarmup, "unmeasured warm-up before each measured window (the antagonist runs through it)")
	fs.DurationVar(&c.duration, "duration", defaultSharedDuration, "measured window per case")
	fs.DurationVar(&c.timeout, "timeout", defaultTimeout, "per-request client timeout; a timeout is an error, counted at its full duration")
	fs.Float64Var(&c.antagonistLoad, "antagonist-load", defaultAntagonistLoad, "the antagonist's rate while on, as a multiple of b3's capacity (≥ 1 pushes it to or past saturation)")
	var reportCount string
	fs.StringVar(&reportCount, "report-count", "with", "what a backend's application_utilization counts: with (the requests in the system, the one answered included) or behind (those it leaves behind)")
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.StringVar(&c.jsonPath, "json", "", "also write raw per-case results and the aggregates as JSON to this file")
	fs.BoolVar(&c.quick, "quick", false, fmt.Sprintf("smoke test of under a minute: %d sparse nodes, 1 seed, 1s warm-up, 3s window (flags given explicitly still win)", quickSharedNodes))
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if c.quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["nodes"] {
			nodes = quickSharedNodes
		}
		if !set["seeds"] {
			c.seeds = 1
		}
		if !set["warmup"] {
			c.warmup = time.Second
		}
		if !set["duration"] {
			c.duration = 3 * time.Second
		}
	}
	switch {
	case nodes < 1 || nodes > 64:
		return nil, fmt.Errorf("-nodes must be between 1 and 64, got %d", nodes)
	case denseNodes < 1 || denseNodes > 64:
		return nil, fmt.Errorf("-dense-nodes must be between 1 and 64, got %d", denseNodes)
	case !(rate > 0) || rate > 10000:
		return nil, fmt.Errorf("-rate must be above 0 and at most 10000, got %v", rate)
	case !(denseRate > 0) || denseRate > 10000:
		return nil, fmt.Errorf("-dense-rate must be above 0 and at most 10000, got %v", denseRate)
	case c.seeds < 1:
		return nil, fmt.Errorf("-seeds must be at least 1, got %d", c.seeds)
	case c.firstSeed < 0:
		return nil, fmt.Errorf("-first-seed must not be negative, got %d", c.firstSeed)
	case c.duration < time.Second:
		return nil, fmt.Errorf("-duration must be at least 1s, got %v", c.duration)
	case c.warmup < 0:
		return nil, fmt.Errorf("-warmup must not be negative, got %v", c.warmup)
	case c.timeout <= 0:
		return nil, fmt.Errorf("-timeout must be positive, got %v", c.timeout)
	case !(c.antagonistLoad > 0) || c.antagonistLoad > 5:
		return nil, fmt.Errorf("-antagonist-load must be above 0 and at most 5, got %v", c.antagonistLoad)
	}
	switch reportCount {
	case "with":
	case "behind":
		c.reportBehind = true
	default:
		return nil, fmt.Errorf("-report-count must be with or behind, got %q", reportCount)
	}
	var err error
	if c.policies, err = parseSharedPolicies(pols); err != nil {
		return nil, err
	}
	all := sharedVariants(nodes, rate, denseNodes, denseRate)
	seen := map[string]bool{}
	for _, name := range strings.Split(variants, ",") {
		name = strings.ToLower(strings.TrimSpace(name))
		if name == "" || seen[name] {
			continue
		}
		seen[name] = true
		i := slices.IndexFunc(all, func(v sharedVariant) bool { return v.name == name })
		if i < 0 {
			return nil, fmt.Errorf("-variants: unknown variant %q (known: sparse, dense)", name)
		}
		c.variants = append(c.variants, all[i])
	}
	if len(c.variants) == 0 {
		return nil, errors.New("-variants: no variant selected")
	}
	return c, nil
}

// antagonistRate is the antagonist's rate while on: load × b3's capacity.
func antagonistRate(load float64) float64 {
	return math.Round(load * sharedWorkers * cap4ms)
}

// sharedCase is one policy's measurement in one seed of a variant.
type sharedCase struct {
	caseResult
	Nodes      int                        `json:"nodes"`
	Reports    bool                       `json:"reports"`
	Antagonist loadmodel.AntagonistResult `json:"antagonist"`
	// HeldReports is the number of upstreams for which the first node
	// held a load report at the end of the window (GET /lbx/upstreams),
	// for ewma; -1 where not known.
	HeldReports int `json:"held_reports"`
	// Probes is the number of load probes the backends answered during
	// the case, warm-up included.
	Probes int64 `json:"load_probes"`
}

// loadProbes sums the load probes the backends have answered.
func loadProbes(backends []*loadmodel.Backend) int64 {
	var n int64
	for _, b := range backends {
		n += b.LoadProbes()
	}
	return n
}

// heldReports counts the upstreams with a load_report in lbx's view of
// its upstreams, or returns -1 if the view cannot be read.
func heldReports(state json.RawMessage) int {
	var v struct {
		Upstreams []struct {
			Report json.RawMessage `json:"load_report"`
		} `json:"upstreams"`
	}
	if len(state) == 0 || json.Unmarshal(state, &v) != nil || v.Upstreams == nil {
		return -1
	}
	n := 0
	for _, u := range v.Upstreams {
		if len(u.Report) > 0 && string(u.Report) != "null" {
			n++
		}
	}
	return n
}

// sharedRow is a policy's aggregate over seeds.
type sharedRow struct {
	scenRow
	Reports bool `json:"reports"`
	Target  bool `json:"target"`
	// AntagonistP99 is the antagonist's own p99 (ms): how hard it pushed
	// b3.
	AntagonistP99 stat `json:"antagonist_p99_ms"`
	// HeldReports is the fewest upstreams, over seeds, for which the
	// first node held a load report at the end; -1 where not known.
	HeldReports int `json:"held_reports"`
	// ProbeRate is the load probes the backends answered per second of
	// the case, all nodes together.
	ProbeRate stat `json:"load_probes_per_s"`
}

// sharedSummary is a variant's table and verdict.
type sharedSummary struct {
	Name           string            `json:"name"`
	Title          string            `json:"title"`
	About          string            `json:"about"`
	Nodes          int               `json:"nodes"`
	RatePerNode    float64           `json:"rate_per_node"`
	AntagonistRate float64           `json:"antagonist_rate"`
	OnMin          string            `json:"antagonist_on_min"`
	OnMax          string            `json:"antagonist_on_max"`
	OffMin         string            `json:"antagonist_off_min"`
	OffMax         string            `json:"antagonist_off_max"`
	Models         []loadmodel.Model `json:"backends"`
	Rows           []sharedRow       `json:"rows"`
	Verdicts       []verdict         `json:"verdicts"`
	CPUPressure    *stat             `json:"cpu_pressure,omitempty"`
	SendLagMaxMs   float64           `json:"max_send_lag_ms"`
}

// sharedReport is everything `bench shared` measured.
type sharedReport struct {
	Command string `json:"command"`
	Source  string `json:"source"`
	runHeader
	Versions  map[string]string `json:"versions"`
	Seeds     int               `json:"seeds"`
	FirstSeed int               `json:"first_seed"`
	Warmup    string            `json:"warmup"`
	Duration  string            `json:"duration"`
	Timeout   string            `json:"timeout"`
	// ReportBehind is -report-count behind.
	ReportBehind bool            `json:"report_behind,omitempty"`
	Notes        []string        `json:"notes,omitempty"`
	Variants     []sharedSummary `json:"variants"`
	Cases        []sharedCase    `json:"cases"`
}

// runShared is `bench shared`: it parses args, runs every variant's
// cases, writes the Markdown report to out (and JSON if asked), and logs
// progress to progress. It stops every process and backend it started
// before returning, also when ctx is cancelled.
func runShared(ctx context.Context, args []string, cmdline string, out, progress io.Writer) (*sharedReport, error) {
	cfg, err := parseSharedFlags(args, progress)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	tmp, err := os.MkdirTemp("", "lbx-bench-shared-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	t, source, versions, notes, _, err := setupTools(ctx, cfg.caddyBin, nil, tmp, progress)
	if err != nil {
		return nil, err
	}
	var pols []sharedPolicy
	for _, p := range cfg.policies {
		if p.skip != "" {
			notes = append(notes, p.label+" skipped: "+p.skip)
			continue
		}
		pols = append(pols, p)
	}
	if len(pols) == 0 {
		return nil, errors.New("no selected policy can run")
	}
	rep := &sharedReport{
		Command: cmdline, Source: source, runHeader: startRun(began), Versions: versions, Notes: notes,
		Seeds: cfg.seeds, FirstSeed: cfg.firstSeed,
		Warmup: cfg.warmup.String(), Duration: cfg.duration.String(), Timeout: cfg.timeout.String(),
		ReportBehind: cfg.reportBehind,
	}
	total := len(cfg.variants) * cfg.seeds * len(pols)
	est := time.Duration(total) * (cfg.warmup + cfg.duration + sharedCaseOverheadGuess)
	rep.estimated(est)
	fmt.Fprintf(progress, "%d variants × %d seeds × %d policies = %d cases, estimated %v\n",
		len(cfg.variants), cfg.seeds, len(pols), total, est.Round(time.Second))
	var runErr error
	done := 0
	for vi, v := range cfg.variants {
		var cases []sharedCase
		for r := range cfg.seeds {
			seed := cfg.firstSeed + r
			cs, err := runSharedSeed(ctx, cfg, t, v, pols, (r+vi)%len(pols), seed, filepath.Join(tmp, v.name), func(c sharedCase) {
				done++
				fmt.Fprintf(progress, "[%d/%d] %s seed %d %-15s %s  antagonist p99 %.0f ms\n",
					done, total, v.name, seed, c.Policy, c.oneLine(), ms(c.Antagonist.P99))
			})
			cases = append(cases, cs...)
			if err != nil {
				runErr = fmt.Errorf("variant %s: %w", v.name, err)
				break
			}
		}
		rep.Cases = append(rep.Cases, cases...)
		if len(cases) > 0 {
			rep.Variants = append(rep.Variants, summarizeShared(v, cfg, pols, cases))
		}
		if runErr != nil {
			break
		}
	}
	rep.finish()
	if err := writeRun(rep, &rep.Notes, len(rep.Variants) > 0, out, cfg.jsonPath, runErr); err != nil {
		return nil, err
	}
	return rep, nil
}

// runSharedSeed starts the seed's backends and runs every policy once,
// the first at index first.
func runSharedSeed(ctx context.Context, cfg *sharedConfig, t tools, v sharedVariant, pols []sharedPolicy, first, seed int, dir string, each func(sharedCase)) ([]sharedCase, error) {
	var backends []*loadmodel.Backend
	defer func() {
		for _, b := range backends {
			b.Close()
		}
	}()
	for _, m := range sharedModels(seed) {
		b, err := loadmodel.StartBackend(m)
		if err != nil {
			return nil, err
		}
		backends = append(backends, b)
	}
	var cases []sharedCase
	for i := range pols {
		pol := pols[(first+i)%len(pols)]
		caseDir := filepath.Join(dir, fmt.Sprintf("seed%d-%s", seed, pol.key))
		c, err := runSharedCase(ctx, cfg, t, v, pol, seed, backends, caseDir)
		if err != nil {
			return cases, fmt.Errorf("%s, seed %d: %w", pol.key, seed, err)
		}
		cases = append(cases, c)
		each(c)
	}
	return cases, nil
}

// startNodes starts n Caddy nodes of pol in front of upstreams, at once,
// each in its own directory under dir; a node that fails to start (a port
// taken meanwhile) is tried again once. On error it stops those started.
func startNodes(ctx context.Context, t tools, pol policy, n int, dir string, upstreams []string) ([]*proxy, error) {
	nodes := make([]*proxy, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() {
			for attempt := range sharedStartAttempts {
				d := filepath.Join(dir, fmt.Sprintf("node%02d-%d", i+1, attempt))
				if errs[i] = os.MkdirAll(d, 0o755); errs[i] != nil {
					return
				}
				if nodes[i], errs[i] = startProxy(ctx, t, pol, d, upstreams, proxyOptions{}); errs[i] == nil || ctx.Err() != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, errors.Join(err, stopNodes(nodes))
	}
	return nodes, nil
}

// stopNodes stops every node, at once.
func stopNodes(nodes []*proxy) error {
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, p := range nodes {
		if p != nil {
			wg.Go(func() { errs[i] = p.stop() })
		}
	}
	wg.Wait()
	return errors.Join(errs...)
}

// nodesCPU returns the CPU time the nodes' processes used so far.
func nodesCPU(nodes []*proxy) (time.Duration, bool) {
	if !cpuSupported {
		return 0, false
	}
	pgids := make([]int, len(nodes))
	for i, p := range nodes {
		pgids[i] = p.proc.pid()
	}
	d, err := groupsCPU(pgids...)
	return d, err == nil
}

// runSharedCase measures one policy once: the nodes, each driven by its
// own client, and the antagonist, all at once.
func runSharedCase(ctx context.Context, cfg *sharedConfig, t tools, v sharedVariant, pol sharedPolicy, seed int, backends []*loadmodel.Backend, dir string) (sharedCase, error) {
	c := sharedCase{caseResult: caseResult{Scenario: v.name, Policy: pol.key, Seed: seed, OfferedRate: v.rate * float64(v.nodes)},
		Nodes: v.nodes, Reports: pol.reports}
	c.Notes = settleBackends(ctx, backends)
	for _, b := range backends {
		b.SetLoadReports(pol.reports)
		b.SetReportBehind(cfg.reportBehind)
	}
	if err := ctx.Err(); err != nil {
		return c, err
	}
	upstreams := make([]string, len(backends))
	for i, b := range backends {
		upstreams[i] = b.Addr()
	}
	probes0 := loadProbes(backends)
	nodes, err := startNodes(ctx, t, pol.policy, v.nodes, dir, upstreams)
	if err != nil {
		return c, err
	}
	defer func() { _ = stopNodes(nodes) }()

	ant := loadmodel.Antagonist{
		URL: backends[sharedAntagonized].URL(), Rate: antagonistRate(cfg.antagonistLoad),
		OnMin: v.onMin, OnMax: v.onMax, OffMin: v.offMin, OffMax: v.offMax,
		Seed: uint64(seed)*0x2545f4914f6cdd1d + 1, Timeout: cfg.timeout,
	}
	// At the start of the measured window (the first client's first
	// measured request): every backend's busy time, the nodes' CPU time
	// and the machine's CPU pressure. The clients' dispatchers only
	// signal it: reading /proc takes milliseconds they must not lose.
	var (
		once         sync.Once
		measuring    = make(chan struct{})
		measureStart time.Time
		busy0        = make([]time.Duration, len(backends))
		cpu0, psi0   time.Duration
		cpuOK, psiOK bool
		sampled      sync.WaitGroup
	)
	onMeasure := func() { once.Do(func() { measureStart = time.Now(); close(measuring) }) }
	sampled.Go(func() {
		select {
		case <-ctx.Done():
			return
		case <-measuring:
		}
		for i, b := range backends {
			busy0[i] = b.BusyTime()
		}
		cpu0, cpuOK = nodesCPU(nodes)
		psi0, psiOK = cpuPressure()
	})
	epoch := time.Now()
	for _, b := range backends {
		b.SetEpoch(epoch)
	}
	var antRes loadmodel.AntagonistResult
	var antErr error
	var antWG sync.WaitGroup
	antWG.Go(func() { antRes, antErr = ant.Run(ctx, cfg.warmup+cfg.duration) })

	// Each node's client starts a fraction of its interval after the one
	// before, so the nodes' requests interleave instead of arriving in
	// lockstep.
	results := make([]*loadmodel.Result, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() {
			offset := time.Duration(float64(i) * float64(time.Second) / v.rate / float64(len(nodes)))
			timer := time.NewTimer(offset)
			defer timer.Stop()
			select {
			case <-ctx.Done():
				errs[i] = ctx.Err()
				return
			case <-timer.C:
			}
			l := loadmodel.Load{URL: n.url, Rate: v.rate, Warmup: cfg.warmup, Duration: cfg.duration, Timeout: cfg.timeout, OnMeasure: onMeasure}
			results[i], errs[i] = l.Run(ctx)
		})
	}
	wg.Wait()
	onMeasure() // in case no client got as far (an error), so the sampler ends
	sampled.Wait()
	measured := time.Since(measureStart)
	busy1 := make([]time.Duration, len(backends))
	for i, b := range backends {
		busy1[i] = b.BusyTime()
	}
	cpu1, cpuOK1 := nodesCPU(nodes)
	psi1, psiOK1 := cpuPressure()
	antWG.Wait()
	c.HeldReports = -1
	if pol.caddyPolicy == "ewma" {
		c.LBXState = nodes[0].lbxState(ctx)
		c.HeldReports = heldReports(c.LBXState)
	}
	err = errors.Join(errors.Join(errs...), antErr, stopNodes(nodes))
	nodes = nil // stopped
	c.Probes = loadProbes(backends) - probes0
	if err != nil {
		return c, err
	}
	c.Antagonist = antRes

	merged := &loadmodel.Result{Window: cfg.duration}
	for _, r := range results {
		merged.Samples = append(merged.Samples, r.Samples...)
		merged.MaxSendLag = max(merged.MaxSendLag, r.MaxSendLag)
	}
	c.Summary = loadmodel.Summarize(merged)
	c.MaxSendLagMs = ms(merged.MaxSendLag)
	if cpuOK && cpuOK1 && c.Summary.Requests > 0 {
		us := float64(cpu1-cpu0) / float64(time.Microsecond) / float64(c.Summary.Requests)
		c.ProxyCPUus = &us
	}
	if psiOK && psiOK1 && measured > 0 {
		p := float64(psi1-psi0) / float64(measured)
		c.CPUPressure = &p
	}
	for i, b := range backends {
		br := backendResult{Name: b.Name(), Degraded: i == sharedAntagonized || i == sharedReduced, Counters: b.Counters(loadmodel.PhaseMeasure)}
		if measured > 0 {
			br.Utilization = float64(busy1[i]-busy0[i]) / (float64(b.Model().Workers) * float64(measured))
		}
		c.Backends = append(c.Backends, br)
	}
	c.Notes = append(c.Notes, sendLagNotes(merged.MaxSendLag)...)
	return c, nil
}

// summarizeShared aggregates a variant's cases per policy and evaluates
// the verdict.
func summarizeShared(v sharedVariant, cfg *sharedConfig, pols []sharedPolicy, cases []sharedCase) sharedSummary {
	s := sharedSummary{
		Name: v.name, Title: v.title, About: v.about, Nodes: v.nodes, RatePerNode: v.rate,
		AntagonistRate: antagonistRate(cfg.antagonistLoad),
		OnMin:          v.onMin.String(), OnMax: v.onMax.String(), OffMin: v.offMin.String(), OffMax: v.offMax.String(),
	}
	for _, m := range sharedModels(cfg.firstSeed) {
		m.Seed = 0 // differs per seed; the JSON cases have it
		s.Models = append(s.Models, m)
	}
	var psi []float64
	for _, p := range pols {
		var runs []caseResult
		var antP99, probeRate []float64
		held := -1
		for _, c := range cases {
			if c.Policy == p.key {
				runs = append(runs, c.caseResult)
				if c.HeldReports >= 0 && (held < 0 || c.HeldReports < held) {
					held = c.HeldReports
				}
				antP99 = append(antP99, ms(c.Antagonist.P99))
				probeRate = append(probeRate, float64(c.Probes)/(cfg.warmup+cfg.duration).Seconds())
				if c.CPUPressure != nil {
					psi = append(psi, *c.CPUPressure)
				}
				s.SendLagMaxMs = max(s.SendLagMaxMs, c.MaxSendLagMs)
			}
		}
		if len(runs) == 0 {
			continue
		}
		s.Rows = append(s.Rows, sharedRow{scenRow: aggregateRow(p.policy, runs, nil, nil), Reports: p.reports, Target: p.target,
			AntagonistP99: statOf(antP99), HeldReports: held, ProbeRate: statOf(probeRate)})
	}
	if len(psi) > 0 {
		st := statOf(psi)
		s.CPUPressure = &st
	}
	s.Verdicts = sharedVerdicts(v.notWorse, s.Rows)
	return s
}

// sharedVerdicts judges each target row (reports, probing): in a sparse
// variant, its p99 against half the best p99 of the other rows; in a
// dense one, against ewma without reports within the scenario classes'
// tolerance (max(1.1 ×, + 2 ms)).
func sharedVerdicts(notWorse bool, rows []sharedRow) []verdict {
	var out []verdict
	for _, r := range rows {
		if !r.Target {
			continue
		}
		name := r.Label + ": p99 ≤ best other ÷ 2"
		if notWorse {
			name = r.Label + ": p99 ≤ max(1.1 × ewma without reports, + 2 ms)"
			i := slices.IndexFunc(rows, func(x sharedRow) bool { return x.Policy == "ewma_noreports" })
			if i < 0 {
				out = append(out, missing(name, "ewma without reports did not run"))
				continue
			}
			base := rows[i].P99.Median
			out = append(out, compare(name, r.P99.Median, p99Limit(base), "≤", "ms", "ewma without reports "+fmtMs(base)))
			continue
		}
		var best *sharedRow
		for i := range rows {
			if x := &rows[i]; !x.Target && !math.IsNaN(x.P99.Median) && (best == nil || x.P99.Median < best.P99.Median) {
				best = x
			}
		}
		if best == nil {
			out = append(out, missing(name, "no other policy ran"))
			continue
		}
		out = append(out, compare(name, r.P99.Median, best.P99.Median/2, "≤", "ms",
			fmt.Sprintf("best other: %s %s", best.Label, fmtMs(best.P99.Median))))
	}
	return out
}

// writeMarkdown renders the report.
func (r *sharedReport) writeMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("# lbx: shared backends, sparse views (issue 27)\n\n")
	fmt.Fprintf(&b, "Command: `%s`\n\n", r.Command)
	fmt.Fprintf(&b, "Proxy under test: %s.\n\n", r.Source)
	r.runHeader.writeMarkdown(&b, "")
	writeVersions(&b, r.Versions, "go", "caddy")
	fmt.Fprintf(&b, "Load: every node is a Caddy process of its own with its own open-loop client; %s warm-up then %s measured per case, "+
		"%s client timeout (a timeout is an error and counts at its full duration); seeds %d–%d (a seed selects the backends' jitter and the antagonist's bursts; "+
		"every policy of a seed meets the same ones); policies run in turn, in an order rotated per seed. Tables show the median over seeds and [min–max]; "+
		"latency runs from each request's intended send time, over the requests of all nodes together.\n\n",
		r.Warmup, r.Duration, r.Timeout, r.FirstSeed, r.FirstSeed+r.Seeds-1)
	counted := "requests queued or in service, this one included, per worker"
	if r.ReportBehind {
		counted = "requests queued or in service that this one leaves behind, per worker (-report-count behind)"
	}
	fmt.Fprintf(&b, "Load reports: while on, every answer carries `Endpoint-Load-Metrics: TEXT application_utilization=<%s>, "+
		"rps_fractional=<answers in the last whole second>, eps=<failures in it>`, unsmoothed, and so does the answer to `GET %s`, a load probe. "+
		"lbx ewma reads it and strips it; stock least_conn ignores it and passes it on.\n\n", counted, loadmodel.LoadReportPath)
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "Note: %s.\n\n", n)
	}
	b.WriteString("## Summary\n\n| variant | policy | p50 | p99 | p99.9 | errors |\n|---|---|--:|--:|--:|--:|\n")
	for _, v := range r.Variants {
		for _, x := range v.Rows {
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", v.Name, x.Label, fmtMs(x.P50.Median), fmtMs(x.P99.Median), fmtMs(x.P999.Median), fmtPct(x.ErrorPct.Median))
		}
	}
	b.WriteString("\n")
	for _, v := range r.Variants {
		for _, vd := range v.Verdicts {
			fmt.Fprintf(&b, "- %s: %s\n", v.Name, vd)
		}
	}
	b.WriteString("\n")
	for _, v := range r.Variants {
		writeSharedVariant(&b, v, r.Cases)
	}
	b.WriteString("p99 differences under ~3 ms are noise on a shared 2-core VM; read the ranges.\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// writeSharedVariant renders one variant's section.
func writeSharedVariant(b *strings.Builder, v sharedSummary, cases []sharedCase) {
	fmt.Fprintf(b, "## %s — %s\n\n%s\n\n", v.Name, v.Title, v.About)
	total := v.RatePerNode * float64(v.Nodes)
	fmt.Fprintf(b, "Load: %d nodes × %g req/s = %g req/s; each node sends ≈%.1f req/s to each backend if it splits evenly. ",
		v.Nodes, v.RatePerNode, total, v.RatePerNode/float64(len(v.Models)))
	var names []string
	for _, m := range v.Models {
		names = append(names, fmt.Sprintf("%s %d × %v ±%.0f%%", m.Name, m.Workers, m.Service, 100*m.Jitter))
	}
	fmt.Fprintf(b, "Backends (workers × service, a sleep): %s. ", strings.Join(names, "; "))
	fmt.Fprintf(b, "Antagonist: %.0f req/s straight to b3 (%.1f × its capacity of ≈%.0f req/s) in bursts of %s–%s, pauses of %s–%s.\n\n",
		v.AntagonistRate, v.AntagonistRate/(sharedWorkers*cap4ms), sharedWorkers*cap4ms, v.OnMin, v.OnMax, v.OffMin, v.OffMax)
	b.WriteString("| policy | backends report | p50 | p99 | p99.9 | errors (median, max) | proxy CPU/request | antagonist's own p99 | reports node 1 held | load probes |\n")
	b.WriteString("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, x := range v.Rows {
		cpu := "—"
		if x.ProxyCPUus != nil {
			cpu = fmt.Sprintf("%.0f µs", *x.ProxyCPUus)
		}
		rep := "no"
		if x.Reports {
			rep = "yes"
		}
		held := "—"
		if x.HeldReports >= 0 {
			held = fmt.Sprintf("%d of %d", x.HeldReports, len(v.Models))
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s, %s | %s | %s | %s | %.0f/s |\n", x.Label, rep, fmtStat(x.P50, fmtMs), fmtStat(x.P99, fmtMs), fmtStat(x.P999, fmtMs),
			fmtPct(x.ErrorPct.Median), fmtPct(x.ErrorPct.Max), cpu, fmtStat(x.AntagonistP99, fmtMs), held, x.ProbeRate.Median)
	}
	b.WriteString("\nReports node 1 held: the upstreams for which the first node's lbx held a load report at the end of the window " +
		"(GET /lbx/upstreams; fewest over seeds): a check that the reports reached the proxy, not that it used them.\n")
	b.WriteString("\nPer backend (medians): share of the proxied requests that reached it · most requests it held at once · utilization (busy time, the antagonist's included, ÷ (workers × window)).\n\n")
	names = names[:0]
	for _, m := range v.Models {
		names = append(names, m.Name)
	}
	rows := make([]row, len(v.Rows))
	for i, x := range v.Rows {
		rows[i] = x.row
	}
	labelledBackendTable(b, names, map[string]string{
		names[sharedAntagonized]: "antagonist's", names[sharedReduced]: fmt.Sprintf("%d worker", sharedReducedWorkers),
	}, rows)
	if s := v.CPUPressure; s != nil {
		fmt.Fprintf(b, "\nCPU pressure (Linux PSI) during the measured windows: median %.0f%%, worst %.0f%%.", 100*s.Median, 100*s.Max)
		if s.Median > 0.5 {
			b.WriteString(" **The machine was short of CPU for most of the measurement; tails show CPU starvation as much as balancing.**")
		}
		b.WriteString("\n")
	}
	if len(v.Verdicts) > 0 {
		b.WriteString("\nVerdict (medians over seeds):\n\n")
		for _, vd := range v.Verdicts {
			b.WriteString("- " + vd.String() + "\n")
		}
	}
	plain := make([]caseResult, 0, len(cases))
	for _, c := range cases {
		plain = append(plain, c.caseResult)
	}
	writeCaseNotes(b, plain, v.Name, func(c caseResult) string { return fmt.Sprintf("seed %d", c.Seed) })
	b.WriteString("\n")
}
