package lbpolicy

import (
	"fmt"
	"slices"
	"strings"
	"sync"
)

// poolStatus describes one handler's pool as its selection policy sees it.
type poolStatus struct {
	// Policy is the selection policy's name, e.g. "ewma" or "panic(least_conn)".
	Policy string `json:"policy"`
	// Name names the pool by its members: their dial addresses, comma
	// separated, for a pool of up to poolNameMembers; for a larger one the
	// first few, how many more, and a hash of them all, so that it stays
	// short and still tells pools apart. It is the upstreams label of the
	// pool's metrics.
	Name string `json:"name"`
	// Upstreams are the pool's members on this page (see GET
	// /lbx/upstreams: those whose dial address is in the page's range), in
	// upstream order.
	Upstreams []poolMember `json:"upstreams"`
	// Total is how many members the pool has, on this page or not.
	Total int `json:"upstreams_total"`
	// States counts the pool's members, all of them, by state.
	States poolStates `json:"states"`
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

	first string // the first member's dial address, for sorting
}

// poolStates counts a pool's members by state. A member is counted in
// every state that applies to it.
type poolStates struct {
	// Available counts the members that may be chosen: see poolMember's
	// available.
	Available int `json:"available"`
	// Unavailable counts the others: unhealthy to Caddy, at max_requests,
	// or ejected by outlier detection.
	Unavailable int `json:"unavailable"`
	// CaddyUnhealthy counts the members Caddy's health checks mark down.
	CaddyUnhealthy int `json:"caddy_unhealthy"`
	// Ramping counts the members on a slow-start ramp.
	Ramping int `json:"ramping"`
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
// served a request, ordered by policy and first member, with every member.
// The policies describe every member of their pools; the page of GET
// /lbx/upstreams cuts them down (see dialRange.filter), so that its answer
// stays the size of a page while the policies keep one way to describe a
// pool.
func allPoolStatuses() []poolStatus {
	statusSourcesMu.Lock()
	rs := make([]poolStatusSource, 0, len(statusSources))
	for r := range statusSources {
		rs = append(rs, r)
	}
	statusSourcesMu.Unlock()
	out := make([]poolStatus, 0, len(rs))
	for _, src := range rs {
		for _, p := range src.poolStatuses() {
			out = append(out, summarizePool(p))
		}
	}
	slices.SortFunc(out, func(a, b poolStatus) int {
		if a.Policy != b.Policy {
			return strings.Compare(a.Policy, b.Policy)
		}
		return strings.Compare(a.first, b.first)
	})
	return out
}

// summarizePool fills in what a policy's full status of a pool implies:
// its name, size and counts by state.
func summarizePool(p poolStatus) poolStatus {
	p.Total = len(p.Upstreams)
	p.Name = poolName(p.Upstreams)
	if len(p.Upstreams) > 0 {
		p.first = p.Upstreams[0].Dial
	}
	for _, m := range p.Upstreams {
		if m.Available {
			p.States.Available++
		} else {
			p.States.Unavailable++
		}
		if !m.Healthy {
			p.States.CaddyUnhealthy++
		}
		if m.SlowStartPercent != nil {
			p.States.Ramping++
		}
	}
	return p
}

// poolNameMembers is how many members a pool may have and still be named
// by all its dial addresses.
const poolNameMembers = 4

// poolName returns a pool's name (see poolStatus.Name). A pool of
// hundreds of thousands of members named in full would make one metrics
// label, and one JSON field per page, of megabytes.
func poolName(ms []poolMember) string {
	var b strings.Builder
	shown := min(len(ms), poolNameMembers)
	if len(ms) > poolNameMembers {
		shown = poolNameMembers - 1
	}
	for i, m := range ms[:shown] {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(m.Dial)
	}
	if rest := len(ms) - shown; rest > 0 {
		h := uint64(14695981039346656037) // FNV-1a of every dial, in order
		for _, m := range ms {
			for i := 0; i < len(m.Dial); i++ {
				h = (h ^ uint64(m.Dial[i])) * 1099511628211
			}
			h = (h ^ 0xff) * 1099511628211
		}
		fmt.Fprintf(&b, ",+%d more #%08x", rest, uint32(h^h>>32))
	}
	return b.String()
}

func firstDial(r poolStatus) string { return r.first }
