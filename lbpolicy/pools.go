package lbpolicy

import (
	"sort"
	"sync"
)

// poolStatus describes one handler's pool as its selection policy sees it.
type poolStatus struct {
	// Policy is the selection policy's name, e.g. "ewma" or "panic(least_conn)".
	Policy string `json:"policy"`
	// Upstreams are the pool's members in upstream order.
	Upstreams []poolMember `json:"upstreams"`
	// Available is how many members are available now (counted when the
	// status is read, whether or not panic mode is enabled).
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
	RetryBudget *retryBudgetStatus `json:"retry_budget,omitempty"`
}

// retryBudgetStatus is the state of a retry budget.
type retryBudgetStatus struct {
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

// poolStatusSource is implemented by selection policies that can describe
// the pools they serve for the admin API: usually one, several when one
// policy serves several pools (the partitions of a partition handler).
type poolStatusSource interface {
	poolStatuses() []poolStatus
}

var (
	statusSourcesMu sync.Mutex
	statusSources   = map[poolStatusSource]struct{}{}
)

// registerPool adds r to the pools listed by the admin API.
func registerPool(r poolStatusSource) {
	statusSourcesMu.Lock()
	statusSources[r] = struct{}{}
	statusSourcesMu.Unlock()
}

// unregisterPool removes r.
func unregisterPool(r poolStatusSource) {
	statusSourcesMu.Lock()
	delete(statusSources, r)
	statusSourcesMu.Unlock()
}

// allPoolStatuses returns the statuses of all registered pools that have
// served a request, ordered by policy and first member.
func allPoolStatuses() []poolStatus {
	statusSourcesMu.Lock()
	rs := make([]poolStatusSource, 0, len(statusSources))
	for r := range statusSources {
		rs = append(rs, r)
	}
	statusSourcesMu.Unlock()
	out := make([]poolStatus, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.poolStatuses()...)
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

func firstDial(r poolStatus) string {
	if len(r.Upstreams) == 0 {
		return ""
	}
	return r.Upstreams[0].Dial
}
