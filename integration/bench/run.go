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

	t, source, versions, notes, pols, err := setupTools(ctx, cfg.caddyBin, cfg.policies, tmp, progress)
	if err != nil {
		return nil, err
	}
	rep := &report{
		Command:   cmdline,
		Source:    source,
		runHeader: startRun(began),
		Rate:      cfg.rate,
		Warmup:    cfg.warmup.String(),
		Duration:  cfg.duration.String(),
		Timeout:   cfg.timeout.String(),
		Runs:      cfg.runs,
		Fast:      cfg.fast,
		Slow:      cfg.slow,
		Versions:  versions,
		Notes:     notes,
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
	rep.finish()
	if err := writeRun(rep, &rep.Notes, len(rep.Scenarios) > 0, out, cfg.jsonPath, runErr); err != nil {
		return nil, err
	}
	return rep, nil
}

// markdownReport is a run's report, written as Markdown (and as JSON).
type markdownReport interface{ writeMarkdown(io.Writer) error }

// writeRun writes rep, a run's report, as Markdown to out and, when
// jsonPath is set, as indented JSON to that file. A run that stopped early
// (runErr) is still written, with a note, when it measured anything, so
// that what was measured before the failure is shown; its error is
// returned either way. notes are rep's notes.
func writeRun(rep markdownReport, notes *[]string, measured bool, out io.Writer, jsonPath string, runErr error) error {
	if runErr != nil {
		if !measured {
			return runErr
		}
		*notes = append(*notes, "the benchmark stopped early: "+runErr.Error())
	}
	if err := rep.writeMarkdown(out); err != nil {
		return errors.Join(runErr, err)
	}
	if jsonPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return errors.Join(runErr, err)
		}
		if err := os.WriteFile(jsonPath, append(b, '\n'), 0o644); err != nil {
			return errors.Join(runErr, err)
		}
	}
	return runErr
}

// setupTools finds or builds what the policies need: the Caddy binary
// (caddyBin, or ./cmd/caddy built into tmp), nginx and HAProxy from PATH.
// It returns them, a description of the Caddy binary's source, the tools'
// versions, notes on the policies skipped because their proxy is not
// installed, and the policies that can run.
func setupTools(ctx context.Context, caddyBin string, policies []policy, tmp string, progress io.Writer) (t tools, source string, versions map[string]string, notes []string, pols []policy, err error) {
	if t.caddy, source, err = caddyBinary(ctx, caddyBin, tmp, progress); err != nil {
		return t, "", nil, nil, nil, err
	}
	versions = map[string]string{"go": runtime.Version(), "caddy": toolVersion(ctx, t.caddy, "version")}
	// Keep only the policies that can run here; note the others.
	for _, p := range policies {
		switch p.kind {
		case kindNginx:
			if t.nginx, err = exec.LookPath("nginx"); err != nil {
				notes = append(notes, p.label+" skipped: no nginx in PATH (apt-get install nginx)")
				continue
			}
			versions["nginx"] = strings.TrimPrefix(toolVersion(ctx, t.nginx, "-v"), "nginx version: ")
		case kindHAProxy:
			if t.haproxy, err = exec.LookPath("haproxy"); err != nil {
				notes = append(notes, p.label+" skipped: no haproxy in PATH (apt-get install haproxy)")
				continue
			}
			versions["haproxy"] = strings.TrimPrefix(toolVersion(ctx, t.haproxy, "-v"), "HAProxy version ")
		}
		pols = append(pols, p)
	}
	return t, source, versions, notes, pols, nil
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
	cs := caseSpec{
		scenario:   sc.name,
		rate:       cfg.rate,
		directRate: cfg.rate / float64(sc.healthy()),
		warmup:     cfg.warmup,
		duration:   cfg.duration,
		timeout:    cfg.timeout,
	}
	for i := range numBackends {
		m := cfg.fast
		if i >= sc.healthy() {
			m = cfg.slow
			m.Freeze.Seed = uint64(i + 1) // the degraded backends stall at different times
		}
		m.Seed = uint64(i + 1) // and draw their own jitter
		m.Name = fmt.Sprintf("b%d", i+1)
		b, err := loadmodel.StartBackend(m)
		if err != nil {
			return nil, err
		}
		backends = append(backends, b)
		cs.marked = append(cs.marked, i >= sc.healthy())
	}
	var cases []caseResult
	for r := range cfg.runs {
		for i := range pols {
			pol := pols[(i+r)%len(pols)]
			caseDir := filepath.Join(dir, fmt.Sprintf("run%d-%s", r+1, pol.key))
			if err := os.MkdirAll(caseDir, 0o755); err != nil {
				return cases, err
			}
			cr, err := runCase(ctx, t, cs, pol, backends, caseDir)
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

// caseSpec is everything a measured case needs besides its policy and its
// running backends.
type caseSpec struct {
	scenario string // the scenario or variant, for results
	// rate is the offered load through a proxy, steps its changes in the
	// measured window.
	rate  float64
	steps []loadmodel.Step
	// directRate is the load sent to backends[0] for the direct
	// baseline: the share of a healthy backend under ideal balancing. The
	// steps are scaled by directRate ÷ rate.
	directRate                float64
	warmup, duration, timeout time.Duration
	// marked flags the backends whose share of the load is reported
	// (DegradedShare): degraded, slower or failing ones; markLabel names
	// them in progress lines ("degraded" if empty).
	marked    []bool
	markLabel string
	// windows are parts of the measured window summarized on their own
	// (caseResult.Windows), by name.
	windows []window
	// buckets asks for every backend's arrivals per 100 ms
	// (backendResult.Buckets).
	buckets bool
	// proxy holds the proxies' extra configuration.
	proxy proxyOptions
	// concurrency, if more than 0, runs a closed loop of that many
	// clients instead of the open loop at rate.
	concurrency int
	// reports has every backend send ORCA load reports of its own queue
	// (loadmodel's SetLoadReports), for every policy of the case.
	reports bool
}

// window is a named part [from, to) of the measured window.
type window struct {
	name     string
	from, to time.Duration
}

// runCase measures one policy once.
func runCase(ctx context.Context, t tools, cs caseSpec, pol policy, backends []*loadmodel.Backend, dir string) (caseResult, error) {
	cr := caseResult{Scenario: cs.scenario, Policy: pol.key, OfferedRate: cs.rate, markLabel: cs.markLabel}

	cr.Notes = append(cr.Notes, settleBackends(ctx, backends)...)
	if err := ctx.Err(); err != nil {
		return cr, err
	}

	steps := cs.steps
	var px *proxy
	if pol.kind == kindDirect {
		// Direct: the share of one healthy backend, with no proxy.
		px = &proxy{url: backends[0].URL()}
		cr.OfferedRate = cs.directRate
		steps = make([]loadmodel.Step, len(cs.steps))
		for i, st := range cs.steps {
			steps[i] = loadmodel.Step{At: st.At, Rate: st.Rate * cs.directRate / cs.rate}
		}
	} else {
		upstreams := make([]string, len(backends))
		for i, b := range backends {
			upstreams[i] = b.Addr()
		}
		var err error
		if px, err = startProxy(ctx, t, pol, dir, upstreams, cs.proxy); err != nil {
			return cr, err
		}
	}

	var cpu0, psi0 time.Duration
	var cpuOK, psiOK bool
	var measureStart time.Time
	load := loadmodel.Load{
		URL:         px.url,
		Rate:        cr.OfferedRate,
		Steps:       steps,
		Warmup:      cs.warmup,
		Duration:    cs.duration,
		Timeout:     cs.timeout,
		Concurrency: cs.concurrency,
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
	for _, w := range cs.windows {
		if cr.Windows == nil {
			cr.Windows = map[string]loadmodel.Summary{}
		}
		cr.Windows[w.name] = loadmodel.Summarize(res.Between(w.from, w.to))
	}
	if cpuOK && cpuOK1 && cr.Summary.Requests > 0 {
		us := float64(cpu1-cpu0) / float64(time.Microsecond) / float64(cr.Summary.Requests)
		cr.ProxyCPUus = &us
	}
	if psiOK && psiOK1 && measured > 0 {
		p := float64(psi1-psi0) / float64(measured)
		cr.CPUPressure = &p
	}
	var total, marked int64
	anyMarked := false
	for i, b := range backends {
		c := b.Counters(loadmodel.PhaseMeasure)
		isMarked := i < len(cs.marked) && cs.marked[i]
		anyMarked = anyMarked || isMarked
		br := backendResult{Name: b.Name(), Degraded: isMarked, Counters: c}
		br.Utilization = float64(c.Served) * float64(c.MeanService) / (float64(b.Model().Workers) * float64(cs.duration))
		if cs.buckets {
			br.Buckets = b.Arrivals()
		}
		cr.Backends = append(cr.Backends, br)
		total += c.Arrivals
		if isMarked {
			marked += c.Arrivals
		}
	}
	if pol.kind != kindDirect && anyMarked && total > 0 {
		share := float64(marked) / float64(total)
		cr.DegradedShare = &share
	}
	cr.Notes = append(cr.Notes, sendLagNotes(res.MaxSendLag)...)
	return cr, nil
}

// settleBackends lets the previous case's leftovers drain (for up to 5
// s), so that they do not count in the next case, and resets the
// backends' counters. It returns a note for each backend that did not
// drain.
func settleBackends(ctx context.Context, backends []*loadmodel.Backend) []string {
	var notes []string
	idleCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, b := range backends {
		if err := b.WaitIdle(idleCtx); err != nil && ctx.Err() == nil {
			notes = append(notes, "started with requests left over: "+err.Error())
		}
		b.ResetCounters()
	}
	return notes
}

// sendLagNotes returns a note when the load generator fell more than 50 ms
// behind its schedule: its latencies then include its own starvation.
func sendLagNotes(lag time.Duration) []string {
	if lag <= 50*time.Millisecond {
		return nil
	}
	return []string{fmt.Sprintf("load generator fell %v behind schedule (CPU starved?)", lag.Round(time.Millisecond))}
}
