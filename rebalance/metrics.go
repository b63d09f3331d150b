package rebalance

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/metricsreg"
)

// metricsCollector exposes the rebalance state as Prometheus metrics. It
// reads the process's connections (connStats) and the nodes' last
// decisions at scrape time, so neither requests nor the decision loop pay
// for metrics.
type metricsCollector struct {
	conns *processConns // nil reads zeros
}

var (
	descConnections = prometheus.NewDesc("caddy_lbx_rebalance_connections",
		"HTTP connections this process holds, by state (new: no request yet).", []string{"state"}, nil)
	descLocalLoad = prometheus.NewDesc("caddy_lbx_rebalance_local_load",
		"This node's smoothed load, as gossiped, in the unit of its metric.", []string{"node"}, nil)
	descClusterAverage = prometheus.NewDesc("caddy_lbx_rebalance_cluster_average",
		"Cluster average load over the members counted in the last decision; 0 when too few count.", []string{"node"}, nil)
	descMembersCounted = prometheus.NewDesc("caddy_lbx_rebalance_members_counted",
		"Members (this node included) counted toward the average in the last decision.", []string{"node"}, nil)
	descShedDecisions = prometheus.NewDesc("caddy_lbx_rebalance_shed_decisions_total",
		"Intervals in which this node shed connections.", []string{"node"}, nil)
	descConnectionsShed = prometheus.NewDesc("caddy_lbx_rebalance_connections_shed_total",
		"Connections this node shed, by kind.", []string{"node", "kind"}, nil)
	descBytes = prometheus.NewDesc("caddy_lbx_rebalance_bytes_total",
		"Bytes read from (in) and written to (out) the connections the rebalance listener wrapper accepted, TLS records included.", []string{"direction"}, nil)
	descTLSUncounted = prometheus.NewDesc("caddy_lbx_rebalance_tls_connections_not_counted_total",
		"Connections the rebalance listener wrapper passed through uncounted because they were already TLS (the wrapper is placed after tls).", nil, nil)
	descAverageUsed = prometheus.NewDesc("caddy_lbx_rebalance_gossip_average_used",
		"1 when the last decision used the gossip average, 0 when it used the members' load tags.", []string{"node"}, nil)
	descAverageRefused = prometheus.NewDesc("caddy_lbx_rebalance_gossip_average_refused_total",
		"Gossip averaging held to the members' load tags: decisions that used the tags instead because the gossip average was outside their range (what = decision), decisions that clamped it to near the tags' average (what = clamped), and averaging messages not applied because their estimates were outside that range (what = message). A member may be sending false estimates.", []string{"node", "what"}, nil)
	descForcedCloses = prometheus.NewDesc("caddy_lbx_rebalance_forced_closes_total",
		"Shed active connections this node closed because they reached no response boundary within boundary_timeout.", []string{"node"}, nil)
	descHTTP2GoAways = prometheus.NewDesc("caddy_lbx_rebalance_http2_goaways_total",
		"GOAWAY frames written to shed idle HTTP/2 connections (TLS or h2c), so that their clients reconnect without failing a call.", nil, nil)
	descWebSocketCloses = prometheus.NewDesc("caddy_lbx_rebalance_websocket_closes_total",
		"WebSocket streams shed through rebalance_close, by how they ended (close_frame: a 1001 close frame was sent; without_frame: closed without one).", []string{"result"}, nil)
)

// Describe implements prometheus.Collector.
func (metricsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descConnections, descLocalLoad, descClusterAverage, descMembersCounted,
		descShedDecisions, descConnectionsShed, descBytes, descTLSUncounted, descForcedCloses, descWebSocketCloses,
		descHTTP2GoAways, descAverageUsed, descAverageRefused} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m metricsCollector) Collect(ch chan<- prometheus.Metric) {
	m.conns.stats().collect(ch)
	collectNodes(ch)
}

// collect sends the connection metrics of s.
func (s connStats) collect(ch chan<- prometheus.Metric) {
	c := s.conns
	for _, st := range []struct {
		state string
		n     int
	}{{"new", c.New}, {"idle", c.Idle}, {"active", c.Active}, {"hijacked", c.Hijacked}} {
		ch <- prometheus.MustNewConstMetric(descConnections, prometheus.GaugeValue, float64(st.n), st.state)
	}
	ch <- prometheus.MustNewConstMetric(descBytes, prometheus.CounterValue, float64(s.bytes.In), "in")
	ch <- prometheus.MustNewConstMetric(descBytes, prometheus.CounterValue, float64(s.bytes.Out), "out")
	ch <- prometheus.MustNewConstMetric(descTLSUncounted, prometheus.CounterValue, float64(s.bytes.TLSUncounted))
	ch <- prometheus.MustNewConstMetric(descWebSocketCloses, prometheus.CounterValue, float64(s.ws.CloseFrame), "close_frame")
	ch <- prometheus.MustNewConstMetric(descWebSocketCloses, prometheus.CounterValue, float64(s.ws.WithoutFrame), "without_frame")
	ch <- prometheus.MustNewConstMetric(descHTTP2GoAways, prometheus.CounterValue, float64(s.goAways))
}

// collectNodes sends the metrics of every node in the process.
func collectNodes(ch chan<- prometheus.Metric) {
	// One node per process, except briefly when a reload changes the bind
	// address (and in tests): the node label keeps their series apart.
	nodes.Range(func(_, v any) bool {
		n := v.(*node)
		n.mu.Lock()
		name, local, avg, counted := n.name, n.local, n.last.Average, n.last.Counted
		decisions, shed, forced := n.shedDecisions, n.shed, n.forced
		used, refused, clamped := 0.0, n.averageRefused, n.averageClamped
		if n.average.Used {
			used = 1
		}
		n.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(descAverageUsed, prometheus.GaugeValue, used, name)
		ch <- prometheus.MustNewConstMetric(descAverageRefused, prometheus.CounterValue, float64(refused), name, "decision")
		ch <- prometheus.MustNewConstMetric(descAverageRefused, prometheus.CounterValue, float64(clamped), name, "clamped")
		ch <- prometheus.MustNewConstMetric(descAverageRefused, prometheus.CounterValue, float64(n.avg.refused.Load()), name, "message")
		ch <- prometheus.MustNewConstMetric(descLocalLoad, prometheus.GaugeValue, local, name)
		ch <- prometheus.MustNewConstMetric(descClusterAverage, prometheus.GaugeValue, avg, name)
		ch <- prometheus.MustNewConstMetric(descMembersCounted, prometheus.GaugeValue, float64(counted), name)
		ch <- prometheus.MustNewConstMetric(descShedDecisions, prometheus.CounterValue, float64(decisions), name)
		ch <- prometheus.MustNewConstMetric(descConnectionsShed, prometheus.CounterValue, float64(shed.Idle), name, "idle")
		ch <- prometheus.MustNewConstMetric(descConnectionsShed, prometheus.CounterValue, float64(shed.Active), name, "active")
		ch <- prometheus.MustNewConstMetric(descConnectionsShed, prometheus.CounterValue, float64(shed.Hijacked), name, "hijacked")
		ch <- prometheus.MustNewConstMetric(descForcedCloses, prometheus.CounterValue, float64(forced), name)
		return true
	})
}

// registerMetrics adds the rebalance metrics of conns to the config's
// metrics registry (the one Caddy's /metrics endpoints serve).
// Registering again in the same config is harmless.
func registerMetrics(ctx caddy.Context, conns *processConns) error {
	return metricsreg.Register(ctx, metricsCollector{conns: conns})
}
