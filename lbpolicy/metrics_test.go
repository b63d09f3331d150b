package lbpolicy

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func TestMetricsExposeUpstreamState(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(collector); err != nil {
		t.Fatal(err)
	}
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	dial := t.Name() + ":80"
	s := table.Stats(dial)
	// Ejected first: an ejection may reset the latency estimate.
	s.Eject(monoclock.Now(), time.Minute, func(int64) time.Duration { return time.Minute }, hoststate.ReasonSuccessRate)
	start := s.Begin()
	table.Observe(s, start-int64(4*time.Millisecond), hoststate.Success)

	// Gather checks the pedantic registry's consistency rules too.
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{
		"caddy_lbx_upstream_ejected":        1,
		"caddy_lbx_upstream_samples_total":  1,
		"caddy_lbx_upstream_failures_total": 0,
	}
	// One ejection series per reason, zero for the reasons not seen yet.
	wantEjections := map[string]float64{"consecutive_failures": 0, "success_rate": 1, "failure_percentage": 0}
	found := map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if !hasLabel(m.GetLabel(), "upstream", dial) {
				continue
			}
			found[mf.GetName()] = true
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			if mf.GetName() == "caddy_lbx_upstream_ejections_total" {
				reason := labelValue(m.GetLabel(), "reason")
				if w, ok := wantEjections[reason]; !ok || v != w {
					t.Errorf("ejections_total{reason=%q} = %v, want %v (known: %v)", reason, v, w, ok)
				}
				delete(wantEjections, reason)
			}
			if w, ok := want[mf.GetName()]; ok && v != w {
				t.Errorf("%s = %v, want %v", mf.GetName(), v, w)
			}
			if mf.GetName() == "caddy_lbx_upstream_expected_latency_seconds" && !math.IsInf(v, 1) {
				t.Errorf("expected latency of an ejected upstream %v s, want +Inf (never lower than selection's view)", v)
			}
			if mf.GetName() == "caddy_lbx_upstream_answer_median_seconds" && (v < 0.004 || v > 0.1) {
				t.Errorf("answer median %v s, want ≈0.004", v)
			}
		}
	}
	for name := range want {
		if !found[name] {
			t.Errorf("metric %s missing for %s", name, dial)
		}
	}
	if len(wantEjections) != 0 {
		t.Errorf("no ejections_total series for reasons %v", wantEjections)
	}
	if !found["caddy_lbx_upstream_expected_latency_seconds"] {
		t.Error("expected latency missing")
	}
	if !found["caddy_lbx_upstream_answer_median_seconds"] {
		t.Error("answer median missing")
	}
	if n, err := testutil.GatherAndCount(reg, "caddy_lbx_upstream_ejected"); err != nil || n == 0 {
		t.Fatalf("GatherAndCount: %d, %v", n, err)
	}
}

func labelValue(labels []*dto.LabelPair, name string) string {
	for _, l := range labels {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func hasLabel(labels []*dto.LabelPair, name, value string) bool {
	for _, l := range labels {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// TestMetricsCapUpstreamSeries: past maxUpstreamSeries addresses, the
// rest share upstream="_other" series that add them up, and
// caddy_lbx_upstreams counts every address by state. Without the cap the
// 1,100 addresses of the test made 1,100 samples_total series (and 200,000
// upstreams a scrape that did not finish in a minute).
func TestMetricsCapUpstreamSeries(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(collector)
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	const n = maxUpstreamSeries + 100
	now := monoclock.Now()
	for i := range n {
		// "~" sorts after every other test's addresses: the last 100 are ours.
		s := table.Stats(fmt.Sprintf("~%s-%04d:80", t.Name(), i))
		table.ObserveAt(s, now-int64(time.Millisecond), now, hoststate.Success)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	labels := map[string]int{}
	var other, states float64
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "caddy_lbx_upstream_samples_total":
				labels[labelValue(m.GetLabel(), "upstream")]++
				if hasLabel(m.GetLabel(), "upstream", otherUpstreams) {
					other = m.GetCounter().GetValue()
				}
			case "caddy_lbx_upstreams":
				states += m.GetGauge().GetValue()
			}
		}
	}
	if len(labels) != maxUpstreamSeries+1 || labels[otherUpstreams] != 1 {
		t.Errorf("%d upstream labels on samples_total (_other: %d); want %d and one _other", len(labels), labels[otherUpstreams], maxUpstreamSeries+1)
	}
	if other < 100 {
		t.Errorf("_other samples_total %v; want at least the 100 addresses past the cap", other)
	}
	if int(states) < n || int(states) != len(hoststate.All()) {
		t.Errorf("caddy_lbx_upstreams adds up to %v; want every address (%d)", states, len(hoststate.All()))
	}
}

// BenchmarkMetrics200k: one gather of lbx's metrics with 200,000
// upstreams in one pool (see setup200k).
func BenchmarkMetrics200k(b *testing.B) {
	setup200k(b)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collector)
	b.ReportAllocs()
	series := 0
	for b.Loop() {
		mfs, err := reg.Gather()
		if err != nil {
			b.Fatal(err)
		}
		series = 0
		for _, mf := range mfs {
			series += len(mf.GetMetric())
		}
	}
	b.ReportMetric(float64(series), "series")
}
