// Command bench compares lbx's latency-aware `lb_policy ewma` with stock
// Caddy, nginx and HAProxy load balancing, side by side, under the same
// open-loop load on the same machine, and prints Markdown tables and the
// ratios of the project's performance targets.
//
// Usage, from the repository's root (integration/ is a module of its own,
// so the plugin's go.mod carries none of the harness's dependencies):
//
//	cd integration && go run ./bench [flags]
//	cd integration && go run ./bench -quick   # a smoke test of well under a minute
//	cd integration && go run ./bench rebalance [flags]   # the rebalance scale-out, with a plot
//	cd integration && go run ./bench scenarios [flags]   # the scenario classes of issues 11 and 24 (docs/benchmarks.md)
//	cd integration && go run ./bench hedge [flags]       # selective's backup requests under freezes
//	cd integration && go run ./bench poolcost [flags]    # a request's cost as a partition naming file grows to 200,000
//	cd integration && go run ./bench gossip [flags]      # load gossip through serf at 16 to 128+ members
//	cd integration && go run ./bench fleetsim [flags]    # the rebalance decision simulated on fleets of 100 to 1000+ nodes
//	cd integration && go run ./bench reload [flags]      # requests a config reload loses, stock Caddy and lbx side by side
//	cd integration && go run ./bench graceful -scenario scale-out|rolling-restart|reload [flags]  # clients that never retry (issue 23)
//	cd integration && go run ./bench shared [flags]      # shared backends, sparse views: 12 nodes, load reports (issue 27)
//	cd integration && go run ./bench shared -quick       # its smoke test, under a minute
//	cd integration && go run ./bench hash [flags]        # consistent hashing with bounded loads, side by side with uri_hash and HAProxy (issue 28)
//
// It builds ./cmd/caddy once, starts four HTTP backends in-process on
// 127.0.0.1 (see package loadmodel for their latency model: a fixed number
// of workers each, so overloaded backends queue), and for every scenario,
// run and policy starts a fresh load balancer as a child process in front
// of them, sends it a warm-up and then a measured window of constant-rate,
// open-loop load, and records latency from each request's intended send
// time, errors, each backend's share, and the proxy's CPU time.
//
// Scenarios: A, one of the four backends degraded; B, two degraded; C, all
// healthy (proxy overhead). A degraded backend serves about ten times
// slower than a healthy one and stalls for 50–100 ms every couple of
// seconds.
//
// Policies: ewma (lbx), round_robin, least_conn, random_choose_2 (stock
// Caddy), nginx (least_conn), haproxy (leastconn), and direct: the load a
// single healthy backend sees when only the healthy ones serve (the total
// rate divided by their number), sent to it with no proxy — the best a
// balancer could do. nginx and HAProxy are skipped, with a note, when their
// binaries are not in PATH.
//
// With -runs N the policies are run in turn within each run, in an order
// rotated from run to run, so drift on a noisy machine hits all of them,
// and every reported metric is the median over the runs.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch {
	case len(os.Args) > 1 && os.Args[1] == "rebalance":
		_, err = runRebalance(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "scenarios":
		_, err = runScenarios(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "poolcost":
		err = runPoolCost(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "hedge":
		err = runHedge(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "gossip":
		err = runGossip(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "reload":
		_, err = runReload(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "graceful":
		_, err = runGraceful(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "shared":
		_, err = runShared(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "hash":
		_, err = runHash(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "burn":
		err = runBurn(os.Args[2:], os.Stderr)
	case len(os.Args) > 1 && os.Args[1] == "fleetsim":
		err = runFleetsim(ctx, os.Args[2:], commandLine(os.Args), os.Stdout, os.Stderr)
	default:
		_, err = run(ctx, os.Args[1:], commandLine(os.Args), os.Stdout, os.Stderr)
	}
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// benchCommand runs this benchmark from the repository's root.
const benchCommand = "cd integration && go run ./bench"

// commandLine renders the command that started the benchmark, as the user
// would type it.
func commandLine(args []string) string {
	name := args[0]
	if strings.Contains(name, "go-build") || strings.HasPrefix(name, os.TempDir()) {
		name = benchCommand
	}
	parts := []string{name}
	for _, a := range args[1:] {
		if a == "" || strings.ContainsAny(a, " \t\n\"'\\$`*?&;|<>()") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		parts = append(parts, a)
	}
	return strings.Join(parts, " ")
}

// config is the benchmark's configuration, from flags.
type config struct {
	rate      float64
	warmup    time.Duration
	duration  time.Duration
	timeout   time.Duration
	runs      int
	scenarios []scenario
	policies  []policy
	quick     bool
	jsonPath  string
	caddyBin  string

	fast, slow loadmodel.Model // the healthy and the degraded backend
}

// Defaults. The rate is chosen for the shared 2-core machines the project
// is measured on. A healthy backend (2 workers, 2 ms ±25% per request,
// ≈2.3 ms as Go's timers go) serves up to ≈850 req/s; a degraded one
// (2 workers, ≈20 ms, plus stalls) ≈95 req/s. At 800 req/s:
//
//   - a round-robin quarter share, 200 req/s, is twice what a degraded
//     backend can serve, so round robin builds a queue there that ends in
//     timeouts;
//   - least-connections-style policies keep a request or two on a
//     degraded backend most of the time (≈50 req/s, 6–8% of the load),
//     each taking ≥20 ms, so their p99 is ≥20 ms;
//   - a policy that avoids the degraded backends runs the healthy ones at
//     ≈35% (scenario A, three of them) and ≈50% (scenario B, two);
//   - the CPU cost, ≈0.5 ms per request in Caddy and ≈0.3 ms in this
//     process (client and backends), is about two thirds of one core,
//     leaving headroom on two. Much more and the benchmark measures CPU
//     contention — on a busy machine it can tip into a backlog that never
//     drains — rather than balancing.
//
// With -workers 1 -rate 650 the healthy backends of scenario A run at
// ≈50%, at the price of ≈75% in scenario B, which makes B fragile on a
// noisy machine.
const (
	defaultRate        = 800
	defaultWarmup      = 3 * time.Second
	defaultDuration    = 10 * time.Second
	defaultRuns        = 3
	defaultTimeout     = 2 * time.Second
	defaultFastService = 2 * time.Millisecond
	defaultSlowFactor  = 10
	defaultWorkers     = 2
)

// parseFlags reads the configuration from args.
func parseFlags(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" [flags]\n\n"+
			"Compares lbx's lb_policy ewma with stock Caddy, nginx and HAProxy\n"+
			"under open-loop load; prints Markdown tables.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &config{}
	var scen, pols string
	var fastSvc, slowSvc, freezeEvery, freezeMin, freezeMax time.Duration
	var fastWorkers, slowWorkers int
	var jitter float64
	fs.Float64Var(&c.rate, "rate", defaultRate, "offered load through the proxy, requests per second")
	fs.DurationVar(&c.warmup, "warmup", defaultWarmup, "unmeasured warm-up at the same rate before each measured window")
	fs.DurationVar(&c.duration, "duration", defaultDuration, "measured window per case")
	fs.DurationVar(&c.timeout, "timeout", defaultTimeout, "per-request client timeout; a timeout is an error, counted at its full duration")
	fs.IntVar(&c.runs, "runs", defaultRuns, "runs per case; the report shows the median of each metric")
	fs.StringVar(&scen, "scenarios", "A,B,C", "scenarios: A (1 of 4 backends degraded), B (2 of 4), C (none)")
	fs.StringVar(&pols, "policies", strings.Join(policyKeys(), ","), "policies to compare")
	fs.BoolVar(&c.quick, "quick", false, "smoke test: scenario A, ewma and least_conn, 400 req/s, 1s warm-up, 3s window, 1 run (flags given explicitly still win)")
	fs.StringVar(&c.jsonPath, "json", "", "also write raw and aggregated results as JSON to this file")
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.DurationVar(&fastSvc, "service", defaultFastService, "mean service time of a healthy backend")
	fs.DurationVar(&slowSvc, "slow-service", defaultSlowFactor*defaultFastService, "mean service time of a degraded backend")
	fs.IntVar(&fastWorkers, "workers", defaultWorkers, "requests a healthy backend serves at once; more queue")
	fs.IntVar(&slowWorkers, "slow-workers", defaultWorkers, "requests a degraded backend serves at once; more queue")
	fs.Float64Var(&jitter, "jitter", 0.25, "service times are uniform in mean × [1−jitter, 1+jitter]")
	fs.DurationVar(&freezeEvery, "freeze-every", 2*time.Second, "a degraded backend stalls once in every period of this length (0: never)")
	fs.DurationVar(&freezeMin, "freeze-min", 50*time.Millisecond, "shortest stall of a degraded backend")
	fs.DurationVar(&freezeMax, "freeze-max", 100*time.Millisecond, "longest stall of a degraded backend")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if c.quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["scenarios"] {
			scen = "A"
		}
		if !set["rate"] {
			c.rate = 400 // light enough for a busy CI machine
		}
		if !set["policies"] {
			pols = "ewma,least_conn"
		}
		if !set["warmup"] {
			c.warmup = time.Second
		}
		if !set["duration"] {
			c.duration = 3 * time.Second
		}
		if !set["runs"] {
			c.runs = 1
		}
	}
	var err error
	if c.scenarios, err = parseScenarios(scen); err != nil {
		return nil, err
	}
	if c.policies, err = parsePolicies(pols); err != nil {
		return nil, err
	}
	switch {
	case !(c.rate > 0):
		return nil, fmt.Errorf("-rate must be positive, got %v", c.rate)
	case c.duration <= 0:
		return nil, fmt.Errorf("-duration must be positive, got %v", c.duration)
	case c.warmup < 0:
		return nil, fmt.Errorf("-warmup must not be negative, got %v", c.warmup)
	case c.timeout <= 0:
		return nil, fmt.Errorf("-timeout must be positive, got %v", c.timeout)
	case c.runs < 1:
		return nil, fmt.Errorf("-runs must be at least 1, got %d", c.runs)
	}
	c.fast = loadmodel.Model{Workers: fastWorkers, Service: fastSvc, Jitter: jitter}
	c.slow = loadmodel.Model{Workers: slowWorkers, Service: slowSvc, Jitter: jitter,
		Freeze: loadmodel.Freeze{Every: freezeEvery, Min: freezeMin, Max: freezeMax}}
	for _, m := range []loadmodel.Model{c.fast, c.slow} {
		m.Name = "check"
		if err := m.Validate(); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// scenario is a set of backends: four, the last degraded of which are slow
// and stall.
type scenario struct {
	name     string
	title    string
	degraded int
}

var allScenarios = []scenario{
	{name: "A", title: "1 of 4 backends degraded", degraded: 1},
	{name: "B", title: "2 of 4 backends degraded", degraded: 2},
	{name: "C", title: "all 4 backends healthy (proxy overhead)", degraded: 0},
}

const numBackends = 4

func (s scenario) healthy() int { return numBackends - s.degraded }

func parseScenarios(list string) ([]scenario, error) {
	var out []scenario
	seen := map[string]bool{}
	for _, name := range strings.Split(list, ",") {
		name = strings.ToUpper(strings.TrimSpace(name))
		if name == "" || seen[name] {
			continue
		}
		seen[name] = true
		found := false
		for _, s := range allScenarios {
			if s.name == name {
				out = append(out, s)
				found = true
			}
		}
		if !found {
			return nil, fmt.Errorf("unknown scenario %q (known: A, B, C)", name)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no scenario selected")
	}
	return out, nil
}

// proxyKind is what serves a policy.
type proxyKind int

const (
	kindCaddy proxyKind = iota
	kindNginx
	kindHAProxy
	kindDirect
)

// policy is one contender.
type policy struct {
	key         string // name in -policies and JSON
	label       string // name in tables
	kind        proxyKind
	caddyPolicy string // lb_policy arguments, for kindCaddy
	// leastConnStyle marks the stock least-connections-style policies
	// the tail-latency target compares against.
	leastConnStyle bool
	// weights marks the policies that take per-upstream weights.
	weights bool
	// selective puts the reverse_proxy in one group of a selective
	// handler; backup adds its backup_request (bench hedge).
	selective, backup bool
	// groups splits the upstreams of a selective into that many groups
	// of consecutive upstreams, each its own reverse_proxy (0 or 1: one
	// group of all). An empty caddyPolicy writes no lb_policy, the form
	// users write first.
	groups int
	// backupAuto writes `backup_request auto` instead of a duration.
	backupAuto bool
	// options are lines of the lb_policy block (Caddy policies), after
	// any weights; for HAProxy, the lines of its backend that choose a
	// server, instead of balance leastconn.
	options []string
}

var allPolicies = []policy{
	{key: "ewma", label: "lbx ewma", kind: kindCaddy, caddyPolicy: "ewma", weights: true},
	{key: "round_robin", label: "Caddy round_robin", kind: kindCaddy, caddyPolicy: "round_robin"},
	{key: "least_conn", label: "Caddy least_conn", kind: kindCaddy, caddyPolicy: "least_conn", leastConnStyle: true},
	{key: "random_choose_2", label: "Caddy random_choose 2", kind: kindCaddy, caddyPolicy: "random_choose 2", leastConnStyle: true},
	{key: "nginx", label: "nginx least_conn", kind: kindNginx, leastConnStyle: true, weights: true},
	{key: "haproxy", label: "HAProxy leastconn", kind: kindHAProxy, leastConnStyle: true, weights: true},
	{key: "direct", label: "direct (1 healthy backend)", kind: kindDirect},
}

// policyAliases are other accepted spellings in -policies.
var policyAliases = map[string]string{
	"random_choose2":    "random_choose_2",
	"random_choose":     "random_choose_2",
	"nginx_least_conn":  "nginx",
	"haproxy_leastconn": "haproxy",
	"lbx_ewma":          "ewma",
}

func policyKeys() []string {
	keys := make([]string, len(allPolicies))
	for i, p := range allPolicies {
		keys[i] = p.key
	}
	return keys
}

func policyByKey(key string) (policy, bool) {
	if k, ok := policyAliases[key]; ok {
		key = k
	}
	for _, p := range allPolicies {
		if p.key == key {
			return p, true
		}
	}
	return policy{}, false
}

func parsePolicies(list string) ([]policy, error) {
	var out []policy
	seen := map[string]bool{}
	for _, key := range strings.Split(list, ",") {
		key = strings.ToLower(strings.TrimSpace(key))
		if key == "" {
			continue
		}
		p, ok := policyByKey(key)
		if !ok {
			return nil, fmt.Errorf("unknown policy %q (known: %s)", key, strings.Join(policyKeys(), ", "))
		}
		if !seen[p.key] {
			seen[p.key] = true
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no policy selected")
	}
	return out, nil
}

// lbxModule is the module path of the plugin this benchmark measures.
const lbxModule = "github.com/caddy-lbx/lbx"

// moduleRoot returns the directory of the lbx module: the plugin's, where
// ./cmd/caddy is built and relative output paths start, not that of the
// nested module this benchmark belongs to.
func moduleRoot(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", lbxModule).Output()
	if err == nil {
		if dir := strings.TrimSpace(string(out)); dir != "" {
			return dir, nil
		}
	}
	// Without the go command (a binary given with -caddy) the checkout is
	// found by its go.mod.
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for range 64 { // bounded walk up to the file system root
		if declaresModule(filepath.Join(dir, "go.mod"), lbxModule) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			break
		}
		dir = parent
	}
	return "", errors.New("cannot find the lbx module's root (its go.mod); run from inside an lbx checkout")
}

// declaresModule reports whether the go.mod file gomod declares module.
func declaresModule(gomod, module string) bool {
	data, err := os.ReadFile(gomod)
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(data)) {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" && strings.Trim(f[1], `"`) == module {
			return true
		}
	}
	return false
}

// caddyBinary returns the lbx Caddy binary a benchmark runs, and where it
// came from: given (a -caddy flag) when set, else ./cmd/caddy of the lbx
// module built into dir.
func caddyBinary(ctx context.Context, given, dir string, progress io.Writer) (bin, source string, err error) {
	if given != "" {
		return given, "Caddy binary given with -caddy", nil
	}
	root, err := moduleRoot(ctx)
	if err != nil {
		return "", "", err
	}
	if bin, err = buildCaddy(ctx, root, dir, progress); err != nil {
		return "", "", err
	}
	return bin, "./cmd/caddy built from " + gitState(ctx, root), nil
}

// buildCaddy builds ./cmd/caddy of the module at root into dir and
// returns the binary's path.
func buildCaddy(ctx context.Context, root, dir string, progress io.Writer) (string, error) {
	bin := filepath.Join(dir, "caddy")
	fmt.Fprintf(progress, "building ./cmd/caddy in %s …\n", root)
	if err := fleet.BuildCaddy(ctx, root, bin); err != nil {
		return "", err
	}
	return bin, nil
}

// gitState describes the source tree at root: its commit, and whether
// files (outside this benchmark's own directories) have uncommitted changes.
func gitState(ctx context.Context, root string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	head, err := exec.CommandContext(ctx, "git", "-C", root, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "the source tree at " + root + " (not a git checkout)"
	}
	state := "commit " + strings.TrimSpace(string(head))
	st, err := exec.CommandContext(ctx, "git", "-C", root, "status", "--porcelain", "--untracked-files=no").Output()
	if err != nil {
		return state
	}
	var dirty []string
	for line := range strings.Lines(string(st)) {
		if len(line) > 3 && !strings.HasPrefix(line[3:], "integration/") {
			dirty = append(dirty, strings.TrimSpace(line[3:]))
		}
	}
	if len(dirty) > 0 {
		state += " with uncommitted changes to " + strings.Join(dirty, ", ")
	}
	return state
}

// toolVersion returns the first line of a tool's version output.
func toolVersion(ctx context.Context, bin string, args ...string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return "unknown"
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return strings.TrimSpace(line)
}
