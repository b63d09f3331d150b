package rebalance

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/caddy-lbx/lbx/internal/testutil"
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

// TestMetricsPedantic gathers the collector, with a running node, from a
// pedantic registry (which checks every metric against its description)
// and lints the result; registering twice in a config is harmless.
func TestMetricsPedantic(t *testing.T) {
	a := testApp(t, "metrics-node", &fakeSource{load: 10}, nil)
	testutil.WaitFor(t, 5*time.Second, "a first decision", func() (bool, string) {
		a.node.mu.Lock()
		defer a.node.mu.Unlock()
		return !a.node.lastAt.IsZero(), "no decision yet"
	})
	reg := prometheus.NewPedanticRegistry()
	bc := new(byteCounters)
	bc.in.Add(1234)
	bc.out.Add(56789)
	bc.tlsUncounted.Add(2)
	tr := new(ConnTracker)
	tr.goAways.Add(3)
	if err := reg.Register(metricsCollector{tracker: tr, traffic: bc}); err != nil {
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
	problems, err := promtest.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}

	ctx := testContext(t)
	for i := range 2 {
		if err := registerMetrics(ctx); err != nil {
			t.Fatalf("registerMetrics #%d: %v", i+1, err)
		}
	}
}

// TestMetricsConnections drives a tracked server through idle, active and
// hijacked connections and reads the connections gauge at each step.
func TestMetricsConnections(t *testing.T) {
	ts := newTrackedServer(t)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metricsCollector{tracker: ts.tracker})
	want := func(what string, counts map[string]float64) {
		t.Helper()
		testutil.WaitFor(t, 5*time.Second, what, func() (bool, string) {
			got := map[string]float64{}
			for state := range counts {
				got[state], _ = metricValue(t, reg, "caddy_lbx_rebalance_connections", map[string]string{"state": state})
			}
			return fmt.Sprint(got) == fmt.Sprint(counts), fmt.Sprint(got)
		})
	}
	a, b := ts.dial(), ts.dial()
	a.get(t, "/fast")
	b.get(t, "/fast")
	want("2 idle", map[string]float64{"new": 0, "idle": 2, "active": 0, "hijacked": 0})
	if err := a.send("/block"); err != nil {
		t.Fatal(err)
	}
	<-ts.entered
	want("1 idle, 1 active", map[string]float64{"idle": 1, "active": 1, "hijacked": 0})
	u := ts.dial()
	if resp, _ := u.get(t, "/upgrade"); resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: status %d", resp.StatusCode)
	}
	want("1 hijacked", map[string]float64{"idle": 1, "active": 1, "hijacked": 1})
	u.conn.Close()
	b.conn.Close()
	ts.release <- struct{}{}
	if _, body, err := a.read(); err != nil || body != "done" {
		t.Fatalf("/block: %q, %v", body, err)
	}
}
