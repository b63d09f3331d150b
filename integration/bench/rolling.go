package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// runRolling is `bench rebalance -scenario rolling-restart`: cfg.runs
// runs of fleet.RollingRestart, a table per run, and the last run's
// plot when cfg.plot is set.
func runRolling(ctx context.Context, cfg *rebalanceConfig, bin, tmp string, out, progress io.Writer) error {
	var last *fleet.RollingResult
	for i := range cfg.runs {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		fmt.Fprintf(progress, "run %d of %d …\n", i+1, cfg.runs)
		res, err := fleet.RollingRestart{
			Bin: bin, Dir: filepath.Join(tmp, fmt.Sprintf("run%d", i+1)),
			Nodes: cfg.nodes, Clients: cfg.clients, Every: cfg.every, Down: cfg.down,
			Settings: cfg.settings, Converge: cfg.converge, Front: cfg.front,
			Logf: func(format string, args ...any) { fmt.Fprintf(progress, "  "+format+"\n", args...) },
		}.Run()
		if err != nil {
			return fmt.Errorf("run %d: %w", i+1, err)
		}
		writeRollingReport(out, i+1, res, cfg.down)
		last = res
	}
	if cfg.plot == "" {
		return nil
	}
	path, err := plotPath(ctx, cfg.plot)
	if err != nil {
		return err
	}
	title := fmt.Sprintf("lbx rebalance: %d long-lived clients, rolling restart of %d nodes (each down %v), outer balancer %s (run %d)",
		cfg.clients, cfg.nodes, cfg.down, cfg.front, cfg.runs)
	if err := writePNGFile(path, func(w io.Writer) error {
		return last.Timeline.WritePNG(w, title, cfg.settings.Threshold/100)
	}); err != nil {
		return err
	}
	fmt.Fprintf(out, "\nPlot of run %d: %s\n", cfg.runs, cfg.plot)
	return nil
}

// writeRollingReport prints one run's table: a row per restarted node.
func writeRollingReport(w io.Writer, run int, res *fleet.RollingResult, down fmt.Stringer) {
	fmt.Fprintf(w, "**Run %d**: %d nodes holding %v, each drained (out of the balancer, then SIGTERM), down %v, started again; %d requests, %d failed.\n\n",
		run, len(res.Before), res.Before, down, res.Requests, len(res.Errors))
	fmt.Fprintf(w, "| node | held | drained in | shed while down | refilled in | shed | ideal | shed / ideal | failed requests |\n")
	fmt.Fprintf(w, "|---|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	shed, ideal := 0, 0.0
	for _, r := range res.Restarts {
		shed, ideal = shed+r.Shed, ideal+r.Ideal
		fmt.Fprintf(w, "| %s | %d | %.2f s | %d | %.1f s | %d | %.0f | %s | %d |\n",
			r.Node, r.Held, r.Drained.Seconds(), r.ShedWhileDown, r.Refilled.Seconds(), r.Shed, r.Ideal, ratio(float64(r.Shed), r.Ideal), len(r.Failed))
	}
	fmt.Fprintf(w, "| all | | | | | %d | %.0f | %s | %d |\n\n", shed, ideal, ratio(float64(shed), ideal), len(res.Errors))
	if len(res.Errors) > 0 {
		fmt.Fprintf(w, "Failures, first %d: %s\n\n", min(len(res.Errors), 5), failureList(res.Errors, 5))
	}
}

// failureList returns the first n of errs, each with its time and
// connection, separated by "; ".
func failureList(errs []fleet.ClientError, n int) string {
	var lines []string
	for _, e := range errs[:min(len(errs), n)] {
		lines = append(lines, e.String())
	}
	return strings.Join(lines, "; ")
}

// ratio formats a/b as "1.23×", or "—" when b is 0.
func ratio(a, b float64) string {
	if b == 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f×", a/b)
}
