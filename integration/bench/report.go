package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// caseResult is the measurement of one policy in one scenario, one run.
type caseResult struct {
	Scenario    string  `json:"scenario"`
	Policy      string  `json:"policy"`
	Run         int     `json:"run"`
	OfferedRate float64 `json:"offered_rate"`
	// Summary is the client's view of the measured window.
	Summary loadmodel.Summary `json:"summary"`
	// DegradedShare is the fraction of the measured requests (attempts,
	// with retries) that reached a degraded backend — or, in the
	// scenario classes, whichever backends the variant marks: degraded,
	// slower or failing (counted by the backends, so requests that timed
	// out in a queue count too); nil where it means nothing.
	DegradedShare *float64 `json:"degraded_share,omitempty"`
	// ProxyCPUus is the proxy processes' user+system CPU time from the
	// start of the measured window until its last request finished,
	// divided by the measured requests, in µs; nil for the direct
	// baseline or where /proc is not available.
	ProxyCPUus *float64 `json:"proxy_cpu_us_per_request,omitempty"`
	// CPUPressure is the fraction of the measured window (until its last
	// request finished) during which some task on the machine waited for
	// a CPU (Linux PSI): a measure of contention, from this benchmark or
	// anything else running.
	CPUPressure  *float64        `json:"cpu_pressure,omitempty"`
	MaxSendLagMs float64         `json:"max_send_lag_ms"`
	Backends     []backendResult `json:"backends"`
	// Windows summarizes parts of the measured window on their own (the
	// scenario classes' load step), by name.
	Windows map[string]loadmodel.Summary `json:"windows,omitempty"`
	// Seed is the seed of a scenario-class case (0 in the A/B/C
	// scenarios).
	Seed int `json:"seed,omitempty"`
	// LBXState is lbx's view of the upstreams (GET /lbx/upstreams on
	// Caddy's admin API) right after the measured window, for ewma.
	LBXState json.RawMessage `json:"lbx_state,omitempty"`
	Notes    []string        `json:"notes,omitempty"`

	markLabel string // what DegradedShare counts, for oneLine ("degraded" if empty)
}

// backendResult is what one backend saw of a measured window.
type backendResult struct {
	Name string `json:"name"`
	// Degraded marks a degraded backend — or, in the scenario classes,
	// one the variant marks (degraded, slower or failing).
	Degraded bool `json:"degraded"`
	loadmodel.Counters
	// Utilization is the fraction of the backend's worker time that was
	// busy during the measured window: served × mean hold time ÷
	// (workers × window).
	Utilization float64 `json:"utilization"`
	// Buckets are the backend's arrivals of load traffic per
	// loadmodel.ArrivalBucket since the case's epoch (warm-up included),
	// where the variant asks for them.
	Buckets []int64 `json:"arrivals_per_100ms,omitempty"`
}

// oneLine is the progress line of a case.
func (c caseResult) oneLine() string {
	s := c.Summary
	line := fmt.Sprintf("%7.1f req/s  p50 %7.2f ms  p99 %8.2f ms  p999 %8.2f ms  errors %5d", s.Throughput, ms(s.P50), ms(s.P99), ms(s.P999), s.Errors)
	if c.DegradedShare != nil {
		label := c.markLabel
		if label == "" {
			label = "degraded"
		}
		line += fmt.Sprintf("  %s %5.1f%%", label, 100**c.DegradedShare)
	}
	if c.ProxyCPUus != nil {
		line += fmt.Sprintf("  cpu %4.0f µs/req", *c.ProxyCPUus)
	}
	if c.CPUPressure != nil {
		line += fmt.Sprintf("  cpu pressure %3.0f%%", 100**c.CPUPressure)
	}
	for _, n := range c.Notes {
		line += "  [" + n + "]"
	}
	return line
}

// row is a policy's medians over the runs of a scenario.
type row struct {
	Policy        string   `json:"policy"`
	Label         string   `json:"label"`
	Runs          int      `json:"runs"`
	Throughput    float64  `json:"throughput"`
	P50ms         float64  `json:"p50_ms"`
	P99ms         float64  `json:"p99_ms"`
	P999ms        float64  `json:"p999_ms"`
	Errors        float64  `json:"errors"`
	Timeouts      float64  `json:"timeouts"`
	DegradedShare *float64 `json:"degraded_share,omitempty"`
	ProxyCPUus    *float64 `json:"proxy_cpu_us_per_request,omitempty"`
	// Share, MaxInSystem and Utilization are, per backend, the medians of
	// its share of the measured arrivals, of the largest number of
	// requests it held at once, and of its utilization.
	Share       map[string]float64 `json:"share"`
	MaxInSystem map[string]float64 `json:"max_in_system"`
	Utilization map[string]float64 `json:"utilization"`
}

// check is one performance target evaluated on the medians.
type check struct {
	Name   string   `json:"name"`
	Target string   `json:"target"`
	Value  *float64 `json:"value,omitempty"` // nil if it could not be computed
	Met    bool     `json:"met"`
	Detail string   `json:"detail,omitempty"`
}

// scenarioSummary is a scenario's table and targets.
type scenarioSummary struct {
	Name     string   `json:"name"`
	Title    string   `json:"title"`
	Backends []string `json:"backends"`
	Degraded []string `json:"degraded"`
	Rows     []row    `json:"rows"`
	Checks   []check  `json:"checks"`
	// CPUPressure is the median and the largest CPUPressure of the
	// scenario's cases; nil where not measured.
	CPUPressureMedian *float64 `json:"cpu_pressure_median,omitempty"`
	CPUPressureMax    *float64 `json:"cpu_pressure_max,omitempty"`
}

// report is everything the benchmark measured.
type report struct {
	Command string `json:"command"`
	Source  string `json:"source"`
	runHeader
	Rate      float64           `json:"rate"`
	Warmup    string            `json:"warmup"`
	Duration  string            `json:"duration"`
	Timeout   string            `json:"timeout"`
	Runs      int               `json:"runs"`
	Fast      loadmodel.Model   `json:"healthy_backend"`
	Slow      loadmodel.Model   `json:"degraded_backend"`
	Versions  map[string]string `json:"versions"`
	Notes     []string          `json:"notes,omitempty"`
	Scenarios []scenarioSummary `json:"scenarios"`
	Cases     []caseResult      `json:"cases"`
}

// summarizeScenario takes the medians of every policy's runs and
// evaluates the targets.
func summarizeScenario(sc scenario, pols []policy, cases []caseResult) scenarioSummary {
	ss := scenarioSummary{Name: sc.name, Title: sc.title}
	for i := range numBackends {
		name := fmt.Sprintf("b%d", i+1)
		ss.Backends = append(ss.Backends, name)
		if i >= sc.healthy() {
			ss.Degraded = append(ss.Degraded, name)
		}
	}
	for _, p := range pols {
		var runs []caseResult
		for _, c := range cases {
			if c.Policy == p.key {
				runs = append(runs, c)
			}
		}
		if len(runs) > 0 {
			ss.Rows = append(ss.Rows, medianRow(p, runs))
		}
	}
	ss.Checks = evaluate(sc, pols, ss.Rows)
	var psi []float64
	for _, c := range cases {
		if c.CPUPressure != nil {
			psi = append(psi, *c.CPUPressure)
		}
	}
	if len(psi) > 0 {
		m := median(psi)
		top := slices.Max(psi)
		ss.CPUPressureMedian, ss.CPUPressureMax = &m, &top
	}
	return ss
}

// medianRow takes the median of each metric over runs independently.
func medianRow(p policy, runs []caseResult) row {
	r := row{Policy: p.key, Label: p.label, Runs: len(runs), Share: map[string]float64{}, MaxInSystem: map[string]float64{}, Utilization: map[string]float64{}}
	pick := func(f func(caseResult) float64) float64 {
		v := make([]float64, len(runs))
		for i, c := range runs {
			v[i] = f(c)
		}
		return median(v)
	}
	pickOpt := func(f func(caseResult) *float64) *float64 {
		var v []float64
		for _, c := range runs {
			if x := f(c); x != nil {
				v = append(v, *x)
			}
		}
		if len(v) == 0 {
			return nil
		}
		m := median(v)
		return &m
	}
	r.Throughput = pick(func(c caseResult) float64 { return c.Summary.Throughput })
	r.P50ms = pick(func(c caseResult) float64 { return ms(c.Summary.P50) })
	r.P99ms = pick(func(c caseResult) float64 { return ms(c.Summary.P99) })
	r.P999ms = pick(func(c caseResult) float64 { return ms(c.Summary.P999) })
	r.Errors = pick(func(c caseResult) float64 { return float64(c.Summary.Errors) })
	r.Timeouts = pick(func(c caseResult) float64 { return float64(c.Summary.Timeouts) })
	r.DegradedShare = pickOpt(func(c caseResult) *float64 { return c.DegradedShare })
	r.ProxyCPUus = pickOpt(func(c caseResult) *float64 { return c.ProxyCPUus })
	for i, b := range runs[0].Backends {
		r.Share[b.Name] = pick(func(c caseResult) float64 {
			var total int64
			for _, x := range c.Backends {
				total += x.Arrivals
			}
			if total == 0 {
				return 0
			}
			return float64(c.Backends[i].Arrivals) / float64(total)
		})
		r.MaxInSystem[b.Name] = pick(func(c caseResult) float64 { return float64(c.Backends[i].MaxInSystem) })
		r.Utilization[b.Name] = pick(func(c caseResult) float64 { return c.Backends[i].Utilization })
	}
	return r
}

// median returns the median of v (the mean of the middle two for an even
// count); v is reordered.
func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	slices.Sort(v)
	n := len(v)
	if n%2 == 1 {
		return v[n/2]
	}
	return (v[n/2-1] + v[n/2]) / 2
}

// evaluate computes the target ratios of a scenario from its rows.
func evaluate(sc scenario, pols []policy, rows []row) []check {
	byKey := map[string]*row{}
	for i := range rows {
		byKey[rows[i].Policy] = &rows[i]
	}
	ewma := byKey["ewma"]
	if ewma == nil {
		return nil
	}
	ratio := func(name, target string, num, den float64, ok func(float64) bool, detail string) check {
		c := check{Name: name, Target: target, Detail: detail}
		if den > 0 && !math.IsNaN(num) {
			v := num / den
			c.Value = &v
			c.Met = ok(v)
		}
		return c
	}
	var checks []check
	if sc.degraded == 0 {
		if lc := byKey["least_conn"]; lc != nil {
			checks = append(checks,
				ratio("ewma req/s ÷ Caddy least_conn req/s", "≥ 0.95", ewma.Throughput, lc.Throughput,
					func(v float64) bool { return v >= 0.95 }, ""),
				ratio("ewma p50 ÷ Caddy least_conn p50", "≤ 1.05", ewma.P50ms, lc.P50ms,
					func(v float64) bool { return v <= 1.05 }, ""))
			if ewma.ProxyCPUus != nil && lc.ProxyCPUus != nil {
				checks = append(checks, ratio("ewma CPU/request ÷ Caddy least_conn CPU/request", "≤ 1.05 (informational)",
					*ewma.ProxyCPUus, *lc.ProxyCPUus, func(v float64) bool { return v <= 1.05 }, ""))
			}
		}
		return checks
	}
	// Best stock least-connections-style p99.
	var best *row
	for _, p := range pols {
		if r := byKey[p.key]; r != nil && p.leastConnStyle && (best == nil || r.P99ms < best.P99ms) {
			best = r
		}
	}
	if best != nil {
		checks = append(checks, ratio("ewma p99 ÷ best stock least-connections-style p99", "≤ 1/3 (0.333)",
			ewma.P99ms, best.P99ms, func(v float64) bool { return v <= 1.0/3 }, "best: "+best.Label))
	}
	if d := byKey["direct"]; d != nil {
		checks = append(checks, ratio("ewma p99 ÷ direct-healthy p99", "≤ 2",
			ewma.P99ms, d.P99ms, func(v float64) bool { return v <= 2 }, ""))
	}
	if rr := byKey["round_robin"]; rr != nil {
		checks = append(checks, ratio("ewma p99 ÷ Caddy round_robin p99 (DESIGN.md)", "≤ 1/5 (0.2)",
			ewma.P99ms, rr.P99ms, func(v float64) bool { return v <= 0.2 }, ""))
	}
	// Below every other proxy's p99 (the DESIGN.md wording).
	var others *row
	for i := range rows {
		r := &rows[i]
		if r.Policy != "ewma" && r.Policy != "direct" && (others == nil || r.P99ms < others.P99ms) {
			others = r
		}
	}
	if others != nil {
		checks = append(checks, ratio("ewma p99 ÷ lowest p99 of every other proxy (DESIGN.md)", "< 1",
			ewma.P99ms, others.P99ms, func(v float64) bool { return v < 1 }, "lowest: "+others.Label))
	}
	return checks
}

// writeMarkdown renders the report.
func (r *report) writeMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# lbx load-balancing benchmark\n\n")
	fmt.Fprintf(&b, "Command: `%s`\n\n", r.Command)
	fmt.Fprintf(&b, "Proxy under test: %s.\n\n", r.Source)
	fmt.Fprintf(&b, "Started %s, took %s. %d CPUs; load average %s at start, %s at end. ", r.Started, r.Elapsed, r.CPUs, orDash(r.LoadStart), orDash(r.LoadEnd))
	writeVersions(&b, r.Versions, "go", "caddy", "nginx", "haproxy")
	fmt.Fprintf(&b, "Load: open loop, %.0f req/s through the proxy (direct: the rate ÷ the number of healthy backends), "+
		"%s warm-up then %s measured per case, %s client timeout (timeouts are errors and count at their full duration in the percentiles); "+
		"median of %d run(s), policies interleaved run after run.\n\n", r.Rate, r.Warmup, r.Duration, r.Timeout, r.Runs)
	fmt.Fprintf(&b, "Backends: 4 on 127.0.0.1. Healthy: %s. Degraded: %s.\n\n", describeModel(r.Fast), describeModel(r.Slow))
	var holdFast, holdSlow []float64
	for _, c := range r.Cases {
		for _, be := range c.Backends {
			switch {
			case be.Served == 0:
			case be.Degraded:
				holdSlow = append(holdSlow, ms(be.MeanService))
			default:
				holdFast = append(holdFast, ms(be.MeanService))
			}
		}
	}
	if len(holdFast) > 0 {
		fmt.Fprintf(&b, "Measured time a worker was held per request (service, stalls and timer lateness; median over cases): healthy %s", fmtMs(median(holdFast)))
		if len(holdSlow) > 0 {
			fmt.Fprintf(&b, ", degraded %s", fmtMs(median(holdSlow)))
		}
		b.WriteString(".\n\n")
	}
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "Note: %s.\n\n", n)
	}
	for _, s := range r.Scenarios {
		fmt.Fprintf(&b, "## Scenario %s — %s\n\n", s.Name, s.Title)
		if len(s.Degraded) > 0 {
			fmt.Fprintf(&b, "Degraded: %s.\n\n", strings.Join(s.Degraded, ", "))
		}
		b.WriteString("| policy | req/s achieved | p50 | p99 | p999 | errors | share to degraded | proxy CPU/request |\n")
		b.WriteString("|---|--:|--:|--:|--:|--:|--:|--:|\n")
		for _, x := range s.Rows {
			errs := fmt.Sprintf("%.0f", x.Errors)
			if x.Timeouts > 0 {
				errs += fmt.Sprintf(" (%.0f timeouts)", x.Timeouts)
			}
			share := "—"
			if x.DegradedShare != nil {
				share = fmt.Sprintf("%.1f%%", 100**x.DegradedShare)
			}
			cpu := "—"
			if x.ProxyCPUus != nil {
				cpu = fmt.Sprintf("%.0f µs", *x.ProxyCPUus)
			}
			fmt.Fprintf(&b, "| %s | %.1f | %s | %s | %s | %s | %s | %s |\n",
				x.Label, x.Throughput, fmtMs(x.P50ms), fmtMs(x.P99ms), fmtMs(x.P999ms), errs, share, cpu)
		}
		b.WriteString("\nPer backend: share of the measured requests that reached it · most requests it held at once (queued + in service) · utilization of its workers.\n\n")
		backendTable(&b, s.Backends, s.Degraded, "degraded", s.Rows)
		if s.CPUPressureMedian != nil {
			fmt.Fprintf(&b, "\nCPU pressure (share of time some task waited for a CPU, Linux PSI) during the measured windows: median %.0f%%, worst %.0f%%.\n",
				100**s.CPUPressureMedian, 100**s.CPUPressureMax)
			if *s.CPUPressureMedian > 0.5 {
				b.WriteString("**Warning:** the machine was short of CPU for most of the measurement; tail latencies show CPU starvation as much as balancing.\n")
			}
		}
		if len(s.Checks) > 0 {
			b.WriteString("\nTargets:\n\n")
			for _, c := range s.Checks {
				val, verdict := "n/a", "not evaluated"
				if c.Value != nil {
					val = fmt.Sprintf("%.3f", *c.Value)
					verdict = "**missed**"
					if c.Met {
						verdict = "met"
					}
				}
				detail := ""
				if c.Detail != "" {
					detail = " (" + c.Detail + ")"
				}
				fmt.Fprintf(&b, "- %s%s: %s, target %s — %s\n", c.Name, detail, val, c.Target, verdict)
			}
		}
		writeCaseNotes(&b, r.Cases, s.Name, func(c caseResult) string { return fmt.Sprintf("run %d", c.Run) })
		b.WriteString("\n")
	}
	b.WriteString("Latencies run from each request's intended send time. p99 differences under ~3 ms are noise on a shared 2-core VM.\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// backendTable renders, per policy (row), each backend's median share of
// the measured requests, most requests held at once and utilization; the
// marked backends' names carry label.
func backendTable(b *strings.Builder, names, marked []string, label string, rows []row) {
	labels := map[string]string{}
	for _, n := range marked {
		labels[n] = label
	}
	labelledBackendTable(b, names, labels, rows)
}

// labelledBackendTable is backendTable with each backend's own label, if
// labels has one.
func labelledBackendTable(b *strings.Builder, names []string, labels map[string]string, rows []row) {
	b.WriteString("| policy |")
	for _, n := range names {
		if l := labels[n]; l != "" {
			n += " (" + l + ")"
		}
		b.WriteString(" " + n + " |")
	}
	b.WriteString("\n|---|" + strings.Repeat("--:|", len(names)) + "\n")
	for _, x := range rows {
		b.WriteString("| " + x.Label + " |")
		for _, n := range names {
			fmt.Fprintf(b, " %.1f%% · %.0f · %.0f%% |", 100*x.Share[n], x.MaxInSystem[n], 100*x.Utilization[n])
		}
		b.WriteString("\n")
	}
}

// describeModel renders a backend model for the report header.
func describeModel(m loadmodel.Model) string {
	s := fmt.Sprintf("%d workers, service %v ±%.0f%% (a sleep)", m.Workers, m.Service, 100*m.Jitter)
	if m.Freeze.Enabled() {
		s += fmt.Sprintf(", stalls %v–%v once every %v", m.Freeze.Min, m.Freeze.Max, m.Freeze.Every)
	}
	return s
}

// fmtMs renders milliseconds with a precision that suits their size.
func fmtMs(v float64) string {
	switch {
	case math.IsNaN(v):
		return "—"
	case v < 10:
		return fmt.Sprintf("%.2f ms", v)
	case v < 100:
		return fmt.Sprintf("%.1f ms", v)
	default:
		return fmt.Sprintf("%.0f ms", v)
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

// writeCaseNotes appends the notes of the cases of scenario to b, each
// named by its policy and by which(c) (its run or seed), under a heading;
// nothing when there is none.
func writeCaseNotes(b *strings.Builder, cases []caseResult, scenario string, which func(caseResult) string) {
	var notes []string
	for _, c := range cases {
		if c.Scenario != scenario {
			continue
		}
		for _, n := range c.Notes {
			notes = append(notes, fmt.Sprintf("%s %s: %s", c.Policy, which(c), n))
		}
	}
	if len(notes) == 0 {
		return
	}
	b.WriteString("\nCase notes:\n\n")
	for _, n := range notes {
		b.WriteString("- " + n + "\n")
	}
}
