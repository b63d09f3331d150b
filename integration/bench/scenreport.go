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

// scenReport is everything `bench scenarios` measured.
type scenReport struct {
	Command string `json:"command"`
	Source  string `json:"source"`
	runHeader
	GOMAXPROC   int               `json:"gomaxprocs"`
	Versions    map[string]string `json:"versions"`
	Calibration *calibration      `json:"calibration,omitempty"`
	Seeds       int               `json:"seeds"`
	FirstSeed   int               `json:"first_seed"`
	Warmup      string            `json:"warmup"`
	Duration    string            `json:"duration"`
	Timeout     string            `json:"timeout"`
	Notes       []string          `json:"notes,omitempty"`
	Variants    []variantSummary  `json:"variants"`
	Cases       []caseResult      `json:"cases"`
}

// stat is a metric's median over seeds and its range.
type stat struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	N      int     `json:"n"`
}

// jsonNum is a float64 that encodes NaN and infinities (which JSON lacks)
// as null.
type jsonNum float64

// MarshalJSON writes the number, or null.
func (x jsonNum) MarshalJSON() ([]byte, error) {
	if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
		return []byte("null"), nil
	}
	return json.Marshal(float64(x))
}

// MarshalJSON writes the stat with null for what it lacks.
func (s stat) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Median jsonNum `json:"median"`
		Min    jsonNum `json:"min"`
		Max    jsonNum `json:"max"`
		N      int     `json:"n"`
	}{jsonNum(s.Median), jsonNum(s.Min), jsonNum(s.Max), s.N})
}

// MarshalJSON writes the verdict with null for what it lacks.
func (v verdict) MarshalJSON() ([]byte, error) {
	type plain verdict
	return json.Marshal(struct {
		plain
		Value jsonNum `json:"value"`
		Limit jsonNum `json:"limit"`
	}{plain(v), jsonNum(v.Value), jsonNum(v.Limit)})
}

// statOf returns the median and range of v (NaN values are left out); the
// zero stat (N 0) if nothing is left.
func statOf(v []float64) stat {
	var xs []float64
	for _, x := range v {
		if !math.IsNaN(x) {
			xs = append(xs, x)
		}
	}
	if len(xs) == 0 {
		return stat{Median: math.NaN(), Min: math.NaN(), Max: math.NaN()}
	}
	return stat{Median: median(slices.Clone(xs)), Min: slices.Min(xs), Max: slices.Max(xs), N: len(xs)}
}

// scenRow is a policy's aggregate over the seeds of a variant.
type scenRow struct {
	// row has the medians of every metric, and the per-backend medians.
	row
	P50      stat `json:"p50_ms_stat"`
	P99      stat `json:"p99_ms_stat"`
	P999     stat `json:"p999_ms_stat"`
	ErrorPct stat `json:"error_pct"`
	// AnsweredP50 is the median latency of the requests answered 200.
	AnsweredP50 stat `json:"answered_p50_ms_stat"`
	// MarkedShare is the share of the attempts that reached the marked
	// backends (degraded, slower, failing or recovering), in %.
	MarkedShare *stat `json:"marked_share_pct,omitempty"`
	// Windows are the p99 (ms) within each named part of the window.
	Windows map[string]stat `json:"windows_p99_ms,omitempty"`
	// Recovery is the recovering backend's comeback, for the recovery
	// variant.
	Recovery *recoveryStat `json:"recovery,omitempty"`
	// ExtraPct is the attempts the backends received beyond the
	// client's requests, as a share of them in % (backups, retries).
	ExtraPct *stat `json:"extra_requests_pct,omitempty"`
}

// recovery is how a recovering backend regained its share in one case.
type recovery struct {
	// First and Next are its share of the arrivals in the first second
	// after the recovery and in the two seconds after that (NaN where the
	// measured window ends first).
	First float64 `json:"share_first_1s"`
	Next  float64 `json:"share_next_2s"`
	// Regain is the time from the recovery to the first 100 ms bucket
	// from which the backend's share over 300 ms reaches 80% of a fair
	// share; NaN if it never does before the window ends.
	Regain float64 `json:"regain_ms"`
	// Available is how much of the window followed the recovery, in ms.
	Available float64 `json:"available_ms"`
}

// recoveryStat aggregates recovery over seeds (shares in %).
type recoveryStat struct {
	First  stat `json:"share_first_1s_pct"`
	Next   stat `json:"share_next_2s_pct"`
	Regain stat `json:"regain_ms"`
	// NotRegained counts the seeds in which the share never came back.
	NotRegained int     `json:"not_regained"`
	Available   float64 `json:"available_ms"`
}

// regainWindow is the span over which the share counts for Regain.
const regainWindow = 3 // buckets

// recoveryOf computes the recovery of backend idx from every backend's
// arrival buckets, the bucket the recovery happens in and the end (one
// past the last bucket) of the measured window.
func recoveryOf(buckets [][]int64, idx, from, end int) recovery {
	at := func(b, k int) int64 {
		if k < len(buckets[b]) {
			return buckets[b][k]
		}
		return 0
	}
	share := func(a, z int) float64 {
		if a >= end {
			return math.NaN()
		}
		z = min(z, end)
		var mine, all int64
		for k := a; k < z; k++ {
			for b := range buckets {
				all += at(b, k)
			}
			mine += at(idx, k)
		}
		if all == 0 {
			return math.NaN()
		}
		return float64(mine) / float64(all)
	}
	per := int(time.Second / loadmodel.ArrivalBucket)
	r := recovery{
		First:     share(from, from+per),
		Next:      share(from+per, from+3*per),
		Regain:    math.NaN(),
		Available: float64(max(0, end-from)) * ms(loadmodel.ArrivalBucket),
	}
	fair := 0.8 / float64(len(buckets))
	for k := from; k+regainWindow <= end; k++ {
		if s := share(k, k+regainWindow); s >= fair {
			r.Regain = float64(k-from) * ms(loadmodel.ArrivalBucket)
			break
		}
	}
	return r
}

// verdict is one target of issue 11, evaluated for lbx ewma on the
// medians over seeds.
type verdict struct {
	Name string `json:"name"`
	// Evaluated is false when the numbers it needs are missing (a
	// policy did not run).
	Evaluated bool    `json:"evaluated"`
	Pass      bool    `json:"pass"`
	Value     float64 `json:"value"`
	Limit     float64 `json:"limit"`
	// Op is the comparison: "≤" or "<".
	Op     string `json:"op"`
	Unit   string `json:"unit"`
	Detail string `json:"detail,omitempty"`
}

func (v verdict) String() string {
	if !v.Evaluated {
		return fmt.Sprintf("n/a %s (%s)", v.Name, v.Detail)
	}
	word := "MISS"
	if v.Pass {
		word = "PASS"
	}
	s := fmt.Sprintf("%s %s: %s %s %s", word, v.Name, fmtUnit(v.Value, v.Unit), v.Op, fmtUnit(v.Limit, v.Unit))
	if v.Detail != "" {
		s += " (" + v.Detail + ")"
	}
	return s
}

func fmtUnit(x float64, unit string) string {
	switch unit {
	case "ms":
		return fmtMs(x)
	case "%":
		return fmt.Sprintf("%.2f%%", x)
	}
	return fmt.Sprintf("%.3g", x)
}

// compare builds a verdict of value op limit.
func compare(name string, value, limit float64, op, unit, detail string) verdict {
	v := verdict{Name: name, Value: value, Limit: limit, Op: op, Unit: unit, Detail: detail}
	if math.IsNaN(value) || math.IsNaN(limit) {
		return v
	}
	v.Evaluated = true
	if op == "<" {
		v.Pass = value < limit
	} else {
		v.Pass = value <= limit
	}
	return v
}

// missing is a verdict that cannot be evaluated.
func missing(name, why string) verdict { return verdict{Name: name, Detail: why} }

// leastConnKeys are the stock least-connections policies of the p99
// target; stockKeys every stock policy.
var (
	leastConnKeys = []string{"least_conn", "nginx", "haproxy"}
	stockKeys     = []string{"round_robin", "least_conn", "random_choose_2", "nginx", "haproxy"}
)

// best returns the row with the lowest median of metric among keys, or
// nil.
func best(rows map[string]*scenRow, keys []string, metric func(*scenRow) float64) *scenRow {
	var b *scenRow
	for _, k := range keys {
		if r := rows[k]; r != nil && !math.IsNaN(metric(r)) && (b == nil || metric(r) < metric(b)) {
			b = r
		}
	}
	return b
}

// p99Limit is the p99 target: max(1.1 × best, best + 2 ms).
func p99Limit(best float64) float64 { return max(1.1*best, best+2) }

// verdicts evaluates the targets of a variant of kind k for lbx ewma.
func verdicts(k verdictKind, windows []window, rowList []scenRow) []verdict {
	rows := map[string]*scenRow{}
	for i := range rowList {
		rows[rowList[i].Policy] = &rowList[i]
	}
	ewma := rows["ewma"]
	if ewma == nil {
		return nil
	}
	var out []verdict
	p99 := func(r *scenRow) float64 { return r.P99.Median }
	if b := best(rows, leastConnKeys, p99); b != nil {
		out = append(out, compare("p99 ≤ max(1.1 × best, best + 2 ms)", ewma.P99.Median, p99Limit(b.P99.Median), "≤", "ms",
			fmt.Sprintf("best least-connections: %s %s", b.Label, fmtMs(b.P99.Median))))
	} else {
		out = append(out, missing("p99 ≤ max(1.1 × best, best + 2 ms)", "no least-connections policy ran"))
	}
	for _, w := range windows {
		wp := func(r *scenRow) float64 {
			if s, ok := r.Windows[w.name]; ok {
				return s.Median
			}
			return math.NaN()
		}
		name := "p99 within the " + w.name + " ≤ max(1.1 × best, best + 2 ms)"
		if b := best(rows, leastConnKeys, wp); b != nil {
			out = append(out, compare(name, wp(ewma), p99Limit(wp(b)), "≤", "ms",
				fmt.Sprintf("best least-connections: %s %s", b.Label, fmtMs(wp(b)))))
		} else {
			out = append(out, missing(name, "no least-connections policy ran"))
		}
	}
	fastFail := k == targetsFastFail || k == targetsFastFailRetries
	if lc := rows["least_conn"]; lc != nil && fastFail {
		// least_conn's instant failures would lower its p50 without
		// anyone being served faster: compare the answered requests
		out = append(out, compare("p50 of answered requests ≤ 1.05 × Caddy least_conn's", ewma.AnsweredP50.Median, 1.05*lc.AnsweredP50.Median, "≤", "ms",
			"Caddy least_conn "+fmtMs(lc.AnsweredP50.Median)))
	} else if lc != nil {
		out = append(out, compare("p50 ≤ 1.05 × Caddy least_conn", ewma.P50.Median, 1.05*lc.P50.Median, "≤", "ms",
			"Caddy least_conn "+fmtMs(lc.P50.Median)))
	} else {
		out = append(out, missing("p50 ≤ 1.05 × Caddy least_conn", "least_conn did not run"))
	}
	share := math.NaN()
	if ewma.MarkedShare != nil {
		share = ewma.MarkedShare.Median
	}
	errDetail := fmt.Sprintf("max over seeds %.2f%%", ewma.ErrorPct.Max)
	switch k {
	case targetsFastFail, targetsFastFailRetries:
		out = append(out, compare("share to the failing backend < 2%", share, 2, "<", "%", ""))
		if k == targetsFastFail {
			out = append(out, compare("client errors ≤ 2%", ewma.ErrorPct.Median, 2, "≤", "%", errDetail))
		} else {
			out = append(out, compare("0 client errors in every seed", ewma.ErrorPct.Max, 0, "≤", "%", errDetail))
		}
	default:
		out = append(out, compare("0 errors in every seed", ewma.ErrorPct.Max, 0, "≤", "%", errDetail))
	}
	if k == targetsDegraded {
		if b := best(rows, stockKeys, p99); b != nil {
			out = append(out, compare("p99 ≤ best stock ÷ 3", ewma.P99.Median, b.P99.Median/3, "≤", "ms",
				fmt.Sprintf("best stock: %s %s", b.Label, fmtMs(b.P99.Median))))
		} else {
			out = append(out, missing("p99 ≤ best stock ÷ 3", "no stock policy ran"))
		}
		if d := rows["direct"]; d != nil {
			out = append(out, compare("p99 ≤ 2 × direct", ewma.P99.Median, 2*d.P99.Median, "≤", "ms",
				"direct "+fmtMs(d.P99.Median)))
		} else {
			out = append(out, missing("p99 ≤ 2 × direct", "direct did not run"))
		}
	}
	return out
}

// variantSummary is a variant's table and verdict.
type variantSummary struct {
	Name       string            `json:"name"`
	Class      string            `json:"class"`
	Title      string            `json:"title"`
	About      string            `json:"about"`
	Load       string            `json:"load"`
	Rate       float64           `json:"rate"`
	DirectRate float64           `json:"direct_rate"`
	Steps      []loadmodel.Step  `json:"steps,omitempty"`
	Models     []loadmodel.Model `json:"backends"`
	Marked     []string          `json:"marked"`
	MarkLabel  string            `json:"mark_label,omitempty"`
	Weights    []int             `json:"weights,omitempty"`
	Notes      []string          `json:"notes,omitempty"`
	Windows    []string          `json:"windows,omitempty"`
	RecoverAt  string            `json:"recover_at,omitempty"`
	Rows       []scenRow         `json:"rows"`
	Verdicts   []verdict         `json:"verdicts"`
	// CPUPressure is the median and worst CPU pressure of the cases.
	CPUPressure *stat `json:"cpu_pressure,omitempty"`
	// SendLagMaxMs is the worst load-generator lag of the cases.
	SendLagMaxMs float64 `json:"max_send_lag_ms"`
}

// summarizeVariant aggregates the variant's cases per policy and
// evaluates the targets.
func summarizeVariant(v variant, cfg *scenConfig, pols []policy, cases []caseResult) variantSummary {
	vs := variantSummary{
		Name: v.name, Class: v.class, Title: v.title, About: v.about, Load: v.load,
		Rate: v.rate, DirectRate: v.directRate, Steps: v.steps, MarkLabel: v.markLabel,
		Weights: v.proxy.Weights, Notes: v.notes,
	}
	for _, w := range v.windows {
		vs.Windows = append(vs.Windows, fmt.Sprintf("%s: %v–%v", w.name, w.from.Round(time.Millisecond), w.to.Round(time.Millisecond)))
	}
	if v.recoverAt > 0 {
		vs.RecoverAt = v.recoverAt.String()
	}
	for i, m := range seedModels(v, cfg.firstSeed, cfg.warmup) {
		m.Seed, m.Freeze.Seed = 0, 0 // seeds differ per seed; the JSON cases have them
		vs.Models = append(vs.Models, m)
		if v.marked != nil && v.marked[i] {
			vs.Marked = append(vs.Marked, m.Name)
		}
	}
	recoverIdx := slices.Index(v.marked, true)
	from := int((cfg.warmup + v.recoverAt) / loadmodel.ArrivalBucket)
	end := int((cfg.warmup + cfg.duration) / loadmodel.ArrivalBucket)
	var psi []float64
	pols = variantPolicies(v, pols, cfg.autoOK)
	for _, p := range pols {
		var runs []caseResult
		for _, c := range cases {
			if c.Policy == p.key {
				runs = append(runs, c)
			}
		}
		if len(runs) == 0 {
			continue
		}
		var rec []recovery
		if v.recoverAt > 0 && p.kind != kindDirect && recoverIdx >= 0 {
			for _, c := range runs {
				bs := make([][]int64, len(c.Backends))
				for i, b := range c.Backends {
					bs[i] = b.Buckets
				}
				rec = append(rec, recoveryOf(bs, recoverIdx, from, end))
			}
		}
		vs.Rows = append(vs.Rows, aggregateRow(p, runs, v.windows, rec))
		for _, c := range runs {
			if c.CPUPressure != nil {
				psi = append(psi, *c.CPUPressure)
			}
			vs.SendLagMaxMs = max(vs.SendLagMaxMs, c.MaxSendLagMs)
		}
	}
	if len(psi) > 0 {
		s := statOf(psi)
		vs.CPUPressure = &s
	}
	switch v.kind {
	case targetsHedge:
		vs.Verdicts = hedgeVerdicts(vs.Rows, pols, selectiveDefaultBudget)
	case targetsPartial, targetsPartialRetries:
		vs.Verdicts = partialVerdicts(v.kind, vs.Rows, v.models, v.marked)
	default:
		vs.Verdicts = verdicts(v.kind, v.windows, vs.Rows)
	}
	return vs
}

// aggregateRow takes a policy's medians and ranges over its runs (one per
// seed), and the recoveries if any.
func aggregateRow(p policy, runs []caseResult, windows []window, rec []recovery) scenRow {
	r := scenRow{row: medianRow(p, runs)}
	of := func(f func(caseResult) float64) stat {
		v := make([]float64, len(runs))
		for i, c := range runs {
			v[i] = f(c)
		}
		return statOf(v)
	}
	r.P50 = of(func(c caseResult) float64 { return ms(c.Summary.P50) })
	r.AnsweredP50 = of(func(c caseResult) float64 { return ms(c.Summary.AnsweredP50) })
	r.P99 = of(func(c caseResult) float64 { return ms(c.Summary.P99) })
	r.P999 = of(func(c caseResult) float64 { return ms(c.Summary.P999) })
	r.ErrorPct = of(func(c caseResult) float64 {
		if c.Summary.Requests == 0 {
			return math.NaN()
		}
		return 100 * float64(c.Summary.Errors) / float64(c.Summary.Requests)
	})
	if s := of(func(c caseResult) float64 { return 100 * extraShare(c) }); s.N > 0 {
		r.ExtraPct = &s
	}
	if s := of(func(c caseResult) float64 {
		if c.DegradedShare == nil {
			return math.NaN()
		}
		return 100 * *c.DegradedShare
	}); s.N > 0 {
		r.MarkedShare = &s
	}
	for _, w := range windows {
		if r.Windows == nil {
			r.Windows = map[string]stat{}
		}
		r.Windows[w.name] = of(func(c caseResult) float64 {
			if s, ok := c.Windows[w.name]; ok && s.Requests > 0 {
				return ms(s.P99)
			}
			return math.NaN()
		})
	}
	if len(rec) > 0 {
		rs := &recoveryStat{Available: rec[0].Available}
		var first, next, regain []float64
		for _, x := range rec {
			first = append(first, 100*x.First)
			next = append(next, 100*x.Next)
			if math.IsNaN(x.Regain) {
				rs.NotRegained++
				regain = append(regain, math.Inf(1))
			} else {
				regain = append(regain, x.Regain)
			}
		}
		rs.First, rs.Next, rs.Regain = statOf(first), statOf(next), statOf(regain)
		r.Recovery = rs
	}
	return r
}

// fmtStat renders a stat of milliseconds as "median [min–max]".
func fmtStat(s stat, f func(float64) string) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 || s.Min == s.Max {
		return f(s.Median)
	}
	return fmt.Sprintf("%s [%s–%s]", f(s.Median), strings.TrimSuffix(f(s.Min), " ms"), f(s.Max))
}

func fmtPct(x float64) string {
	switch {
	case math.IsNaN(x):
		return "—"
	case x == 0:
		return "0%"
	case x < 0.1:
		return fmt.Sprintf("%.2f%%", x)
	default:
		return fmt.Sprintf("%.1f%%", x)
	}
}

func fmtRegain(x float64) string {
	if math.IsInf(x, 1) {
		return "never"
	}
	return fmt.Sprintf("%.0f ms", x)
}

// writeMarkdown renders the report.
func (r *scenReport) writeMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# lbx scenario classes (issue 11)\n\n")
	fmt.Fprintf(&b, "Command: `%s`\n\n", r.Command)
	fmt.Fprintf(&b, "Proxy under test: %s.\n\n", r.Source)
	r.runHeader.writeMarkdown(&b, fmt.Sprintf(" (GOMAXPROCS %d)", r.GOMAXPROC))
	writeVersions(&b, r.Versions, "go", "caddy", "nginx", "haproxy")
	if c := r.Calibration; c != nil {
		fmt.Fprintf(&b, "Calibration: a backend of %s served %.0f req/s saturated, holding its worker %.2f ms per request; the variants' rates assume %.0f req/s",
			c.Service, c.Capacity, c.HoldMs, c.Assumed)
		if dev := c.Capacity/c.Assumed - 1; math.Abs(dev) > 0.15 {
			fmt.Fprintf(&b, " — **this machine differs by %+.0f%%: the utilizations stated below are off by as much**", 100*dev)
		}
		b.WriteString(".\n\n")
	}
	fmt.Fprintf(&b, "Load: open loop at each variant's rate, %s warm-up then %s measured per case, %s client timeout (a timeout is an error and counts at its full duration); "+
		"seeds %d–%d (a seed selects every backend's stalls and jitter; all policies of a seed meet the same schedule); policies run in turn, in an order rotated per seed. "+
		"Tables show the median over seeds and [min–max]. Latency runs from each request's intended send time.\n\n",
		r.Warmup, r.Duration, r.Timeout, r.FirstSeed, r.FirstSeed+r.Seeds-1)
	b.WriteString("Backends (unless a variant says otherwise): 1 worker each, service 4 ms ±25% (a sleep), on 127.0.0.1; " +
		"a degraded backend serves 40 ms and stalls 50–100 ms every ~2 s. direct: one healthy backend hit without a proxy at its share under ideal balancing.\n\n")
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "Note: %s.\n\n", n)
	}

	// The summary: ewma against the best least-connections policy.
	b.WriteString("## Summary: lbx ewma vs the best stock least-connections policy\n\n")
	b.WriteString("| variant | ewma p99 | best least-conn p99 | p99 target | ewma p50 | least_conn p50 | verdicts passed |\n")
	b.WriteString("|---|--:|--:|--:|--:|--:|--:|\n")
	for _, v := range r.Variants {
		rows := map[string]*scenRow{}
		for i := range v.Rows {
			rows[v.Rows[i].Policy] = &v.Rows[i]
		}
		e := rows["ewma"]
		if e == nil {
			continue
		}
		bl, limit := "—", "—"
		if x := best(rows, leastConnKeys, func(r *scenRow) float64 { return r.P99.Median }); x != nil {
			bl = fmt.Sprintf("%s (%s)", fmtMs(x.P99.Median), x.Label)
			limit = "≤ " + fmtMs(p99Limit(x.P99.Median))
		}
		lc := "—"
		if x := rows["least_conn"]; x != nil {
			lc = fmtMs(x.P50.Median)
		}
		pass, eval := 0, 0
		var missed []string
		for _, vd := range v.Verdicts {
			if vd.Evaluated {
				eval++
				if vd.Pass {
					pass++
				} else {
					missed = append(missed, vd.Name)
				}
			}
		}
		verd := fmt.Sprintf("%d/%d", pass, eval)
		if len(missed) > 0 {
			verd += " (MISS: " + strings.Join(missed, "; ") + ")"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", v.Name, fmtMs(e.P99.Median), bl, limit, fmtMs(e.P50.Median), lc, verd)
	}
	b.WriteString("\n")

	for _, v := range r.Variants {
		writeVariant(&b, v, r.Cases)
	}
	b.WriteString("p99 differences under ~3 ms are noise on a shared 2-core VM; read the ranges.\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// writeVariant renders one variant's section.
func writeVariant(b *strings.Builder, v variantSummary, cases []caseResult) {
	fmt.Fprintf(b, "## %s — %s\n\n", v.Name, v.Title)
	fmt.Fprintf(b, "%s\n\n", v.About)
	if v.Rate > 0 {
		fmt.Fprintf(b, "Load: %.0f req/s (%s); direct: %.0f req/s.", v.Rate, v.Load, v.DirectRate)
	} else {
		fmt.Fprintf(b, "Load: %s.", v.Load)
	}
	if len(v.Steps) > 0 {
		var st []string
		for _, s := range v.Steps {
			st = append(st, fmt.Sprintf("%.0f req/s from %v", s.Rate, s.At.Round(time.Millisecond)))
		}
		fmt.Fprintf(b, " Steps: %s.", strings.Join(st, ", "))
	}
	if v.RecoverAt != "" {
		fmt.Fprintf(b, " The recovering backend becomes healthy %s into the measured window.", v.RecoverAt)
	}
	b.WriteString(" Backends: " + describeBackends(v) + ".\n\n")
	for _, n := range v.Notes {
		fmt.Fprintf(b, "Note: %s.\n\n", n)
	}
	hasShare, hasWin := v.MarkLabel != "", len(v.Windows) > 0
	b.WriteString("| policy | p50 | p99 | p99.9 | errors (median, max) |")
	if hasShare {
		b.WriteString(" share to " + v.MarkLabel + " |")
	}
	b.WriteString(" proxy CPU/request |")
	hasExtra := v.Class == "hedge"
	if hasExtra {
		b.WriteString(" extra requests |")
	}
	if hasWin {
		b.WriteString(" p99 in step |")
	}
	b.WriteString("\n|---|--:|--:|--:|--:|--:|")
	if hasShare {
		b.WriteString("--:|")
	}
	if hasExtra {
		b.WriteString("--:|")
	}
	if hasWin {
		b.WriteString("--:|")
	}
	b.WriteString("\n")
	for _, x := range v.Rows {
		cpu := "—"
		if x.ProxyCPUus != nil {
			cpu = fmt.Sprintf("%.0f µs", *x.ProxyCPUus)
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s, %s |", x.Label, fmtStat(x.P50, fmtMs), fmtStat(x.P99, fmtMs), fmtStat(x.P999, fmtMs),
			fmtPct(x.ErrorPct.Median), fmtPct(x.ErrorPct.Max))
		if hasShare {
			sh := "—"
			if x.MarkedShare != nil {
				sh = fmtStat(*x.MarkedShare, fmtPct)
			}
			fmt.Fprintf(b, " %s |", sh)
		}
		fmt.Fprintf(b, " %s |", cpu)
		if hasExtra {
			ex := "—"
			if x.ExtraPct != nil {
				ex = fmtStat(*x.ExtraPct, fmtPct)
			}
			fmt.Fprintf(b, " %s |", ex)
		}
		if hasWin {
			fmt.Fprintf(b, " %s |", fmtStat(x.Windows["step"], fmtMs))
		}
		b.WriteString("\n")
	}
	if len(v.Models) <= 8 {
		b.WriteString("\nPer backend (medians): share of the measured requests that reached it · most requests it held at once · utilization of its worker.\n\n")
		writeBackendTable(b, v.Models, v.Marked, v.MarkLabel, v.Rows)
	}
	var recRows []scenRow
	for _, x := range v.Rows {
		if x.Recovery != nil {
			recRows = append(recRows, x)
		}
	}
	if len(recRows) > 0 {
		fmt.Fprintf(b, "\nRecovery of %s: its share of all arrivals in the first second after it recovered and in the two seconds after that (a fair share is %.0f%%), "+
			"and the time until its share over %d ms first reaches 80%% of fair, from arrivals per 100 ms (%.0f ms of the window followed the recovery).\n\n",
			strings.Join(v.Marked, ", "), 100/float64(len(v.Models)), regainWindow*100, recRows[0].Recovery.Available)
		b.WriteString("| policy | share [t, t+1s] | share [t+1s, t+3s] | time to 80% of fair |\n|---|--:|--:|--:|\n")
		for _, x := range recRows {
			rc := x.Recovery
			reg := fmtStat(rc.Regain, fmtRegain)
			if rc.NotRegained > 0 {
				reg += fmt.Sprintf(" (never in %d of %d)", rc.NotRegained, rc.Regain.N)
			}
			fmt.Fprintf(b, "| %s | %s | %s | %s |\n", x.Label, fmtStat(rc.First, fmtPct), fmtStat(rc.Next, fmtPct), reg)
		}
	}
	if s := v.CPUPressure; s != nil {
		fmt.Fprintf(b, "\nCPU pressure (Linux PSI, share of time some task waited for a CPU) during the measured windows: median %.0f%%, worst %.0f%%.", 100*s.Median, 100*s.Max)
		if s.Median > 0.5 {
			b.WriteString(" **The machine was short of CPU for most of the measurement; tails show CPU starvation as much as balancing.**")
		}
		b.WriteString("\n")
	}
	if len(v.Verdicts) > 0 {
		if v.Class == "hedge" || v.Class == "partialfail" {
			b.WriteString("\nVerdicts per form (medians over seeds):\n\n")
		} else {
			b.WriteString("\nVerdict for lbx ewma (medians over seeds):\n\n")
		}
		for _, vd := range v.Verdicts {
			b.WriteString("- " + vd.String() + "\n")
		}
	}
	writeCaseNotes(b, cases, v.Name, func(c caseResult) string { return fmt.Sprintf("seed %d", c.Seed) })
	b.WriteString("\n")
}

// describeBackends renders a variant's backends, grouping equal models.
func describeBackends(v variantSummary) string {
	var parts []string
	for i := 0; i < len(v.Models); {
		j := i + 1
		for j < len(v.Models) && sameModel(v.Models[i], v.Models[j]) {
			j++
		}
		names := v.Models[i].Name
		if j-i > 1 {
			names += "–" + v.Models[j-1].Name
		}
		parts = append(parts, names+" "+describeClassModel(v.Models[i]))
		i = j
	}
	return strings.Join(parts, "; ")
}

func sameModel(a, b loadmodel.Model) bool {
	a.Name, b.Name = "", ""
	return a == b
}

// describeClassModel renders a backend model briefly.
func describeClassModel(m loadmodel.Model) string {
	s := fmt.Sprintf("%v", m.Service)
	if m.Workers != 1 {
		s += fmt.Sprintf(" × %d workers", m.Workers)
	}
	if m.Freeze.Enabled() {
		s += fmt.Sprintf(", stalls %v–%v every ~%v", m.Freeze.Min, m.Freeze.Max, m.Freeze.Every)
	}
	if m.Fail != loadmodel.FailNone {
		s += ", fails every request with " + m.Fail.String()
	}
	if m.Change.Enabled() {
		s += fmt.Sprintf(", then %v from %v after the epoch", m.Change.Service, m.Change.At)
	}
	return s
}

// writeBackendTable renders, per policy, each backend's median share,
// most requests held at once and utilization.
func writeBackendTable(b *strings.Builder, models []loadmodel.Model, marked []string, label string, rows []scenRow) {
	names := make([]string, len(models))
	for i, m := range models {
		names[i] = m.Name
	}
	plain := make([]row, len(rows))
	for i, r := range rows {
		plain[i] = r.row
	}
	backendTable(b, names, marked, label, plain)
}
