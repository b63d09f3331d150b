package lbpolicy

import (
	"fmt"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/dustin/go-humanize"

	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves lbx's view of the upstreams on Caddy's admin endpoint:
//
//	GET /lbx/upstreams[?limit=N][&after=DIAL]
//	GET /lbx/upstreams?dial=DIAL
//
// It returns, a page at a time, the upstream addresses any config uses,
// sorted by dial address, with their latency estimates, requests in
// flight, samples and failures, and every pool a selection policy of ours
// serves, with weights, availability and panic mode. A page holds the
// addresses after `after` (exclusive; from the start without it), at most
// `limit` of them (1 to 1000, default 100) in each list; next_after is the
// after of the next page, absent on the last. Each pool lists its members
// in the page's range, in upstream order, and counts all of them. A
// summary over every upstream (counts by state, the worst few) comes with
// every page. `dial` asks for one address. Numbers are machine-readable;
// fields ending in _human repeat them for people.
//
// The views are paged because a pool can hold hundreds of thousands of
// upstreams (a naming file): listed whole, one answer took about a minute
// and a hundred megabytes.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx_upstreams",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/lbx/upstreams",
		Handler: caddy.AdminHandlerFunc(serveUpstreams),
	}}
}

// serveUpstreams answers GET /lbx/upstreams: a page, or 400 naming the
// query parameter that is wrong.
func serveUpstreams(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	q, err := parsePageQuery(r.URL.Query())
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	return adminjson.Write(w, http.StatusOK, buildUpstreamsPage(q))
}

// Bounds of a page of GET /lbx/upstreams.
const (
	defaultPageLimit = 100
	maxPageLimit     = 1000
	// worstShown is how many upstreams the summary names as the worst.
	worstShown = 10
)

// pageQuery is what a GET /lbx/upstreams asks for.
type pageQuery struct {
	limit int
	after string // exclusive; "" is before every address
	dial  string // when set: this address only
}

// parsePageQuery reads the query of GET /lbx/upstreams, refusing what it
// does not know rather than ignoring it: a misspelt parameter would
// otherwise quietly return the first page.
func parsePageQuery(v url.Values) (pageQuery, error) {
	q := pageQuery{limit: defaultPageLimit}
	for name, vals := range v {
		if len(vals) != 1 {
			return q, fmt.Errorf("query parameter %q given %d times; give it once", name, len(vals))
		}
		val := vals[0]
		switch name {
		case "limit":
			n, err := strconv.Atoi(val)
			if err != nil || n < 1 || n > maxPageLimit {
				return q, fmt.Errorf("limit=%q: want a whole number from 1 to %d", val, maxPageLimit)
			}
			q.limit = n
		case "after":
			q.after = val
		case "dial":
			if val == "" {
				return q, fmt.Errorf("dial is empty: want an upstream's dial address, e.g. dial=10.0.0.1:80")
			}
			q.dial = val
		default:
			return q, fmt.Errorf("unknown query parameter %q: want limit, after or dial", name)
		}
	}
	if q.dial != "" && (v.Has("after") || v.Has("limit")) {
		return q, fmt.Errorf("dial=%q asks for one upstream: it takes no after or limit", q.dial)
	}
	return q, nil
}

// dialRange is the dial addresses a page covers: those in (after, upTo],
// or, when only is set, that one, or none.
type dialRange struct {
	after, upTo string
	bounded     bool // upTo applies; else the range runs to the end
	only        string
	none        bool // the range holds nothing
}

// has reports whether dial is in r.
func (r dialRange) has(dial string) bool {
	if r.none {
		return false
	}
	if r.only != "" {
		return dial == r.only
	}
	return dial > r.after && (!r.bounded || dial <= r.upTo)
}

// filter returns the members of ms in r, in their order.
func (r dialRange) filter(ms []poolMember) []poolMember {
	out := []poolMember{}
	for _, m := range ms {
		if r.has(m.Dial) {
			out = append(out, m)
		}
	}
	return out
}

// pageEnd returns, of the addresses each yields (in any order), the
// limit-th smallest after `after`, and whether there are more than limit:
// where a page of that list must stop.
func pageEnd(after string, limit int, each func(yield func(string))) (end string, more bool) {
	l := newFirstN(limit+1, byDial)
	each(func(d string) {
		if d > after {
			l.offer(d)
		}
	})
	if len(l.h) <= limit {
		return "", false
	}
	return l.sorted()[limit-1], true
}

// upstreamView is one upstream in the admin API's output.
type upstreamView struct {
	Dial string `json:"dial"`
	// State is what the summary counts the upstream as: healthy, failing
	// (its last attempts failed), ejected or unsampled.
	State string `json:"state"`
	// AnswerMedianMs is what the upstream's answers took: the median time
	// to response headers of its recent answers, in milliseconds, kept
	// while it is ejected or failing; 0 when it never answered. It is not
	// what selection uses: see expected_ms.
	AnswerMedianMs    float64 `json:"answer_median_ms"`
	AnswerMedianHuman string  `json:"answer_median_human"`
	// ExpectedMs is the latency selection expects of one more request to
	// the upstream now, in milliseconds: the answer median, or the pool's
	// typical latency, raised by a stall in progress, by failures in a row
	// and by its failure ratio (before queueing behind requests in flight, which the policy
	// adds). null while the upstream is ejected: selection does not choose
	// it at all. An upstream no lbx policy prices reports its answer
	// median.
	ExpectedMs *float64 `json:"expected_ms"`
	// FailureRatio is the recent, time-decayed share of the upstream's
	// attempts that failed, 0 to 1.
	FailureRatio float64 `json:"failure_ratio"`
	// EstimateAgeMs is how long ago the answer median last changed.
	EstimateAgeMs    float64 `json:"estimate_age_ms"`
	InFlight         int     `json:"in_flight"`
	Pending          int64   `json:"awaiting_headers"`
	Samples          uint64  `json:"samples"`
	SamplesHuman     string  `json:"samples_human"`
	Failures         uint64  `json:"failures"`
	LastFailureHuman string  `json:"last_failure_human,omitempty"`
	PassiveFails     int     `json:"passive_fails"`
	// EjectedForMs is how long the upstream stays ejected by outlier
	// detection, in milliseconds; 0 when it is not ejected.
	EjectedForMs float64 `json:"ejected_for_ms"`
	Ejections    uint64  `json:"ejections_total"`
	// EjectionsOverflow counts the ejections max_ejection_percent refused:
	// the upstream met a rule while the pool was at its cap.
	EjectionsOverflow uint64 `json:"ejections_overflow_total"`
	// EjectionReason is why the upstream is ejected now, or was last
	// ejected: "consecutive_failures", "success_rate" or
	// "failure_percentage"; absent when it never was.
	EjectionReason string `json:"ejection_reason,omitempty"`
	// EjectionsByReason splits ejections_total by reason.
	EjectionsByReason   map[string]uint64 `json:"ejections_by_reason"`
	ConsecutiveFailures int64             `json:"consecutive_failures"`
	// LoadReport is the latest good ORCA load report the upstream sent;
	// absent when it never sent one.
	LoadReport *loadReportView `json:"load_report,omitempty"`
	// LoadReportsRefused counts the upstream's load reports that did not
	// parse, and LoadReportError is the kind of fault of the last one
	// (see loadReportErrorKind); both absent when none was refused.
	LoadReportsRefused uint64 `json:"load_reports_refused,omitempty"`
	LoadReportError    string `json:"load_report_error,omitempty"`
	// ProbesSent counts the load probes sent to the upstream (see
	// LoadProbe); ProbesFailed those of them that got no answer in time
	// or a 5xx, and ProbesRejected those answered with a 4xx. All absent
	// when no probe was sent.
	ProbesSent     uint64 `json:"probes_sent,omitempty"`
	ProbesFailed   uint64 `json:"probes_failed,omitempty"`
	ProbesRejected uint64 `json:"probes_rejected,omitempty"`
	// Drained is true while the operator drains the upstream (POST
	// /lbx/drain, see GET /lbx/drains); its state is its own, a drained
	// upstream is not unhealthy.
	Drained bool `json:"drained,omitempty"`
	// WeightPercent is the percent of its weight the operator left the
	// upstream (POST /lbx/weight); absent when not reweighted.
	WeightPercent int `json:"weight_percent,omitempty"`
}

// loadReportView is an upstream's latest good load report in the admin
// API: the fields it carried (absent ones omitted), the utilization
// read from it, and its age.
type loadReportView struct {
	CPU         *float64 `json:"cpu_utilization,omitempty"`
	Application *float64 `json:"application_utilization,omitempty"`
	Mem         *float64 `json:"mem_utilization,omitempty"`
	RPS         *float64 `json:"rps_fractional,omitempty"`
	EPS         *float64 `json:"eps,omitempty"`
	// Named are the report's named_metrics (at most 64).
	Named map[string]float64 `json:"named_metrics,omitempty"`
	// Utilization is application_utilization when above 0, else
	// cpu_utilization; absent when the report has neither.
	Utilization *float64 `json:"utilization,omitempty"`
	// AgeMs is how long ago the report came, in milliseconds; Stale is
	// true once that is more than the pool's load_reports max_age
	// (MaxAgeMs).
	AgeMs    float64 `json:"age_ms"`
	MaxAgeMs float64 `json:"max_age_ms"`
	Stale    bool    `json:"stale"`
}

// upstreamsStatus is the body of GET /lbx/upstreams.
type upstreamsStatus struct {
	// Total is how many upstream addresses are in use, on this page or not.
	Total int `json:"total"`
	// Limit is the most addresses this page lists, in upstreams and in
	// each pool.
	Limit int `json:"limit"`
	// NextAfter is the after query of the next page; absent on the last.
	NextAfter string `json:"next_after,omitempty"`
	// Summary describes every upstream, on this page or not.
	Summary upstreamsSummary `json:"summary"`
	// Upstreams are the addresses on this page, sorted.
	Upstreams []upstreamView `json:"upstreams"`
	// Pools are the pools of lbx's policies, each with its members on
	// this page.
	Pools []poolStatus `json:"pools"`
}

// upstreamsSummary describes every upstream in use, for a view that cannot
// list them all.
type upstreamsSummary struct {
	// States counts the upstreams by state (see upstreamState).
	States map[string]int `json:"states"`
	// Worst are the upstreams selection judges worst, at most worstShown,
	// worst first: by expected latency (ejected ones first), then failure
	// ratio, then answer median. Upstreams with no samples and no
	// failures are left out.
	Worst []upstreamView `json:"worst"`
}

// Upstream states, as counted in the summary.
const (
	stateHealthy   = "healthy"   // answering, the last attempt succeeded
	stateFailing   = "failing"   // the last attempt (or more) failed
	stateEjected   = "ejected"   // ejected by outlier detection
	stateUnsampled = "unsampled" // no attempt finished yet
)

// upstreamState returns the state an upstream is counted in.
func upstreamState(s hoststate.Snapshot) string {
	switch {
	case s.EjectedFor > 0:
		return stateEjected
	case s.FailStreak > 0 || s.ConsecFailures > 0:
		return stateFailing
	case s.Samples == 0:
		return stateUnsampled
	}
	return stateHealthy
}

// rated is an upstream's snapshot and what selection expects of it (ns).
type rated struct {
	snap     hoststate.Snapshot
	expected float64
}

// worse reports whether a belongs before b in the summary's worst: by
// what selection expects of them (+Inf for an ejected one), then by
// failure ratio, then by answer median.
func worse(a, b rated) bool {
	if a.expected != b.expected {
		return a.expected > b.expected
	}
	if a.snap.FailureRatio != b.snap.FailureRatio {
		return a.snap.FailureRatio > b.snap.FailureRatio
	}
	if a.snap.AnswerMedian != b.snap.AnswerMedian {
		return a.snap.AnswerMedian > b.snap.AnswerMedian
	}
	return a.snap.Dial < b.snap.Dial
}

// priced reports whether an upstream has been tried at all (answered,
// failed or ejected): the others have no expected latency worth a series
// or a place among the worst, and a naming file can hold hundreds of
// thousands of them.
func priced(s hoststate.Snapshot) bool { return s.Samples > 0 || s.EjectedFor > 0 || s.Failures > 0 }

// tables are the state tables of lbx's policies, which price upstreams
// for selection.
type tables []*hoststate.Table

// policyTables returns the tables of every registered policy that keeps
// one.
func policyTables() tables {
	statusSourcesMu.Lock()
	defer statusSourcesMu.Unlock()
	var out tables
	for src := range statusSources {
		switch p := src.(type) {
		case *LeastTimeSelection:
			if p.table != nil {
				out = append(out, p.table)
			}
		case *PanicSelection:
			if p.table != nil {
				out = append(out, p.table)
			}
		}
	}
	return out
}

// expected returns what selection expects of st at now, in ns: the most
// any policy's table expects (+Inf when ejected), or, when no table holds
// it, its answer median. The most, because a report must never show an
// upstream as cheaper than some policy judges it.
func (ts tables) expected(st *hoststate.Stats, now int64) float64 {
	worst, priced := 0.0, false
	for _, t := range ts {
		if _, ok := t.Lookup(st.Dial()); ok {
			worst, priced = max(worst, t.SelectionLatency(st, now)), true
		}
	}
	if !priced {
		if st.Ejected(now) {
			return math.Inf(1)
		}
		return float64(st.Snapshot(now).AnswerMedian)
	}
	return worst
}

// buildUpstreamsPage assembles the page q asks for. It reads every
// upstream once (O(upstreams), no snapshot kept but the page's and the
// worst's) and keeps the page's in a heap of limit+1: nothing the size
// of the list is sorted or copied.
func buildUpstreamsPage(q pageQuery) upstreamsStatus {
	now := monoclock.Now()
	status := upstreamsStatus{
		Limit:     q.limit,
		Upstreams: []upstreamView{},
		Summary:   upstreamsSummary{States: map[string]int{stateHealthy: 0, stateFailing: 0, stateEjected: 0, stateUnsampled: 0}, Worst: []upstreamView{}},
	}
	if q.dial != "" {
		status.Limit = 1
	}
	worst := newFirstN(worstShown, worse)
	prices := policyTables()
	keep := newFirstN(q.limit+1, statsByDial)
	hoststate.Each(func(st *hoststate.Stats) bool {
		status.Total++
		snap := st.Snapshot(now)
		status.Summary.States[upstreamState(snap)]++
		if priced(snap) {
			worst.offer(rated{snap, prices.expected(st, now)})
		}
		if q.dial != "" && st.Dial() == q.dial || q.dial == "" && st.Dial() > q.after {
			keep.offer(st)
		}
		return true
	})
	page := keep.sorted()

	// The page ends where the first of its lists (the upstreams, or a
	// pool's members) reaches limit, so that the next page, after that
	// address, misses nothing in any of them.
	r := dialRange{after: q.after, only: q.dial}
	reports := allPoolReports()
	if q.dial == "" {
		if len(page) > q.limit {
			r.upTo, r.bounded = page[q.limit-1].Dial(), true
		}
		for _, p := range reports {
			end, more := pageEnd(q.after, q.limit, p.dials)
			if more && (!r.bounded || end < r.upTo) {
				r.upTo, r.bounded = end, true
			}
		}
		if r.bounded {
			status.NextAfter = r.upTo
		}
	}
	for _, st := range page {
		if !r.has(st.Dial()) {
			break
		}
		status.Upstreams = append(status.Upstreams, viewOf(st.Snapshot(now), prices.expected(st, now), now))
	}
	status.Pools = poolStatusesIn(reports, r)
	for _, w := range worst.sorted() {
		status.Summary.Worst = append(status.Summary.Worst, viewOf(w.snap, w.expected, now))
	}
	return status
}

// viewOf returns the admin API's view of one upstream; expected is what
// selection expects of it, in ns (see expectedOf).
func viewOf(s hoststate.Snapshot, expected float64, now int64) upstreamView {
	v := upstreamView{
		Dial:              s.Dial,
		State:             upstreamState(s),
		AnswerMedianMs:    float64(s.AnswerMedian) / 1e6,
		AnswerMedianHuman: s.AnswerMedian.Round(10 * time.Microsecond).String(),
		FailureRatio:      s.FailureRatio,
		EstimateAgeMs:     float64(s.Age) / 1e6,
		InFlight:          s.InFlight,
		Pending:           s.Pending,
		Samples:           s.Samples,
		SamplesHuman:      humanize.Comma(int64(s.Samples)),
		Failures:          s.Failures,
		PassiveFails:      s.PassiveFails,

		EjectedForMs:        float64(s.EjectedFor) / 1e6,
		Ejections:           s.Ejections,
		EjectionsOverflow:   s.Overflows,
		EjectionsByReason:   make(map[string]uint64, len(s.Outlier.ByReason)),
		ConsecutiveFailures: s.ConsecFailures,
	}
	for r, n := range s.Outlier.ByReason {
		v.EjectionsByReason[hoststate.EjectReason(r).String()] = n
	}
	v.Drained, v.WeightPercent = drainView(s.Dial)
	if s.Outlier.HasEjected {
		v.EjectionReason = s.Outlier.LastReason.String()
	}
	if !math.IsInf(expected, 0) && !math.IsNaN(expected) {
		e := expected / 1e6
		v.ExpectedMs = &e
	}
	if s.AnswerMedian == 0 {
		v.AnswerMedianHuman = "no answers yet"
	}
	if s.LoadReport != nil {
		v.LoadReport = loadReportViewOf(s.LoadReport, now)
	}
	if s.ReportsRefused > 0 {
		v.LoadReportsRefused = s.ReportsRefused
		v.LoadReportError = loadReportErrorKind(s.ReportError)
	}
	for _, n := range s.Probes {
		v.ProbesSent += n
	}
	v.ProbesFailed, v.ProbesRejected = s.Probes[hoststate.ProbeFailed], s.Probes[hoststate.ProbeRejected]
	if s.SinceFailure > 0 {
		v.LastFailureHuman = humanize.Time(time.Now().Add(-s.SinceFailure))
	}
	return v
}

// Interface guards
var _ caddy.AdminRouter = adminAPI{}
