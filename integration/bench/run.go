package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// run is the whole benchmark: it parses args, runs every case, writes the
// Markdown report to out (and JSON if asked), and logs progress to
// progress. It stops every process and backend it started before
// returning, also when ctx is cancelled.
func run(ctx context.Context, args []string, cmdline string, out, progress io.Writer) (*report, error) {
	cfg, err := parseFlags(args, progress)
	if err != nil {
		return nil, err
	}
	began := time.Now()

	tmp, err := os.MkdirTemp("", "lbx-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)

	t := tools{caddy: cfg.caddyBin}
	source := "Caddy binary given with -caddy"
	if t.caddy == "" {
		root, err := moduleRoot(ctx)
		if err != nil {
			return nil, err
		}
		if t.caddy, err = buildCaddy(ctx, root, tmp, progress); err != nil {
			return nil, err
		}
		source = "./cmd/caddy built from " + gitState(ctx, root)
	}
	rep := &report{
		Command:   cmdline,
		Source:    source,
		Started:   began.UTC().Format(time.RFC3339),
		Rate:      cfg.rate,
		Warmup:    cfg.warmup.String(),
		Duration:  cfg.duration.String(),
		Timeout:   cfg.timeout.String(),
		Runs:      cfg.runs,
		Fast:      cfg.fast,
		Slow:      cfg.slow,
		CPUs:      runtime.NumCPU(),
		LoadStart: loadAverage(),
		Versions:  map[string]string{"go": runtime.Version(), "caddy": toolVersion(ctx, t.caddy, "version")},
	}
	// Keep only the policies that can run here; note the others.
	var pols []policy
	for _, p := range cfg.policies {
		switch p.kind {
		case kindNginx:
			if t.nginx, err = exec.LookPath("nginx"); err != nil {
				rep.Notes = append(rep.Notes, "nginx least_conn skipped: no nginx in PATH")
				continue
			}
			rep.Versions["nginx"] = strings.TrimPrefix(toolVersion(ctx, t.nginx, "-v"), "nginx version: ")
		case kindHAProxy:
			if t.haproxy, err = exec.LookPath("haproxy"); err != nil {
				rep.Notes = append(rep.Notes, "HAProxy leastconn skipped: no haproxy in PATH")
				continue
			}
			rep.Versions["haproxy"] = strings.TrimPrefix(toolVersion(ctx, t.haproxy, "-v"), "HAProxy version ")
		}
		pols = append(pols, p)
	}

	var runErr error
	for _, sc := range cfg.scenarios {
		cases, err := runScenario(ctx, cfg, t, sc, pols, filepath.Join(tmp, sc.name), progress)
		rep.Cases = append(rep.Cases, cases...)
		if err != nil {
			runErr = fmt.Errorf("scenario %s: %w", sc.name, err)
			break
		}
		rep.Scenarios = append(rep.Scenarios, summarizeScenario(sc, pols, cases))
	}
	rep.LoadEnd = loadAverage()
	rep.Elapsed = time.Since(began).Round(time.Second).String()
	if runErr != nil {
		if len(rep.Scenarios) == 0 {
			return nil, runErr
		}
		// Show what was measured before the failure.
		rep.Notes = append(rep.Notes, "the benchmark stopped early: "+runErr.Error())
	}

	if err := rep.writeMarkdown(out); err != nil {
		return nil, errors.Join(runErr, err)
	}
	if runErr != nil {
		return nil, runErr
	}
	if cfg.jsonPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(cfg.jsonPath, append(b, '\n'), 0o644); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

// runScenario starts the scenario's backends and runs every policy
// cfg.runs times, in an order rotated from run to run.
func runScenario(ctx context.Context, cfg *config, t tools, sc scenario, pols []policy, dir string, progress io.Writer) ([]caseResult, error) {
	backends := make([]*loadmodel.Backend, 0, numBackends)
	defer func() {
		for _, b := range backends {
			b.Close()
		}
	}()
	for i := range numBackends {
		m := cfg.fast
		if i >= sc.healthy() {
			m = cfg.slow
			m.Freeze.Seed = uint64(i + 1) // the degraded backends stall at different times
		}
		m.Name = fmt.Sprintf("b%d", i+1)
		b, err := loadmodel.StartBackend(m)
		if err != nil {
			return nil, err
		}
		backends = append(backends, b)
	}
	var cases []caseResult
	for r := range cfg.runs {
		for i := range pols {
			pol := pols[(i+r)%len(pols)]
			caseDir := filepath.Join(dir, fmt.Sprintf("run%d-%s", r+1, pol.key))
			if err := os.MkdirAll(caseDir, 0o755); err != nil {
				return cases, err
			}
			cr, err := runCase(ctx, cfg, t, sc, pol, backends, caseDir)
			if err != nil {
				return cases, fmt.Errorf("%s, run %d: %w", pol.key, r+1, err)
			}
			cr.Run = r + 1
			cases = append(cases, cr)
			fmt.Fprintf(progress, "%s run %d/%d %-16s %s\n", sc.name, r+1, cfg.runs, pol.key, cr.oneLine())
		}
	}
	return cases, nil
}

// runCase measures one policy once.
func runCase(ctx context.Context, cfg *config, t tools, sc scenario, pol policy, backends []*loadmodel.Backend, dir string) (caseResult, error) {
	cr := caseResult{Scenario: sc.name, Policy: pol.key, OfferedRate: cfg.rate}

	// Let the previous case's leftovers drain so they do not count here.
	idleCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	for _, b := range backends {
		if err := b.WaitIdle(idleCtx); err != nil && ctx.Err() == nil {
			cr.Notes = append(cr.Notes, "started with requests left over: "+err.Error())
		}
		b.ResetCounters()
	}
	cancel()
	if err := ctx.Err(); err != nil {
		return cr, err
	}

	var px *proxy
	if pol.kind == kindDirect {
		// Direct: the share of one healthy backend, with no proxy.
		px = &proxy{url: backends[0].URL()}
		cr.OfferedRate = cfg.rate / float64(sc.healthy())
	} else {
		upstreams := make([]string, len(backends))
		for i, b := range backends {
			upstreams[i] = b.Addr()
		}
		var err error
		if px, err = startProxy(ctx, t, pol, dir, upstreams); err != nil {
			return cr, err
		}
	}

	var cpu0, psi0 time.Duration
	var cpuOK, psiOK bool
	var measureStart time.Time
	load := loadmodel.Load{
		URL:      px.url,
		Rate:     cr.OfferedRate,
		Warmup:   cfg.warmup,
		Duration: cfg.duration,
		Timeout:  cfg.timeout,
		OnMeasure: func() {
			measureStart = time.Now()
			cpu0, cpuOK = px.cpu()
			psi0, psiOK = cpuPressure()
		},
	}
	epoch := time.Now()
	for _, b := range backends {
		b.SetEpoch(epoch) // every case meets the same stalls
	}
	res, err := load.Run(ctx)
	cpu1, cpuOK1 := px.cpu()
	psi1, psiOK1 := cpuPressure()
	measured := time.Since(measureStart)
	if err == nil && pol.key == "ewma" {
		cr.LBXState = px.lbxState(ctx)
	}
	if stopErr := px.stop(); stopErr != nil {
		err = errors.Join(err, stopErr)
	}
	if err != nil {
		return cr, err
	}

	cr.Summary = loadmodel.Summarize(res)
	cr.MaxSendLagMs = ms(res.MaxSendLag)
	if cpuOK && cpuOK1 && cr.Summary.Requests > 0 {
		us := float64(cpu1-cpu0) / float64(time.Microsecond) / float64(cr.Summary.Requests)
		cr.ProxyCPUus = &us
	}
	if psiOK && psiOK1 && measured > 0 {
		p := float64(psi1-psi0) / float64(measured)
		cr.CPUPressure = &p
	}
	var total, degraded int64
	for i, b := range backends {
		c := b.Counters(loadmodel.PhaseMeasure)
		isDegraded := i >= sc.healthy()
		br := backendResult{Name: b.Name(), Degraded: isDegraded, Counters: c}
		br.Utilization = float64(c.Served) * float64(c.MeanService) / (float64(b.Model().Workers) * float64(cfg.duration))
		cr.Backends = append(cr.Backends, br)
		total += c.Arrivals
		if isDegraded {
			degraded += c.Arrivals
		}
	}
	if pol.kind != kindDirect && sc.degraded > 0 && total > 0 {
		share := float64(degraded) / float64(total)
		cr.DegradedShare = &share
	}
	if res.MaxSendLag > 50*time.Millisecond {
		cr.Notes = append(cr.Notes, fmt.Sprintf("load generator fell %v behind schedule (CPU starved?)", res.MaxSendLag.Round(time.Millisecond)))
	}
	return cr, nil
}
