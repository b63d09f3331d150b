package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// gracefulConfig is the configuration of `bench graceful`.
type gracefulConfig struct {
	scenario           string
	caddyBin, stockBin string
	runs               int
	mix                fleet.NoRetryMix
	// fronts are the outer balancers of scale-out and rolling-restart.
	fronts []string
	// builds are what reload reloads: buildStock, buildLbx, buildHandoff.
	builds   []string
	converge time.Duration
	settings fleet.Settings
	nodes    int
	down     time.Duration
	reloads  int
	gap      time.Duration
	// burn is the busy goroutines of the competing process (0: none).
	burn  int
	quick bool
}

// The scenarios of `bench graceful`.
const (
	gracefulScaleOut = "scale-out"
	gracefulRolling  = "rolling-restart"
	gracefulReload   = "reload"
)

func parseGracefulFlags(args []string, stderr io.Writer) (*gracefulConfig, error) {
	fs := flag.NewFlagSet("bench graceful", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" graceful -scenario scale-out|rolling-restart|reload [flags]\n\n"+
			"Issue 23's acceptance runs, with keep-alive clients that never retry: Go clients\n"+
			"on a raw connection (GET, and POST), and Python's http.client (POST), each\n"+
			"request with its own id, counted by the backend the nodes proxy to.\n"+
			"  scale-out: 3 nodes, then 3 more join (bench rebalance's phase 1), behind each -front;\n"+
			"  rolling-restart: every node of -nodes drained, down for -down, started again;\n"+
			"  reload: -reloads config reloads of one node, for each of -builds.\n"+
			"Prints, per run, the failures by kind, the requests lost (sent, no response) and\n"+
			"duplicated (served twice), and the shed total against the ideal; then the medians.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &gracefulConfig{}
	var fronts, builds string
	fs.StringVar(&c.scenario, "scenario", gracefulScaleOut, "scale-out, rolling-restart or reload")
	fs.BoolVar(&c.quick, "quick", false, "a short run: 1 run, 30 clients of each kind (12 for reload), every 500ms; scale-out behind random only; rolling-restart of 3 nodes down 1s; 10 reloads (flags given explicitly still win)")
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.StringVar(&c.stockBin, "stock", "", "reload: use this stock Caddy binary instead of building the version lbx requires")
	fs.IntVar(&c.runs, "runs", 3, "runs; the summary shows the median of each count")
	fs.IntVar(&c.mix.GET, "get", 400, "Go raw-connection clients sending GET (reload: 16)")
	fs.IntVar(&c.mix.POST, "post", 400, "Go raw-connection clients sending POST (reload: 64)")
	fs.IntVar(&c.mix.Python, "python", 200, "Python http.client clients sending POST, threads of one python3 process (reload: 16)")
	fs.DurationVar(&c.mix.Every, "every", 500*time.Millisecond, "each client's request period")
	fs.DurationVar(&c.mix.Timeout, "timeout", 10*time.Second, "each request's timeout")
	fs.DurationVar(&c.mix.BodyDelay, "body-delay", 0, "the Go POST clients write each request's headers, wait this long, then its body (0: at once)")
	fs.StringVar(&fronts, "front", fleet.FrontRandom+","+fleet.FrontRoundRobin, "scale-out, rolling-restart: the outer balancers, comma-separated, of "+strings.Join(fleet.FrontNames, ", "))
	fs.StringVar(&builds, "builds", strings.Join([]string{buildStock, buildLbx, buildHandoff}, ","), "reload: the builds, comma-separated: stock Caddy, lbx (a node without lbx_handoff), lbx_handoff")
	fs.DurationVar(&c.converge, "converge", 90*time.Second, "the longest wait for the fleet to converge")
	fs.IntVar(&c.nodes, "nodes", 6, "rolling-restart: the fleet's size (2 to 12)")
	fs.DurationVar(&c.down, "down", 2*time.Second, "rolling-restart: how long each node stays stopped")
	fs.IntVar(&c.reloads, "reloads", 100, "reload: reloads per build and run")
	fs.DurationVar(&c.gap, "gap", 300*time.Millisecond, "reload: time between reloads")
	fs.IntVar(&c.burn, "burn", 0, "saturate the CPU: a child process with this many busy-looping goroutines for the whole run, stopped at the end (0: none)")
	fs.StringVar(&c.settings.ShutdownDelay, "shutdown-delay", "2s", "rolling-restart: each node's shutdown_delay, during which its responses say Connection: close (empty: none, Caddy closes the idle connections at once)")
	fs.StringVar(&c.settings.Interval, "interval", "200ms", "rebalance interval")
	fs.StringVar(&c.settings.History, "history", "1s", "rebalance history")
	fs.StringVar(&c.settings.Freshness, "freshness", "1s", "rebalance freshness")
	fs.Float64Var(&c.settings.Threshold, "threshold", 20, "rebalance threshold, percent")
	fs.Float64Var(&c.settings.ShedRate, "shed-rate", 5, "rebalance shed_rate, percent per interval")
	fs.IntVar(&c.settings.MinConnections, "min-connections", 5, "rebalance min_connections")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if c.scenario == gracefulReload && !c.quick {
		// One node takes the whole load: about 190 requests a second, as
		// many as issue 23's storm sent.
		for name, v := range map[string]*int{"get": &c.mix.GET, "post": &c.mix.POST, "python": &c.mix.Python} {
			if !set[name] {
				*v = map[string]int{"get": 16, "post": 64, "python": 16}[name]
			}
		}
	}
	if c.quick {
		perKind := 30
		if c.scenario == gracefulReload {
			perKind = 12
		}
		for name, v := range map[string]*int{"get": &c.mix.GET, "post": &c.mix.POST, "python": &c.mix.Python} {
			if !set[name] {
				*v = perKind
			}
		}
		defaults := map[string]func(){
			"runs":    func() { c.runs = 1 },
			"front":   func() { fronts = fleet.FrontRandom },
			"nodes":   func() { c.nodes = 3 },
			"down":    func() { c.down = time.Second },
			"reloads": func() { c.reloads = 10 },
		}
		for name, f := range defaults {
			if !set[name] {
				f()
			}
		}
	}
	for f := range strings.SplitSeq(fronts, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		if err := fleet.CheckFront(f); err != nil {
			return nil, fmt.Errorf("-front: %v", err)
		}
		c.fronts = append(c.fronts, f)
	}
	for b := range strings.SplitSeq(builds, ",") {
		if b = strings.TrimSpace(b); b == "" {
			continue
		}
		if b != buildStock && b != buildLbx && b != buildHandoff {
			return nil, fmt.Errorf("-builds: unknown build %q; want %q, %q or %q", b, buildStock, buildLbx, buildHandoff)
		}
		c.builds = append(c.builds, b)
	}
	total := c.mix.Total()
	switch {
	case c.scenario != gracefulScaleOut && c.scenario != gracefulRolling && c.scenario != gracefulReload:
		return nil, fmt.Errorf("-scenario %q: want %s, %s or %s", c.scenario, gracefulScaleOut, gracefulRolling, gracefulReload)
	case c.runs < 1 || c.runs > 100:
		return nil, fmt.Errorf("-runs %d: want 1 to 100", c.runs)
	case c.mix.GET < 0 || c.mix.POST < 0 || c.mix.Python < 0:
		return nil, fmt.Errorf("-get %d, -post %d, -python %d: none may be negative", c.mix.GET, c.mix.POST, c.mix.Python)
	case total > 5000:
		return nil, fmt.Errorf("-get + -post + -python = %d: want at most 5000", total)
	case c.scenario == gracefulScaleOut && total < 60:
		return nil, fmt.Errorf("-get + -post + -python = %d: the scale-out wants at least 60 (10 per node at 6 nodes)", total)
	case c.scenario == gracefulRolling && total < 10*c.nodes:
		return nil, fmt.Errorf("-get + -post + -python = %d: the rolling restart wants at least 10 per node (%d)", total, 10*c.nodes)
	case total < 1:
		return nil, errors.New("no clients: set -get, -post or -python")
	case c.mix.Every < 10*time.Millisecond || c.mix.Every > time.Minute:
		return nil, fmt.Errorf("-every %v: want 10ms to 1m", c.mix.Every)
	case c.mix.Timeout < 100*time.Millisecond || c.mix.Timeout > 5*time.Minute:
		return nil, fmt.Errorf("-timeout %v: want 100ms to 5m", c.mix.Timeout)
	case c.scenario != gracefulReload && len(c.fronts) == 0:
		return nil, errors.New("-front: no balancer given")
	case c.scenario == gracefulReload && len(c.builds) == 0:
		return nil, errors.New("-builds: no build given")
	case c.converge <= 0:
		return nil, fmt.Errorf("-converge must be positive, got %v", c.converge)
	case c.nodes < 2 || c.nodes > 12:
		return nil, fmt.Errorf("-nodes %d: want 2 to 12", c.nodes)
	case c.down < 0 || c.down > 10*time.Minute:
		return nil, fmt.Errorf("-down %v: want 0 to 10m", c.down)
	case c.reloads < 1 || c.reloads > 1000:
		return nil, fmt.Errorf("-reloads %d: want 1 to 1000", c.reloads)
	case c.gap < 50*time.Millisecond || c.gap > time.Minute:
		return nil, fmt.Errorf("-gap %v: want 50ms to 1m", c.gap)
	case c.mix.BodyDelay < 0 || c.mix.BodyDelay >= c.mix.Timeout:
		return nil, fmt.Errorf("-body-delay %v: want 0 up to -timeout (%v)", c.mix.BodyDelay, c.mix.Timeout)
	case c.burn < 0 || c.burn > 64:
		return nil, fmt.Errorf("-burn %d: want 0 to 64 busy goroutines", c.burn)
	}
	return c, nil
}

// gracefulRow is one kind of client's count in one group (a front, or a
// build) of one run; client "all" sums the group, and carries its shed
// total and ideal.
type gracefulRow struct {
	Group, Client                     string
	Clients, Requests, Failed, Reused int
	// Stale is the failures whose reused connection had closed before the
	// request was written (fleet.RawResult.Stale).
	Stale                     int
	Kinds                     map[string]int
	Lost, Reached, Duplicated int
	// Shed and Ideal are the connections shed and a perfect rebalancer's
	// median count; Ideal is negative where nothing is shed (reload).
	Shed  int
	Ideal float64
}

// gracefulRun is one run's rows, its failures' samples, and notes on
// when the failures came.
type gracefulRun struct {
	Rows           []gracefulRow
	Samples, Notes []string
}

// runGraceful is `bench graceful`; it returns each run.
func runGraceful(ctx context.Context, args []string, cmdline string, out, progress io.Writer) ([]gracefulRun, error) {
	cfg, err := parseGracefulFlags(args, progress)
	if err != nil {
		return nil, err
	}
	for _, f := range cfg.fronts {
		if err := fleet.FrontAvailable(f); err != nil && cfg.scenario != gracefulReload {
			return nil, fmt.Errorf("-front %s: %w", f, err)
		}
	}
	tmp, err := os.MkdirTemp("", "lbx-bench-graceful-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	bin, source, err := caddyBinary(ctx, cfg.caddyBin, tmp, progress)
	if err != nil {
		return nil, err
	}
	stockBin := cfg.stockBin
	if cfg.scenario == gracefulReload && stockBin == "" && slices.Contains(cfg.builds, buildStock) {
		root, err := moduleRoot(ctx)
		if err != nil {
			return nil, err
		}
		stockBin = filepath.Join(tmp, "stock-caddy")
		fmt.Fprintf(progress, "building stock Caddy …\n")
		if err := fleet.BuildStockCaddy(ctx, root, stockBin); err != nil {
			return nil, err
		}
	}
	burnNote := "no competing process"
	if cfg.burn > 0 {
		stop, err := startBurn(cfg.burn)
		if err != nil {
			return nil, err
		}
		defer stop()
		burnNote = fmt.Sprintf("a competing process with %d busy-looping goroutines (-burn)", cfg.burn)
	}
	m := cfg.mix
	bodyNote := ""
	if m.BodyDelay > 0 {
		bodyNote = fmt.Sprintf(", the Go POSTs' bodies %v after their headers", m.BodyDelay)
	}
	fmt.Fprintf(out, "# No-retry clients: %s\n\n`%s`; %s; %d Go raw GET, %d Go raw POST and %d Python http.client POST keep-alive clients, a request every %v each (timeout %v%s); %s; load average %s at the start.\n\n",
		cfg.scenario, cmdline, source, m.GET, m.POST, m.Python, m.Every, m.Timeout, bodyNote, burnNote, loadAverage())

	var runs []gracefulRun
	for i := range cfg.runs {
		if ctx.Err() != nil {
			return runs, ctx.Err()
		}
		var run gracefulRun
		groups := cfg.fronts
		if cfg.scenario == gracefulReload {
			groups = cfg.builds
		}
		// Groups in an order that rotates from run to run, so drift on a
		// noisy machine hits all of them; the table keeps the given order.
		for _, g := range append(slices.Clone(groups[i%len(groups):]), groups[:i%len(groups)]...) {
			fmt.Fprintf(progress, "run %d of %d: %s …\n", i+1, cfg.runs, g)
			dir := filepath.Join(tmp, fmt.Sprintf("run%d-%s", i+1, strings.ReplaceAll(g, " ", "-")))
			rows, samples, note, err := gracefulGroup(ctx, cfg, bin, stockBin, dir, g, progress)
			if err != nil {
				return runs, fmt.Errorf("run %d, %s: %w", i+1, g, err)
			}
			run.Rows = append(run.Rows, rows...)
			run.Samples = append(run.Samples, samples...)
			if note != "" {
				run.Notes = append(run.Notes, note)
			}
		}
		slices.SortStableFunc(run.Rows, func(a, b gracefulRow) int {
			return slices.Index(groups, a.Group) - slices.Index(groups, b.Group)
		})
		runs = append(runs, run)
		fmt.Fprintf(out, "**Run %d**\n\n", i+1)
		writeGracefulTable(out, cfg.scenario, run.Rows)
		for _, n := range run.Notes {
			fmt.Fprintf(out, "%s\n\n", n)
		}
		if len(run.Samples) > 0 {
			fmt.Fprintf(out, "Failures, first of each kind of client: %s\n\n", strings.Join(run.Samples, "; "))
		}
	}
	if len(runs) > 1 {
		fmt.Fprintf(out, "**Medians over %d runs**\n\n", len(runs))
		writeGracefulTable(out, cfg.scenario, medianGracefulRows(runs))
	}
	return runs, nil
}

// gracefulGroup runs one group of one run: a scale-out or a rolling
// restart behind the front g, or the reloads of build g, with a NoRetry
// load through a Backend that counts the ids. A rolling restart's note
// says how many failures came while a node drained or was down.
func gracefulGroup(ctx context.Context, cfg *gracefulConfig, bin, stockBin, dir, g string, progress io.Writer) (rows []gracefulRow, samples []string, note string, err error) {
	backend, err := fleet.StartBackend()
	if err != nil {
		return nil, nil, "", err
	}
	defer backend.Close()
	var load *fleet.NoRetry
	start := func(addr string) (fleet.Load, error) {
		n, err := fleet.StartNoRetry(addr, cfg.mix)
		if err != nil {
			return nil, err
		}
		load = n
		return n, nil
	}
	logf := func(format string, args ...any) { fmt.Fprintf(progress, "  "+format+"\n", args...) }
	settings := cfg.settings
	settings.Backend = backend.Addr
	shed, ideal := 0, -1.0
	switch cfg.scenario {
	case gracefulScaleOut:
		res, err := fleet.ScaleOut{
			Bin: bin, Dir: dir, Clients: cfg.mix.Total(), Every: cfg.mix.Every, Settings: settings, Converge: cfg.converge,
			Front: g, StartLoad: start, Phase1Only: true, Logf: logf,
		}.Run()
		if err != nil {
			return nil, nil, "", err
		}
		shed, ideal = res.Shed, res.Ideal
	case gracefulRolling:
		res, err := fleet.RollingRestart{
			Bin: bin, Dir: dir, Nodes: cfg.nodes, Clients: cfg.mix.Total(), Every: cfg.mix.Every, Down: cfg.down,
			Settings: settings, Converge: cfg.converge, Front: g, StartLoad: start, Logf: logf,
		}.Run()
		if err != nil {
			return nil, nil, "", err
		}
		ideal = 0
		for _, r := range res.Restarts {
			shed, ideal = shed+r.Shed, ideal+r.Ideal
		}
		defer func() {
			if load != nil {
				_, errs, _ := load.Stats()
				note = drainNote(g, errs, res.Restarts, cfg.mix.Every)
			}
		}()
	case gracefulReload:
		if err := gracefulReloads(ctx, cfg, bin, stockBin, dir, g, backend.Addr, start); err != nil {
			if load != nil {
				load.Close()
			}
			return nil, nil, "", err
		}
	}
	if load == nil {
		return nil, nil, "", errors.New("the clients never started")
	}
	load.Close() // a no-op when the run closed it
	rows, samples = gracefulRows(g, load.Tallies(), backend.Counter)
	rows[len(rows)-1].Shed, rows[len(rows)-1].Ideal = shed, ideal
	return rows, samples, "", nil
}

// drainNote says how many of errs came while a node of restarts drained
// or was down: from its SIGTERM to one request period after it started
// again (a client finds its closed connection at its next request).
func drainNote(front string, errs []fleet.ClientError, restarts []fleet.RestartResult, every time.Duration) string {
	down := 0
	for _, e := range errs {
		for _, r := range restarts {
			if !e.At.Before(r.Stopped) && !e.At.After(r.Started.Add(every)) {
				down++
				break
			}
		}
	}
	return fmt.Sprintf("%s: %d of the %d failures came while a node drained or was down (from its SIGTERM to %v after its restart); the others while the fleet refilled it.",
		front, down, len(errs), every)
}

// gracefulReloads starts build's node proxying to backend, the clients
// (start), and reloads the node cfg.reloads times, cfg.gap apart; it
// stops the clients, then the node.
func gracefulReloads(ctx context.Context, cfg *gracefulConfig, bin, stockBin, dir, build, backend string, start func(string) (fleet.Load, error)) error {
	handler := "reverse_proxy " + backend
	var target *reloadTarget
	var err error
	switch build {
	case buildLbx:
		target, err = startLbxReloadTarget(bin, dir, backend)
	case buildHandoff:
		target, err = startStockReloadTarget(bin, dir, false, "\tservers {\n\t\tlistener_wrappers {\n\t\t\tlbx_handoff\n\t\t}\n\t}\n", handler)
	default:
		target, err = startStockReloadTarget(stockBin, dir, false, "", handler)
	}
	if err != nil {
		return err
	}
	defer target.node.Proc.Kill()
	load, err := start(target.node.HTTP)
	if err != nil {
		return err
	}
	defer load.Close() // before the node is killed
	// Every client holds its connection before the first reload.
	deadline := time.Now().Add(30 * time.Second)
	for load.Opened() < int64(cfg.mix.Total()) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d clients connected after 30s", load.Opened(), cfg.mix.Total())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for gen := 1; gen <= cfg.reloads && err == nil && ctx.Err() == nil; gen++ {
		err = target.reload(gen)
		time.Sleep(cfg.gap)
	}
	return errors.Join(err, ctx.Err())
}

// gracefulRows turns the tallies into rows of group g, and an "all" row,
// checking each kind's ids against the backend's count; it also returns
// the first failure of each kind of client.
func gracefulRows(g string, tallies []fleet.Tally, ctr *fleet.IDCounter) ([]gracefulRow, []string) {
	all := gracefulRow{Group: g, Client: "all", Kinds: map[string]int{}}
	var rows []gracefulRow
	var samples []string
	for _, t := range tallies {
		check := ctr.Check(t.Prefix, t.Lost)
		r := gracefulRow{Group: g, Client: t.Client, Clients: t.Clients, Requests: t.Requests, Failed: t.Failed(),
			Reused: t.Reused, Stale: t.Stale, Kinds: t.Failures, Lost: check.Lost, Reached: check.Reached, Duplicated: check.Duplicated}
		rows = append(rows, r)
		all.Clients, all.Requests, all.Failed, all.Reused = all.Clients+r.Clients, all.Requests+r.Requests, all.Failed+r.Failed, all.Reused+r.Reused
		all.Stale += r.Stale
		all.Lost, all.Reached, all.Duplicated = all.Lost+r.Lost, all.Reached+r.Reached, all.Duplicated+r.Duplicated
		for k, v := range r.Kinds {
			all.Kinds[k] += v
		}
		if len(t.Samples) > 0 {
			samples = append(samples, fmt.Sprintf("%s, %s: %s", g, t.Client, t.Samples[0]))
		}
	}
	return append(rows, all), samples
}

// gracefulOther are the failure kinds a report sums as "other".
var gracefulOther = []string{fleet.KindShort, fleet.KindConnect, fleet.KindStatus, fleet.KindOther}

// writeGracefulTable prints rows as one Markdown table.
func writeGracefulTable(w io.Writer, scenario string, rows []gracefulRow) {
	group := "front"
	if scenario == gracefulReload {
		group = "build"
	}
	fmt.Fprintf(w, "| %s | client | n | requests | failed | on reused conn. (closed before the request) | EOF | reset | RemoteDisconnected | timeout | other | lost (reached backend) | duplicated | shed | ideal | shed / ideal |\n", group)
	fmt.Fprintf(w, "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, r := range rows {
		other := 0
		for _, k := range gracefulOther {
			other += r.Kinds[k]
		}
		shed, ideal, rat := "", "", ""
		if r.Client == "all" && r.Ideal >= 0 {
			shed, ideal, rat = fmt.Sprint(r.Shed), fmt.Sprintf("%.0f", r.Ideal), ratio(float64(r.Shed), r.Ideal)
		}
		client := r.Client
		if client == "all" {
			client = "**all**"
		}
		fmt.Fprintf(w, "| %s | %s | %d | %d | %d | %d (%d) | %d | %d | %d | %d | %d | %d (%d) | %d | %s | %s | %s |\n",
			r.Group, client, r.Clients, r.Requests, r.Failed, r.Reused, r.Stale, r.Kinds[fleet.KindEOF], r.Kinds[fleet.KindReset],
			r.Kinds[fleet.KindRemoteDisconnected], r.Kinds[fleet.KindTimeout], other, r.Lost, r.Reached, r.Duplicated, shed, ideal, rat)
	}
	fmt.Fprintln(w)
}

// medianGracefulRows returns, for each row of the first run, the median
// of each count over the runs that have a row of its group and client.
func medianGracefulRows(runs []gracefulRun) []gracefulRow {
	var out []gracefulRow
	for _, first := range runs[0].Rows {
		var same []gracefulRow
		for _, run := range runs {
			for _, r := range run.Rows {
				if r.Group == first.Group && r.Client == first.Client {
					same = append(same, r)
				}
			}
		}
		med := func(f func(gracefulRow) float64) float64 {
			v := make([]float64, len(same))
			for i, r := range same {
				v[i] = f(r)
			}
			return math.Round(median(v))
		}
		m := gracefulRow{Group: first.Group, Client: first.Client, Kinds: map[string]int{}}
		m.Clients = int(med(func(r gracefulRow) float64 { return float64(r.Clients) }))
		m.Requests = int(med(func(r gracefulRow) float64 { return float64(r.Requests) }))
		m.Failed = int(med(func(r gracefulRow) float64 { return float64(r.Failed) }))
		m.Reused = int(med(func(r gracefulRow) float64 { return float64(r.Reused) }))
		m.Stale = int(med(func(r gracefulRow) float64 { return float64(r.Stale) }))
		m.Lost = int(med(func(r gracefulRow) float64 { return float64(r.Lost) }))
		m.Reached = int(med(func(r gracefulRow) float64 { return float64(r.Reached) }))
		m.Duplicated = int(med(func(r gracefulRow) float64 { return float64(r.Duplicated) }))
		m.Shed = int(med(func(r gracefulRow) float64 { return float64(r.Shed) }))
		m.Ideal = med(func(r gracefulRow) float64 { return r.Ideal }) // rounded, as the tables show it
		for _, k := range fleet.FailureKinds {
			m.Kinds[k] = int(med(func(r gracefulRow) float64 { return float64(r.Kinds[k]) }))
		}
		out = append(out, m)
	}
	return out
}
