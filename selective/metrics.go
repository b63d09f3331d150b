package selective

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/metricsreg"
)

// The metrics are package-level, so counts survive reloads; every config
// registers them in its metrics registry.
var (
	attemptsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_lbx_selective_attempts_total",
		Help: "Attempts sent to each selective group, by kind (first, retry, backup) and result (answered, failed, lost: answered after another attempt had won, canceled).",
	}, []string{"group", "kind", "result"})
	backupWonTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_lbx_selective_backup_won_total",
		Help: "Selective calls answered by their backup request, by the group that answered.",
	}, []string{"group"})
	backupRefusedTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "caddy_lbx_selective_backup_refused_total",
		Help: "Backup requests not sent, by reason: budget (the backup budget was spent), busy (no replica the call was not using had spare capacity) or queued (the first attempt's replica was making progress: queued, not stuck; counted once per call).",
	}, []string{"reason"})
)

// Reasons a backup request is not sent, as counted.
const (
	refusedBudget = "budget"
	refusedBusy   = "busy"
	refusedQueued = "queued"
)

// registerMetrics adds the metrics to the config's registry; registering
// again (another handler, a reload) is harmless.
func registerMetrics(ctx caddy.Context) error {
	for _, c := range []prometheus.Collector{attemptsTotal, backupWonTotal, backupRefusedTotal} {
		if err := metricsreg.Register(ctx, c); err != nil {
			return err
		}
	}
	return nil
}

// Results of an attempt, as counted.
const (
	resultAnswered = iota
	resultFailed
	resultLost
	resultCanceled
	numResults
)

var resultNames = [numResults]string{"answered", "failed", "lost", "canceled"}

// groupMetrics holds a group's counters, looked up once.
type groupMetrics struct {
	attempts  [numKinds][numResults]prometheus.Counter
	backupWon prometheus.Counter
}

func newGroupMetrics(name string) groupMetrics {
	var m groupMetrics
	for k := range numKinds {
		for r := range numResults {
			m.attempts[k][r] = attemptsTotal.WithLabelValues(name, kindNames[k], resultNames[r])
		}
	}
	m.backupWon = backupWonTotal.WithLabelValues(name)
	return m
}

// count counts one finished attempt.
func (m *groupMetrics) count(kind attemptKind, f failure, lost bool) {
	r := resultFailed
	switch {
	case lost:
		r = resultLost
	case f == failNone:
		r = resultAnswered
	case f == failCancel:
		r = resultCanceled
	}
	m.attempts[kind][r].Inc()
}
