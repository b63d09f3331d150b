package rebalance

import (
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// metricValue gathers reg and returns the value of the series name with
// exactly the given labels.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue series
				}
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				return m.GetCounter().GetValue(), true
			case dto.MetricType_GAUGE:
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// fixedStats is the metrics collector with chosen connection figures in
// place of the process's.
type fixedStats struct {
	metricsCollector
	stats connStats
}

// Collect implements prometheus.Collector.
func (f fixedStats) Collect(ch chan<- prometheus.Metric) {
	f.stats.collect(ch)
	collectNodes(ch)
}

// TestMetricsPedantic gathers the collector, with a running node and
// chosen connection figures, from a pedantic registry (which checks
// every metric against its description) and lints the result;
// registering twice in a config is harmless.
func TestMetricsPedantic(t *testing.T) {
	a := testApp(t, "metrics-node", &fakeSource{load: 10}, nil)
	lbxtest.WaitFor(t, 5*time.Second, "a first decision", func() (bool, string) {
		a.node.mu.Lock()
		defer a.node.mu.Unlock()
		return !a.node.lastAt.IsZero(), "no decision yet"
	})
	reg := prometheus.NewPedanticRegistry()
	stats := connStats{
		bytes:   conntrack.ByteTotals{In: 1234, Out: 56789, TLSUncounted: 2},
		ws:      conntrack.WebSocketCloses{CloseFrame: 4, AfterFrameEnd: 1, WithoutFrame: 5},
		goAways: 3,
	}
	if err := reg.Register(fixedStats{stats: stats}); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("pedantic gather: %v", err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, n := range []string{"caddy_lbx_rebalance_connections", "caddy_lbx_rebalance_local_load", "caddy_lbx_rebalance_cluster_average",
		"caddy_lbx_rebalance_members_counted", "caddy_lbx_rebalance_shed_decisions_total", "caddy_lbx_rebalance_connections_shed_total",
		"caddy_lbx_rebalance_bytes_total", "caddy_lbx_rebalance_tls_connections_not_counted_total",
		"caddy_lbx_rebalance_forced_closes_total", "caddy_lbx_rebalance_websocket_closes_total"} {
		if !names[n] {
			t.Errorf("no %s", n)
		}
	}
	if v, ok := metricValue(t, reg, "caddy_lbx_rebalance_local_load", map[string]string{"node": "metrics-node"}); !ok || v != 10 {
		t.Errorf("local_load = %v (%v); want 10", v, ok)
	}
	if v, ok := metricValue(t, reg, "caddy_lbx_rebalance_members_counted", map[string]string{"node": "metrics-node"}); !ok || v != 1 {
		t.Errorf("members_counted = %v (%v); want 1 (alone)", v, ok)
	}
	for dir, want := range map[string]float64{"in": 1234, "out": 56789} {
		if v, ok := metricValue(t, reg, "caddy_lbx_rebalance_bytes_total", map[string]string{"direction": dir}); !ok || v != want {
			t.Errorf("bytes_total{direction=%q} = %v (%v); want %v", dir, v, ok, want)
		}
	}
	if v, ok := metricValue(t, reg, "caddy_lbx_rebalance_http2_goaways_total", map[string]string{}); !ok || v != 3 {
		t.Errorf("http2_goaways_total = %v (%v); want 3", v, ok)
	}
	if v, ok := metricValue(t, reg, "caddy_lbx_rebalance_tls_connections_not_counted_total", map[string]string{}); !ok || v != 2 {
		t.Errorf("tls_connections_not_counted_total = %v (%v); want 2", v, ok)
	}
	for result, want := range map[string]float64{"close_frame": 4, "without_frame": 5} {
		if v, ok := metricValue(t, reg, "caddy_lbx_rebalance_websocket_closes_total", map[string]string{"result": result}); !ok || v != want {
			t.Errorf("websocket_closes_total{result=%q} = %v (%v); want %v", result, v, ok, want)
		}
	}
	problems, err := promtest.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}

	ctx := testContext(t)
	for i := range 2 {
		if err := registerMetrics(ctx, newProcessConns()); err != nil {
			t.Fatalf("registerMetrics #%d: %v", i+1, err)
		}
	}
}

// TestMetricsConnections drives the process's tracker through new, idle,
// active and hijacked connections, as net/http reports them, and reads
// the connections gauge at each step.
func TestMetricsConnections(t *testing.T) {
	conns := newProcessConns()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metricsCollector{conns: conns})
	want := func(what string, counts map[string]float64) {
		t.Helper()
		got := map[string]float64{}
		for state := range counts {
			got[state], _ = metricValue(t, reg, "caddy_lbx_rebalance_connections", map[string]string{"state": state})
		}
		if fmt.Sprint(got) != fmt.Sprint(counts) {
			t.Errorf("%s: gauges %v; want %v", what, got, counts)
		}
	}
	var a, b, u [2]net.Conn
	for _, p := range []*[2]net.Conn{&a, &b, &u} {
		p[0], p[1] = net.Pipe()
		defer p[0].Close()
		defer p[1].Close()
		conns.tracker.ConnState(p[0], http.StateNew)
	}
	want("3 new", map[string]float64{"new": 3, "idle": 0, "active": 0, "hijacked": 0})
	for _, c := range []net.Conn{a[0], b[0], u[0]} {
		conns.tracker.ConnState(c, http.StateActive)
		conns.tracker.ConnState(c, http.StateIdle)
	}
	want("3 idle", map[string]float64{"new": 0, "idle": 3, "active": 0, "hijacked": 0})
	conns.tracker.ConnState(a[0], http.StateActive)
	want("2 idle, 1 active", map[string]float64{"idle": 2, "active": 1, "hijacked": 0})
	conns.tracker.ConnState(u[0], http.StateActive)
	conns.tracker.ConnState(u[0], http.StateHijacked)
	want("1 hijacked", map[string]float64{"idle": 1, "active": 1, "hijacked": 1})
	conns.tracker.ConnState(b[0], http.StateClosed)
	want("b closed", map[string]float64{"idle": 0, "active": 1, "hijacked": 1})
}
