package lbpolicy

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// poolStatus describes one handler's pool as its selection policy sees it.
type poolStatus struct {
	// Policy is the selection policy's name, e.g. "least_time" (or "ewma" where configured so) or "panic(least_conn)".
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
	// SlowStart is the policy's slow start window (e.g. "30s"); absent
	// when slow start is off, and then no member ramps.
	SlowStart string `json:"slow_start,omitempty"`
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
	// EstimateMs is the latency this pool's selection expects of the
	// member now (see the upstream's expected_ms), in milliseconds; absent
	// for policies that do not estimate latency, and while the member is
	// ejected (selection does not choose it).
	EstimateMs *float64 `json:"expected_ms,omitempty"`
	// AnswerMedianMs is what the member's answers took (see the
	// upstream's answer_median_ms); absent for policies that keep no
	// upstream state.
	AnswerMedianMs *float64 `json:"answer_median_ms,omitempty"`
	// SlowStartPercent is the member's effective weight, in percent of
	// its weight, while it ramps up after joining or returning to the
	// pool; absent when it is not ramping.
	SlowStartPercent *float64 `json:"slow_start_weight_percent,omitempty"`
	// Drained is true while the operator drains the member (POST
	// /lbx/drain): it takes no new requests, unless every other usable
	// member is drained too. A drained member is not unhealthy.
	Drained bool `json:"drained,omitempty"`
	// WeightPercent is the percent of its weight the operator left the
	// member (POST /lbx/weight); absent when not reweighted.
	WeightPercent int `json:"weight_percent,omitempty"`
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

// pagedSource is implemented by the policies whose pools can be described
// a page at a time: describing every member of a pool of 200,000 for a
// page of 100 cost most of an answer's time and memory.
type pagedSource interface {
	poolStatusSource
	// reportViews returns the views to report (see views.all).
	reportViews() []*poolView
	// describe returns the status of v, listing the members of sub, a
	// view of some of v's members (see poolView.subset); the pool-wide
	// fields (availability, panic, counts) are v's.
	describe(v, sub *poolView) poolStatus
}

// poolReport is one pool to report, and the policy that serves it.
type poolReport struct {
	src  pagedSource
	view *poolView
	full *poolStatus // for a policy that is not a pagedSource: its whole status
}

// dials calls yield with each member's dial address.
func (p poolReport) dials(yield func(string)) {
	if p.full != nil {
		for _, m := range p.full.Upstreams {
			yield(m.Dial)
		}
		return
	}
	for _, u := range p.view.ups {
		yield(u.Dial)
	}
}

// status returns the pool's status with the members r holds.
func (p poolReport) status(r dialRange) poolStatus {
	if p.full != nil {
		st := *p.full
		st.Upstreams = r.filter(st.Upstreams)
		return st
	}
	st := p.src.describe(p.view, p.view.subset(r))
	st.Total = len(p.view.ups)
	st.Name = poolName(len(p.view.ups), func(i int) string { return p.view.ups[i].Dial })
	if len(p.view.ups) > 0 {
		st.first = p.view.ups[0].Dial
	}
	if st.Upstreams == nil {
		st.Upstreams = []poolMember{}
	}
	return st
}

// allPoolReports returns the pools of every registered policy that have
// served a request.
func allPoolReports() []poolReport {
	statusSourcesMu.Lock()
	rs := make([]poolStatusSource, 0, len(statusSources))
	for r := range statusSources {
		rs = append(rs, r)
	}
	statusSourcesMu.Unlock()
	var out []poolReport
	for _, src := range rs {
		if ps, ok := src.(pagedSource); ok {
			for _, v := range ps.reportViews() {
				out = append(out, poolReport{src: ps, view: v})
			}
			continue
		}
		for _, st := range src.poolStatuses() {
			st := summarizePool(st)
			out = append(out, poolReport{full: &st})
		}
	}
	return out
}

// poolStatusesIn returns the statuses of reports, each listing the members
// r holds, ordered by policy and first member.
func poolStatusesIn(reports []poolReport, r dialRange) []poolStatus {
	out := make([]poolStatus, 0, len(reports))
	for _, p := range reports {
		out = append(out, p.status(r))
	}
	markDrains(out)
	slices.SortFunc(out, func(a, b poolStatus) int {
		if a.Policy != b.Policy {
			return strings.Compare(a.Policy, b.Policy)
		}
		return strings.Compare(a.first, b.first)
	})
	return out
}

// allPoolStatuses returns the statuses of all registered pools that have
// served a request, ordered by policy and first member, listing no member:
// what the pool metrics read.
func allPoolStatuses() []poolStatus {
	return poolStatusesIn(allPoolReports(), dialRange{none: true})
}

// subset returns a view of the members of v that r holds, in v's order,
// for describing them: it shares their state but has none of v's own
// (availability, panic).
func (v *poolView) subset(r dialRange) *poolView {
	sub := &poolView{}
	for i, u := range v.ups {
		if !r.has(u.Dial) {
			continue
		}
		sub.ups = append(sub.ups, u)
		if v.members != nil {
			sub.members = append(sub.members, member{stats: v.members[i].stats, invWeight: v.members[i].invWeight})
		}
	}
	return sub
}

// countStates counts the members of v by state, at now; ramping, when
// set, reports whether member i is on a slow-start ramp.
func (v *poolView) countStates(now int64, ramping func(i int) bool) poolStates {
	var c poolStates
	for i, u := range v.ups {
		if u.Available() && (v.members == nil || !v.members[i].stats.Ejected(now)) {
			c.Available++
		} else {
			c.Unavailable++
		}
		if !u.Healthy() {
			c.CaddyUnhealthy++
		}
		if ramping != nil && ramping(i) {
			c.Ramping++
		}
	}
	return c
}

// reportViews implements pagedSource.
func (s *LeastTimeSelection) reportViews() []*poolView { return s.views.all() }

// describe implements pagedSource.
func (s *LeastTimeSelection) describe(v, sub *poolView) poolStatus {
	st := s.statusOf(sub, v == s.views.last.Load())
	now := monoclock.Now()
	st.Available = v.availableNow()
	st.Panic = v.panic.on.Load()
	st.PanicEntered = v.panic.entered.Load()
	st.States = v.countStates(now, s.SlowStart.rampingIn(v, now))
	for i := range st.Upstreams {
		m, stats := &st.Upstreams[i], sub.members[i].stats
		if stats.Ejected(now) {
			m.EstimateMs = nil
		}
		a := float64(stats.Snapshot(now).AnswerMedian) / 1e6
		m.AnswerMedianMs = &a
	}
	return st
}

// reportViews implements pagedSource.
func (p *PanicSelection) reportViews() []*poolView { return p.views.all() }

// describe implements pagedSource.
func (p *PanicSelection) describe(v, sub *poolView) poolStatus {
	st := p.statusOf(sub)
	st.Available = v.availableNow()
	st.Panic = v.panic.on.Load()
	st.PanicEntered = v.panic.entered.Load()
	st.States = v.countStates(monoclock.Now(), p.SlowStart.rampingIn(v, monoclock.Now()))
	return st
}

// summarizePool fills in what a policy's full status of a pool implies:
// its name, size and counts by state.
func summarizePool(p poolStatus) poolStatus {
	p.Total = len(p.Upstreams)
	p.Name = poolName(len(p.Upstreams), func(i int) string { return p.Upstreams[i].Dial })
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
const poolNameMembers = 16

// poolName returns a pool's name (see poolStatus.Name). A pool of
// hundreds of thousands of members named in full would make one metrics
// label, and one JSON field per page, of megabytes.
func poolName(n int, dial func(i int) string) string {
	var b strings.Builder
	shown := min(n, poolNameMembers)
	if n > poolNameMembers {
		shown = poolNameMembers - 1
	}
	for i := range shown {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(dial(i))
	}
	if rest := n - shown; rest > 0 {
		h := uint64(14695981039346656037) // FNV-1a of every dial, in order
		for i := range n {
			d := dial(i)
			for j := 0; j < len(d); j++ {
				h = (h ^ uint64(d[j])) * 1099511628211
			}
			h = (h ^ 0xff) * 1099511628211
		}
		fmt.Fprintf(&b, ",+%d more #%08x", rest, uint32(h^h>>32))
	}
	return b.String()
}

func firstDial(r poolStatus) string { return r.first }
