package lbpolicy

import (
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/metricsreg"
)

// stateCollector exposes lbx's per-upstream and per-pool state as
// Prometheus metrics. It reads the shared state at scrape time, so the hot
// paths pay nothing for metrics.
type stateCollector struct{}

var (
	descEstimate = prometheus.NewDesc("caddy_lbx_upstream_latency_estimate_seconds",
		"Latency estimate of the upstream: the median time to response headers of its recent answers.", []string{"upstream"}, nil)
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
	descPanic = prometheus.NewDesc("caddy_lbx_pool_panic",
		"1 while the pool is in panic mode (too few upstreams available; health ignored), else 0.", []string{"policy", "upstreams"}, nil)
	descPanicEntered = prometheus.NewDesc("caddy_lbx_pool_panic_entered_total",
		"Times the pool entered panic mode.", []string{"policy", "upstreams"}, nil)
	descRetriesRefused = prometheus.NewDesc("caddy_lbx_pool_retries_refused_total",
		"Retries the pool's retry budget refused (pools with a retry budget only).", []string{"policy", "upstreams"}, nil)
)

// Describe implements prometheus.Collector.
func (stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descEstimate, descSamples, descFailures, descEjected, descEjections, descOverflow, descPanic, descPanicEntered, descRetriesRefused} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (stateCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range hoststate.All() {
		if s.Samples > 0 {
			ch <- prometheus.MustNewConstMetric(descEstimate, prometheus.GaugeValue, s.Estimate.Seconds(), s.Dial)
		}
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
		dials := make([]string, len(p.Upstreams))
		for i, u := range p.Upstreams {
			dials[i] = u.Dial
		}
		k := key{p.Policy, strings.Join(dials, ",")}
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

var collector stateCollector

// registerMetrics adds lbx's metrics to the config's metrics registry (the
// one Caddy's /metrics endpoints serve). It is called from every lbx
// policy's Provision; registering again is harmless.
func registerMetrics(ctx caddy.Context) error { return metricsreg.Register(ctx, collector) }
