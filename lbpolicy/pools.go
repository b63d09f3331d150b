package lbpolicy

import (
	"sort"
	"sync"
)

// poolReport describes one handler's pool as its selection policy sees it.
type poolReport struct {
	// Policy is the selection policy's name, e.g. "ewma" or "panic(least_conn)".
	Policy string `json:"policy"`
	// Upstreams are the pool's members in upstream order.
	Upstreams []poolMember `json:"upstreams"`
	// Available is how many members are available now (counted when the
	// report is made, whether or not panic mode is enabled).
	Available int `json:"available"`
	// PanicThreshold is the availability (percent) below which the pool is
	// in panic; 0 when panic mode is disabled.
	PanicThreshold float64 `json:"panic_threshold_percent"`
	// Panic is whether the pool is in panic mode now.
	Panic bool `json:"panic"`
	// PanicEntered counts the times the pool entered panic mode.
	PanicEntered uint64 `json:"panic_entered_total"`
	// RetryBudget is the state of the pool's retry budget; absent when
	// it has none.
	RetryBudget *retryBudgetReport `json:"retry_budget,omitempty"`
}

// retryBudgetReport is the state of a retry budget.
type retryBudgetReport struct {
	Percent       float64 `json:"percent"`
	MinConcurrent int     `json:"min_concurrent"`
	InFlight      int64   `json:"retries_in_flight"`
	Refused       uint64  `json:"retries_refused_total"`
}

// poolMember is one upstream of a pool.
type poolMember struct {
	Dial   string  `json:"dial"`
	Weight float64 `json:"weight"`
	// Healthy is the member's health as Caddy sees it: active health
	// checks, passive failures, circuit breaker.
	Healthy bool `json:"caddy_healthy"`
	// Available is Caddy's availability (health checks, max_requests)
	// and, for policies with outlier ejection, not ejected.
	Available bool `json:"available"`
	// EstimateMs is the latency estimate this pool uses for the member
	// (decayed toward the pool's typical latency), in milliseconds; absent
	// for policies that do not estimate latency.
	EstimateMs *float64 `json:"estimate_ms,omitempty"`
	// SlowStartPercent is the member's effective weight, in percent of
	// its weight, while it ramps up after joining or returning to the
	// pool; absent when it is not ramping.
	SlowStartPercent *float64 `json:"slow_start_weight_percent,omitempty"`
}

// poolReporter is implemented by selection policies that can describe
// the pools they serve for the admin API: usually one, several when one
// policy serves several pools (the partitions of a partition handler).
type poolReporter interface {
	reportPools() []poolReport
}

var (
	reportersMu sync.Mutex
	reporters   = map[poolReporter]struct{}{}
)

// registerPool adds r to the pools listed by the admin API.
func registerPool(r poolReporter) {
	reportersMu.Lock()
	reporters[r] = struct{}{}
	reportersMu.Unlock()
}

// unregisterPool removes r.
func unregisterPool(r poolReporter) {
	reportersMu.Lock()
	delete(reporters, r)
	reportersMu.Unlock()
}

// poolReports returns reports of all registered pools that have served a
// request, ordered by policy and first member.
func poolReports() []poolReport {
	reportersMu.Lock()
	rs := make([]poolReporter, 0, len(reporters))
	for r := range reporters {
		rs = append(rs, r)
	}
	reportersMu.Unlock()
	out := make([]poolReport, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.reportPools()...)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Policy != b.Policy {
			return a.Policy < b.Policy
		}
		return firstDial(a) < firstDial(b)
	})
	return out
}

func firstDial(r poolReport) string {
	if len(r.Upstreams) == 0 {
		return ""
	}
	return r.Upstreams[0].Dial
}
