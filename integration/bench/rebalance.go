package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// rebalanceConfig is `bench rebalance`'s configuration, from flags.
type rebalanceConfig struct {
	clients  int
	every    time.Duration
	runs     int
	plot     string
	caddyBin string
	converge time.Duration
	settings fleet.Settings
	from     int
	// scenario is scale-out or rolling-restart; nodes and down are the
	// rolling restart's fleet size and downtime per node.
	scenario string
	nodes    int
	down     time.Duration
	// front is the outer balancer, one of fleet.FrontNames.
	front string
}

// parseRebalanceFlags reads `bench rebalance`'s flags.
func parseRebalanceFlags(args []string, stderr io.Writer) (*rebalanceConfig, error) {
	fs := flag.NewFlagSet("bench rebalance", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" rebalance [flags]\n\n"+
			"Runs the rebalance scale-out with real Caddy processes: 3 nodes under\n"+
			"long-lived clients behind an outer balancer (-front), 3 more join (and one with\n"+
			"the wrong gossip key), then 2 more while one node is reloaded and one is\n"+
			"killed. Prints a Markdown table per run and the medians, and draws the\n"+
			"connections per node over time of the median run as a PNG.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &rebalanceConfig{}
	fs.IntVar(&c.clients, "clients", 3000, "long-lived keep-alive clients")
	fs.IntVar(&c.from, "from", 3, "nodes before the scale-out, which doubles them, then adds 2 (3 to 8)")
	fs.StringVar(&c.scenario, "scenario", "scale-out", "scale-out, or rolling-restart (every node drained, down for -down, started again, in turn)")
	fs.IntVar(&c.nodes, "nodes", 6, "rolling-restart: the fleet's size (2 to 12)")
	fs.DurationVar(&c.down, "down", 2*time.Second, "rolling-restart: how long each node stays stopped")
	fs.DurationVar(&c.every, "every", time.Second, "each client's request period")
	fs.IntVar(&c.runs, "runs", 3, "runs; the summary shows the median of each measure")
	fs.StringVar(&c.plot, "plot", "", "write the median run's plot to this PNG file, relative to the lbx module's root; \"none\": no plot (default: "+
		rebalancePlots["scale-out"]+", or "+rebalancePlots["rolling-restart"]+" with -scenario rolling-restart)")
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.DurationVar(&c.converge, "converge", 90*time.Second, "the longest wait for the fleet to converge, per phase")
	fs.StringVar(&c.settings.Interval, "interval", "200ms", "rebalance interval")
	fs.StringVar(&c.settings.History, "history", "1s", "rebalance history")
	fs.StringVar(&c.settings.Freshness, "freshness", "1s", "rebalance freshness")
	fs.Float64Var(&c.settings.Threshold, "threshold", 20, "rebalance threshold, percent")
	fs.Float64Var(&c.settings.ShedRate, "shed-rate", 5, "rebalance shed_rate, percent per interval (raised from 0.5 for speed)")
	fs.IntVar(&c.settings.MinConnections, "min-connections", 5, "rebalance min_connections")
	fs.StringVar(&c.settings.JoinSettle, "join-settle", "", "rebalance join_settle: a duration, or off (empty: the default, freshness)")
	fs.StringVar(&c.front, "front", fleet.FrontRandom, "the outer balancer: "+strings.Join(fleet.FrontNames, ", ")+" (the haproxy ones run the haproxy binary)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	case c.clients < 60:
		return nil, fmt.Errorf("-clients must be at least 60 (10 per node), got %d", c.clients)
	case c.every <= 0:
		return nil, fmt.Errorf("-every must be positive, got %v", c.every)
	case c.runs < 1:
		return nil, fmt.Errorf("-runs must be at least 1, got %d", c.runs)
	case c.converge <= 0:
		return nil, fmt.Errorf("-converge must be positive, got %v", c.converge)
	case c.from < 3 || c.from > 8:
		return nil, fmt.Errorf("-from must be from 3 to 8, got %d", c.from)
	case c.scenario != "scale-out" && c.scenario != "rolling-restart":
		return nil, fmt.Errorf("-scenario %q: want scale-out or rolling-restart", c.scenario)
	case c.nodes < 2 || c.nodes > 12:
		return nil, fmt.Errorf("-nodes must be from 2 to 12, got %d", c.nodes)
	case c.down < 0 || c.down > 10*time.Minute:
		return nil, fmt.Errorf("-down must be from 0 to 10m, got %v", c.down)
	}
	switch c.plot {
	case "":
		// Each scenario its own plot: a rolling restart must not draw
		// over the scale-out's.
		c.plot = rebalancePlots[c.scenario]
	case "none":
		c.plot = ""
	}
	if err := fleet.CheckFront(c.front); err != nil || c.front == "" {
		return nil, fmt.Errorf("-front %q: want one of %s", c.front, strings.Join(fleet.FrontNames, ", "))
	}
	return c, nil
}

// rebalancePlots is each scenario's plot file when -plot is not given.
var rebalancePlots = map[string]string{
	"scale-out":       "docs/rebalance-scaleout.png",
	"rolling-restart": "docs/rebalance-rolling-restart.png",
}

// runRebalance is `bench rebalance`.
func runRebalance(ctx context.Context, args []string, cmdline string, out, progress io.Writer) ([]*fleet.ScaleOutResult, error) {
	cfg, err := parseRebalanceFlags(args, progress)
	if err != nil {
		return nil, err
	}
	if err := fleet.FrontAvailable(cfg.front); err != nil {
		return nil, fmt.Errorf("-front %s: %w", cfg.front, err)
	}
	tmp, err := os.MkdirTemp("", "lbx-bench-rebalance-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	bin, source, err := caddyBinary(ctx, cfg.caddyBin, tmp, progress)
	if err != nil {
		return nil, err
	}
	title := "Rebalance scale-out"
	if cfg.scenario == "rolling-restart" {
		title = "Rolling restart"
	}
	fmt.Fprintf(out, "# %s\n\n`%s`; %s; outer balancer %s (ideal simulated behind %s); %d clients, a request every %v each; interval %s, history %s, freshness %s, threshold %g%%, shed_rate %g%%, min_connections %d, join_settle %s; load average %s at the start.\n\n",
		title, cmdline, source, cfg.front, fleet.IdealBalancer(cfg.front), cfg.clients, cfg.every, cfg.settings.Interval, cfg.settings.History, cfg.settings.Freshness,
		cfg.settings.Threshold, cfg.settings.ShedRate, cfg.settings.MinConnections, cmp.Or(cfg.settings.JoinSettle, "default"), loadAverage())

	if cfg.scenario == "rolling-restart" {
		return nil, runRolling(ctx, cfg, bin, tmp, out, progress)
	}
	var results []*fleet.ScaleOutResult
	for i := range cfg.runs {
		if ctx.Err() != nil {
			return results, ctx.Err()
		}
		fmt.Fprintf(progress, "run %d of %d …\n", i+1, cfg.runs)
		res, err := fleet.ScaleOut{
			Bin: bin, Dir: filepath.Join(tmp, fmt.Sprintf("run%d", i+1)),
			Clients: cfg.clients, Every: cfg.every, Settings: cfg.settings, Converge: cfg.converge, From: cfg.from, Front: cfg.front,
			Logf: func(format string, args ...any) { fmt.Fprintf(progress, "  "+format+"\n", args...) },
		}.Run()
		if err != nil {
			return results, fmt.Errorf("run %d: %w", i+1, err)
		}
		results = append(results, res)
	}
	writeRebalanceReport(out, results, cfg.from)

	if cfg.plot != "" {
		median := medianRun(results)
		path, err := plotPath(ctx, cfg.plot)
		if err != nil {
			return results, err
		}
		title := fmt.Sprintf("lbx rebalance: %d long-lived clients, %d -> %d -> %d nodes, outer balancer %s (run %d of %d)",
			cfg.clients, cfg.from, 2*cfg.from, 2*cfg.from+2, cfg.front, slices.Index(results, median)+1, len(results))
		if err := writePNGFile(path, func(w io.Writer) error {
			return median.Timeline.WritePNG(w, title, cfg.settings.Threshold/100)
		}); err != nil {
			return results, err
		}
		fmt.Fprintf(out, "\nPlot of run %d (the median convergence time): %s\n", slices.Index(results, median)+1, cfg.plot)
	}
	return results, nil
}

// medianRun returns the run with the median phase-1 convergence time.
func medianRun(results []*fleet.ScaleOutResult) *fleet.ScaleOutResult {
	sorted := slices.Clone(results)
	slices.SortFunc(sorted, func(a, b *fleet.ScaleOutResult) int { return int(a.Converged - b.Converged) })
	return sorted[(len(sorted)-1)/2]
}

// writeRebalanceReport prints one row per run and the medians.
func writeRebalanceReport(w io.Writer, results []*fleet.ScaleOutResult, from int) {
	fmt.Fprintf(w, "**%d → %d nodes** (and a node with the wrong key; all joined and converged are from the first new node's start: new nodes that come up far apart shed more)\n\n", from, 2*from)
	fmt.Fprintf(w, "| run | before | after | all joined | converged | shed | moved | ideal | shed / ideal | shed / (2 × moved) | requests | failed | reconnections | wrong key joined |\n")
	fmt.Fprintf(w, "|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|\n")
	var conv, ratio, ratio2 []float64
	for i, r := range results {
		ri := float64(r.Shed) / r.Ideal
		r2 := float64(r.Shed) / float64(max(2*r.Moved, 1))
		conv, ratio, ratio2 = append(conv, r.Converged.Seconds()), append(ratio, ri), append(ratio2, r2)
		joined := "no"
		if len(r.WrongKey.SeenBy) > 0 || r.WrongKey.Alive != 1 {
			joined = fmt.Sprintf("**yes** (%v)", r.WrongKey.SeenBy)
		}
		fmt.Fprintf(w, "| %d | %v | %v | %.1f s | %.1f s | %d | %d | %.0f | %.2f× | %.2f× | %d | %d | %d | %s |\n",
			i+1, r.Before, r.After, r.Joined.Seconds(), r.Converged.Seconds(), r.Shed, r.Moved, r.Ideal, ri, r2, r.Requests, len(r.Errors), r.Reconnections, joined)
	}
	verdict := "met"
	if median(slices.Clone(ratio)) > 1.3 {
		verdict = "**not met**"
	}
	fmt.Fprintf(w, "\nMedians: converged after %.1f s; shed %.2f× the ideal (target ≤ 1.3×: %s), %.2f× twice the moved count.\n\n",
		median(conv), median(slices.Clone(ratio)), verdict, median(ratio2))

	fmt.Fprintf(w, "**%d → %d nodes, a reload and a kill -9 while the fleet sheds**\n\n", 2*from, 2*from+2)
	fmt.Fprintf(w, "| run | reload: new tag everywhere | not-alive sightings | join/leave events | bind errors | kill: out of the averages | marked failed | survivors stable | final | failed requests (phase 2): at the reload / after the kill / other |\n")
	fmt.Fprintf(w, "|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|\n")
	var excl, failed, stable []float64
	for i, r := range results {
		k := r.Kill
		excl, failed, stable = append(excl, k.Excluded.Seconds()), append(failed, k.MarkedFailed.Seconds()), append(stable, k.Stable.Seconds())
		atReload, afterKill, others := r.Phase2Split()
		fmt.Fprintf(w, "| %d | %.2f s | %d | %d | %d | %.1f s | %.1f s | %.1f s | %v | %d / %d / %d |\n",
			i+1, r.Reload.TagSeen.Seconds(), len(r.Reload.NotAlive), r.Reload.Rejoins, r.Reload.BindErrors,
			k.Excluded.Seconds(), k.MarkedFailed.Seconds(), k.Stable.Seconds(), k.Final, len(atReload), len(afterKill), len(others))
	}
	fmt.Fprintf(w, "\nMedians after the kill: out of every survivor's average after %.1f s, marked failed by serf after %.1f s, survivors stable after %.1f s.\n",
		median(excl), median(failed), median(stable))
	// The failures no known cause accounts for, so that a reader can see
	// what they were without running again.
	for i, r := range results {
		if len(r.Errors) > 0 {
			fmt.Fprintf(w, "\nRun %d, phase 1 failures, first %d: %s\n", i+1, min(len(r.Errors), 3), failureList(r.Errors, 3))
		}
		if _, _, others := r.Phase2Split(); len(others) > 0 {
			fmt.Fprintf(w, "\nRun %d, phase 2 failures neither at the reload nor after the kill, first %d: %s\n", i+1, min(len(others), 3), failureList(others, 3))
		}
	}
}
