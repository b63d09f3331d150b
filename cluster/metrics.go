package cluster

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/metricsreg"
	"github.com/caddy-lbx/lbx/internal/serfnet"
)

// collector exposes the membership as Prometheus metrics, read at scrape
// time.
type collector struct{}

var (
	descMembers = prometheus.NewDesc("caddy_lbx_cluster_members",
		"Cluster members this node's serf knows, by status.", []string{"node", "status"}, nil)
	descNameConflict = prometheus.NewDesc("caddy_lbx_cluster_name_conflict",
		"1 when this node's serf member shut down because another member uses its node_name: the node no longer gossips or sees the cluster.", []string{"node"}, nil)
	descGossipLogLines = prometheus.NewDesc("caddy_lbx_cluster_gossip_log_lines_total",
		"Warning and error lines logged by the gossip library (serf, memberlist), whether written or suppressed by the rate limit.", nil, nil)
	descGossipLogSuppressed = prometheus.NewDesc("caddy_lbx_cluster_gossip_log_lines_suppressed_total",
		"Warning and error lines of the gossip library not written because of the rate limit (at most 5 of a kind per 10 s).", nil, nil)
	descDirectMessages = prometheus.NewDesc("caddy_lbx_cluster_direct_messages_total",
		"Direct messages this node's member sent and received, by result: ok, send_error, handler_panic, or why a received one was dropped (dropped_*).", []string{"node", "direction", "result"}, nil)
	descRefused = prometheus.NewDesc("caddy_lbx_cluster_members_refused_total",
		"Member dial addresses the dial policy refused, by reason; a refusal of the same member, address and reason counts once per minute while it lasts.", []string{"reason"}, nil)
	descKeyringOps = prometheus.NewDesc("caddy_lbx_cluster_keyring_operations_total",
		"Gossip keyring operations asked through this node's admin API (op: list, install, use, remove), by result: ok (every node succeeded), failed (a node failed or did not answer), refused (before any change: a bad key, the primary key to remove, no encryption, another operation in progress, a step that would split the cluster).", []string{"op", "result"}, nil)
	descDecryptFailures = prometheus.NewDesc("caddy_lbx_cluster_decrypt_failures_total",
		"Gossip messages this node's member could not decrypt with any key of its keyring: a member encrypts with a key this node lacks (see decrypt_failures in /lbx/cluster).", []string{"node"}, nil)
)

// Describe implements prometheus.Collector.
func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descMembers, descNameConflict, descGossipLogLines, descGossipLogSuppressed, descDirectMessages, descKeyringOps, descDecryptFailures, descRefused} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (collector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(descGossipLogLines, prometheus.CounterValue, float64(gossipLogs.lines.Load()))
	ch <- prometheus.MustNewConstMetric(descGossipLogSuppressed, prometheus.CounterValue, float64(gossipLogs.suppressed.Load()))
	for r := range numRefusals {
		ch <- prometheus.MustNewConstMetric(descRefused, prometheus.CounterValue, float64(refusedCounts[r].Load()), r.String())
	}
	for op := range keyringOps {
		for res := range keyringResults {
			ch <- prometheus.MustNewConstMetric(descKeyringOps, prometheus.CounterValue, float64(keyringCounts[op][res].Load()), op.String(), keyringResultNames[res])
		}
	}
	// One member per process, except briefly when a reload changes the
	// bind address (and in tests): the node label keeps them apart.
	members.Range(func(_, v any) bool {
		m := v.(*member)
		st := m.status()
		var conflict float64
		by := map[MemberStatus]int{StatusAlive: 0, StatusLeaving: 0, StatusLeft: 0, StatusFailed: 0}
		if st.Conflict != "" {
			conflict = 1
		} else {
			for _, mem := range m.list() {
				by[mem.Status]++
			}
		}
		ch <- prometheus.MustNewConstMetric(descNameConflict, prometheus.GaugeValue, conflict, st.Name)
		ch <- prometheus.MustNewConstMetric(descDecryptFailures, prometheus.CounterValue, float64(m.decrypt.total.Load()), st.Name)
		for s, n := range by {
			ch <- prometheus.MustNewConstMetric(descMembers, prometheus.GaugeValue, float64(n), st.Name, s.String())
		}
		if d := m.direct; d != nil {
			// A message is sent or not (ok, send_error); a received one is
			// handled (ok, handler_panic) or dropped.
			for r := range serfnet.NumResults {
				if r == serfnet.OK || r == serfnet.SendError {
					ch <- prometheus.MustNewConstMetric(descDirectMessages, prometheus.CounterValue, float64(d.Sent(r)), st.Name, "sent", r.String())
				}
				if r != serfnet.SendError {
					ch <- prometheus.MustNewConstMetric(descDirectMessages, prometheus.CounterValue, float64(d.Received(r)), st.Name, "received", r.String())
				}
			}
		}
		return true
	})
}

// registerMetrics adds the cluster metrics to the config's metrics
// registry (the one Caddy's /metrics endpoints serve). Registering again
// (a reload) is harmless.
func registerMetrics(ctx caddy.Context) error { return metricsreg.Register(ctx, collector{}) }
