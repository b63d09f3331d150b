package lbpolicy

import (
	"math"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/metricsreg"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// stateCollector exposes lbx's per-upstream and per-pool state as
// Prometheus metrics. It reads the shared state at scrape time, so the hot
// paths pay nothing for metrics.
//
// The upstream series are capped: the first maxUpstreamSeries addresses,
// in dial order (so the set is stable from scrape to scrape), get series
// of their own; the rest are added up under upstream="_other" (counters
// and the ejected gauge summed; answer median, expected latency, failure
// ratio and reported utilization their highest). The
// count of upstreams by state, caddy_lbx_upstreams, covers every address.
// A pool of hundreds of thousands of upstreams (a naming file) would
// otherwise make a scrape of hundreds of megabytes that no Prometheus
// takes in time.
type stateCollector struct{}

// maxUpstreamSeries is how many upstream addresses get series of their own.
const maxUpstreamSeries = 1000

// otherUpstreams is the upstream label of the series that add up the
// addresses beyond maxUpstreamSeries. No dial address looks like it.
const otherUpstreams = "_other"

var (
	descAnswerMedian = prometheus.NewDesc("caddy_lbx_upstream_answer_median_seconds",
		"What the upstream's answers took: the median time to response headers of its recent answers, kept while it is ejected or failing (upstreams that answered). Not what selection uses: see caddy_lbx_upstream_expected_latency_seconds.", []string{"upstream"}, nil)
	descExpected = prometheus.NewDesc("caddy_lbx_upstream_expected_latency_seconds",
		"The latency selection expects of one more request to the upstream now: the answer median or the pool's typical latency, raised by a stall in progress, by failures in a row and by its failure ratio; +Inf while it is ejected.", []string{"upstream"}, nil)
	descFailureRatio = prometheus.NewDesc("caddy_lbx_upstream_failure_ratio",
		"Recent, time-decayed share of the upstream's attempts that failed, 0 to 1.", []string{"upstream"}, nil)
	descSamples = prometheus.NewDesc("caddy_lbx_upstream_samples_total",
		"Attempts observed for the upstream (successes and failures).", []string{"upstream"}, nil)
	descFailures = prometheus.NewDesc("caddy_lbx_upstream_failures_total",
		"Attempts to the upstream that failed: transport errors, timeouts and, with outlier detection, failure statuses.", []string{"upstream"}, nil)
	descEjected = prometheus.NewDesc("caddy_lbx_upstream_ejected",
		"1 while the upstream is ejected by outlier detection, else 0.", []string{"upstream"}, nil)
	descEjections = prometheus.NewDesc("caddy_lbx_upstream_ejections_total",
		"Ejections of the upstream by outlier detection, by reason.", []string{"upstream", "reason"}, nil)
	descOverflow = prometheus.NewDesc("caddy_lbx_upstream_ejections_overflow_total",
		"Ejections of the upstream that max_ejection_percent refused: it met a rule while the pool was at its cap.", []string{"upstream"}, nil)
	descReportedUtil = prometheus.NewDesc("caddy_lbx_upstream_reported_utilization",
		"The utilization the upstream last reported in an ORCA load report (application_utilization when above 0, else cpu_utilization; may exceed 1). Only while the report is fresh (younger than load_reports max_age).", []string{"upstream"}, nil)
	descReportsRefused = prometheus.NewDesc("caddy_lbx_upstream_load_reports_refused_total",
		"ORCA load reports from the upstream that did not parse and were refused (upstreams with one refused or more).", []string{"upstream"}, nil)
	descLoadProbes = prometheus.NewDesc("caddy_lbx_upstream_load_probes_total",
		"Load probes sent to the upstream (load_reports probe), by result: ok, failed (no answer in time, or a 5xx) or rejected (a 4xx). Upstreams that were probed only.", []string{"upstream", "result"}, nil)
	descUpstreams = prometheus.NewDesc("caddy_lbx_upstreams",
		"Upstream addresses in use by lbx's policies, by state: healthy, failing (the last attempts failed), ejected (by outlier detection), unsampled (no attempt finished yet). Covers every address, also those beyond the per-upstream series cap.", []string{"state"}, nil)
	descPanic = prometheus.NewDesc("caddy_lbx_pool_panic",
		"1 while the pool is in panic mode (too few upstreams available; health ignored), else 0.", []string{"policy", "upstreams"}, nil)
	descPanicEntered = prometheus.NewDesc("caddy_lbx_pool_panic_entered_total",
		"Times the pool entered panic mode.", []string{"policy", "upstreams"}, nil)
	descRetriesRefused = prometheus.NewDesc("caddy_lbx_pool_retries_refused_total",
		"Retries the pool's retry budget refused (pools with a retry budget only).", []string{"policy", "upstreams"}, nil)
)

// Describe implements prometheus.Collector.
func (stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descAnswerMedian, descExpected, descFailureRatio, descSamples, descFailures, descEjected, descEjections, descOverflow, descReportedUtil, descReportsRefused, descLoadProbes, descUpstreams, descPanic, descPanicEntered, descRetriesRefused} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (stateCollector) Collect(ch chan<- prometheus.Metric) {
	now := monoclock.Now()
	// The addresses with series of their own: the first in dial order.
	// A heap finds them without sorting the whole list.
	first := newFirstN(maxUpstreamSeries, statsByDial)
	hoststate.Each(func(s *hoststate.Stats) bool {
		first.offer(s)
		return true
	})
	own := make(map[*hoststate.Stats]bool, len(first.h))
	for _, s := range first.h {
		own[s] = true
	}
	states := map[string]int{stateHealthy: 0, stateFailing: 0, stateEjected: 0, stateUnsampled: 0}
	var other otherSeries
	// Read under the registry's lock, send after it: a scrape that blocks
	// on its channel must not hold up configs taking new addresses.
	prices := policyTables()
	snaps := make([]rated, 0, len(own))
	hoststate.Each(func(st *hoststate.Stats) bool {
		s := rated{snap: st.Snapshot(now)}
		if priced(s.snap) {
			s.expected = prices.expected(st, now)
		}
		states[upstreamState(s.snap)]++
		if own[st] {
			snaps = append(snaps, s)
		} else {
			other.add(s, now)
		}
		return true
	})
	for _, r := range snaps {
		s := r.snap
		if s.AnswerMedian > 0 {
			ch <- prometheus.MustNewConstMetric(descAnswerMedian, prometheus.GaugeValue, s.AnswerMedian.Seconds(), s.Dial)
		}
		if priced(s) {
			ch <- prometheus.MustNewConstMetric(descExpected, prometheus.GaugeValue, r.expected/1e9, s.Dial)
		}
		ch <- prometheus.MustNewConstMetric(descFailureRatio, prometheus.GaugeValue, s.FailureRatio, s.Dial)
		ch <- prometheus.MustNewConstMetric(descSamples, prometheus.CounterValue, float64(s.Samples), s.Dial)
		ch <- prometheus.MustNewConstMetric(descFailures, prometheus.CounterValue, float64(s.Failures), s.Dial)
		ejected := 0.0
		if s.EjectedFor > 0 {
			ejected = 1
		}
		ch <- prometheus.MustNewConstMetric(descEjected, prometheus.GaugeValue, ejected, s.Dial)
		ch <- prometheus.MustNewConstMetric(descOverflow, prometheus.CounterValue, float64(s.Overflows), s.Dial)
		for r, n := range s.Outlier.ByReason {
			ch <- prometheus.MustNewConstMetric(descEjections, prometheus.CounterValue, float64(n), s.Dial, hoststate.EjectReason(r).String())
		}
		if u, ok := reportedUtilization(s.LoadReport, now); ok {
			ch <- prometheus.MustNewConstMetric(descReportedUtil, prometheus.GaugeValue, u, s.Dial)
		}
		if s.ReportsRefused > 0 {
			ch <- prometheus.MustNewConstMetric(descReportsRefused, prometheus.CounterValue, float64(s.ReportsRefused), s.Dial)
		}
		collectLoadProbes(ch, s.Probes, s.Dial)
	}
	if other.n > 0 {
		other.collect(ch)
	}
	for state, n := range states {
		ch <- prometheus.MustNewConstMetric(descUpstreams, prometheus.GaugeValue, float64(n), state)
	}

	// Several handlers may serve the same pool with the same policy: one
	// series per (policy, upstreams), panicking if any of them is.
	type key struct{ policy, upstreams string }
	type agg struct {
		panic    bool
		entered  uint64
		budgeted bool
		refused  uint64
	}
	pools := map[key]*agg{}
	var order []key
	for _, p := range allPoolStatuses() {
		k := key{p.Policy, p.Name}
		a, ok := pools[k]
		if !ok {
			a = new(agg)
			pools[k] = a
			order = append(order, k)
		}
		a.panic = a.panic || p.Panic
		a.entered += p.PanicEntered
		if p.RetryBudget != nil {
			a.budgeted = true
			a.refused += p.RetryBudget.Refused
		}
	}
	for _, k := range order {
		a := pools[k]
		on := 0.0
		if a.panic {
			on = 1
		}
		ch <- prometheus.MustNewConstMetric(descPanic, prometheus.GaugeValue, on, k.policy, k.upstreams)
		ch <- prometheus.MustNewConstMetric(descPanicEntered, prometheus.CounterValue, float64(a.entered), k.policy, k.upstreams)
		if a.budgeted {
			ch <- prometheus.MustNewConstMetric(descRetriesRefused, prometheus.CounterValue, float64(a.refused), k.policy, k.upstreams)
		}
	}
}

// otherSeries adds up the upstreams beyond maxUpstreamSeries.
type otherSeries struct {
	n                            int
	samples, failures, overflows uint64
	refused                      uint64 // load reports refused
	probes                       [hoststate.NumProbeResults]uint64
	util                         float64 // the highest fresh reported utilization
	reported                     bool    // some upstream has a fresh one
	ejected                      int
	byReason                     [hoststate.NumEjectReasons]uint64
	median, expected, ratio      float64 // the highest of each, s
	answered, priced             bool
}

func (o *otherSeries) add(r rated, now int64) {
	s := r.snap
	o.n++
	o.refused += s.ReportsRefused
	for r, n := range s.Probes {
		o.probes[r] += n
	}
	if u, ok := reportedUtilization(s.LoadReport, now); ok {
		o.util = math.Max(o.util, u)
		o.reported = true
	}
	o.samples += s.Samples
	o.failures += s.Failures
	o.overflows += s.Overflows
	if s.EjectedFor > 0 {
		o.ejected++
	}
	for r, n := range s.Outlier.ByReason {
		o.byReason[r] += n
	}
	if s.AnswerMedian > 0 {
		o.median = math.Max(o.median, s.AnswerMedian.Seconds())
		o.answered = true
	}
	if priced(s) {
		o.expected = math.Max(o.expected, r.expected/1e9)
		o.priced = true
	}
	o.ratio = math.Max(o.ratio, s.FailureRatio)
}

func (o *otherSeries) collect(ch chan<- prometheus.Metric) {
	if o.answered {
		ch <- prometheus.MustNewConstMetric(descAnswerMedian, prometheus.GaugeValue, o.median, otherUpstreams)
	}
	if o.priced {
		ch <- prometheus.MustNewConstMetric(descExpected, prometheus.GaugeValue, o.expected, otherUpstreams)
	}
	ch <- prometheus.MustNewConstMetric(descFailureRatio, prometheus.GaugeValue, o.ratio, otherUpstreams)
	ch <- prometheus.MustNewConstMetric(descSamples, prometheus.CounterValue, float64(o.samples), otherUpstreams)
	ch <- prometheus.MustNewConstMetric(descFailures, prometheus.CounterValue, float64(o.failures), otherUpstreams)
	ch <- prometheus.MustNewConstMetric(descEjected, prometheus.GaugeValue, float64(o.ejected), otherUpstreams)
	ch <- prometheus.MustNewConstMetric(descOverflow, prometheus.CounterValue, float64(o.overflows), otherUpstreams)
	for r, n := range o.byReason {
		ch <- prometheus.MustNewConstMetric(descEjections, prometheus.CounterValue, float64(n), otherUpstreams, hoststate.EjectReason(r).String())
	}
	if o.reported {
		ch <- prometheus.MustNewConstMetric(descReportedUtil, prometheus.GaugeValue, o.util, otherUpstreams)
	}
	if o.refused > 0 {
		ch <- prometheus.MustNewConstMetric(descReportsRefused, prometheus.CounterValue, float64(o.refused), otherUpstreams)
	}
	collectLoadProbes(ch, o.probes, otherUpstreams)
}

// collectLoadProbes sends the load probe counts of upstream, one series
// per result, when any probe was sent to it.
func collectLoadProbes(ch chan<- prometheus.Metric, n [hoststate.NumProbeResults]uint64, upstream string) {
	if n == ([hoststate.NumProbeResults]uint64{}) {
		return
	}
	for r, c := range n {
		ch <- prometheus.MustNewConstMetric(descLoadProbes, prometheus.CounterValue, float64(c), upstream, hoststate.ProbeResult(r).String())
	}
}

// reportedUtilization returns the utilization of r, when r is a fresh
// report that has one: a stale report's number is not shown as current.
func reportedUtilization(r *hoststate.LoadReport, now int64) (float64, bool) {
	if r == nil || r.Stale(now) {
		return 0, false
	}
	return r.Utilization()
}

var collector stateCollector

// registerMetrics adds lbx's metrics to the config's metrics registry (the
// one Caddy's /metrics endpoints serve). It is called from every lbx
// policy's Provision; registering again is harmless.
func registerMetrics(ctx caddy.Context) error {
	if err := metricsreg.Register(ctx, collector); err != nil {
		return err
	}
	return metricsreg.Register(ctx, drainCollector{})
}
