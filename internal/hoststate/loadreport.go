package hoststate

import (
	"errors"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-lbx/lbx/internal/orca"
)

// LoadReport is the latest good ORCA load report an upstream sent, as
// kept for selection and the admin views. It is immutable once stored:
// readers load a pointer to it with one atomic load and never see it
// change.
type LoadReport struct {
	// Report is the parsed report. Its map keys are copies, so that the
	// header value they were read from (up to 8 KiB) is not kept alive.
	orca.Report
	// AtNs is when the report was received (monoclock.Now()).
	AtNs int64
	// MaxAge is how long the report counts as fresh: the max_age of the
	// pool whose transport received it.
	MaxAge time.Duration
}

// Age returns how long ago the report was received.
func (r *LoadReport) Age(now int64) time.Duration { return time.Duration(max(now-r.AtNs, 0)) }

// Stale reports whether the report is older than its MaxAge at now: it
// is still shown, but flagged, and selection must not use it.
func (r *LoadReport) Stale(now int64) bool { return r.Age(now) > r.MaxAge }

// loadReports is the report state of one upstream.
type loadReports struct {
	latest  atomic.Pointer[LoadReport]
	refused atomic.Uint64
	// lastKind is the kind (an orca.Err* value) of the last refused
	// report; nil if none was refused.
	lastKind atomic.Pointer[error]
	// probes counts the load probes sent to the upstream, by result.
	probes [NumProbeResults]atomic.Uint64
	// probedNs is when the last load probe to the upstream started
	// (monoclock); 0 if none did.
	probedNs atomic.Int64
}

// ProbeResult is how a load probe (a request sent only for the
// upstream's load report) ended.
type ProbeResult uint8

const (
	// ProbeOK is a probe answered with a status below 400.
	ProbeOK ProbeResult = iota
	// ProbeFailed is a probe that got no answer in time, or a 5xx: the
	// upstream could not serve even that.
	ProbeFailed
	// ProbeRejected is a probe answered with a 4xx: the upstream is up,
	// but the probe's path is likely wrong.
	ProbeRejected
	// NumProbeResults is the number of ProbeResult values.
	NumProbeResults
)

// String returns the result's name, as the metrics label it.
func (r ProbeResult) String() string {
	switch r {
	case ProbeOK:
		return "ok"
	case ProbeFailed:
		return "failed"
	case ProbeRejected:
		return "rejected"
	}
	return "unknown"
}

// StartLoadProbe notes that a load probe to the upstream starts at now.
func (s *Stats) StartLoadProbe(now int64) { s.reports.probedNs.Store(now) }

// LoadProbedAt returns when the last load probe to the upstream started
// (monoclock), 0 if none did.
func (s *Stats) LoadProbedAt() int64 { return s.reports.probedNs.Load() }

// CountLoadProbe counts one load probe sent to the upstream that ended
// with r.
func (s *Stats) CountLoadProbe(r ProbeResult) {
	if r < NumProbeResults {
		s.reports.probes[r].Add(1)
	}
}

// LoadProbes returns how many load probes sent to the upstream ended
// with each result, indexed by ProbeResult.
func (s *Stats) LoadProbes() (n [NumProbeResults]uint64) {
	for i := range n {
		n[i] = s.reports.probes[i].Load()
	}
	return n
}

// SetLoadReport keeps r, received at now, as the upstream's latest load
// report, fresh for maxAge. It clones what it keeps of r's maps.
func (s *Stats) SetLoadReport(r orca.Report, now int64, maxAge time.Duration) {
	r.Named = cloneMetrics(r.Named)
	r.Utilizations = cloneMetrics(r.Utilizations)
	r.RequestCost = cloneMetrics(r.RequestCost)
	if old := s.reports.latest.Swap(&LoadReport{Report: r, AtNs: now, MaxAge: maxAge}); old == nil || old.Stale(now) {
		reportEpoch.Add(1)
	}
}

// reportEpoch counts the upstreams that began to report, or to report
// again after going stale; see ReportEpoch.
var reportEpoch atomic.Uint64

// ReportEpoch returns a number that changes whenever an upstream, anywhere
// in the process, sends a report after none or after a stale one: a view
// that caches its pool's mean reported load takes a new member's report
// into the mean at once, not on its next refresh.
func ReportEpoch() uint64 { return reportEpoch.Load() }

// cloneMetrics copies m with copies of its keys, nil for an empty m.
func cloneMetrics(m map[string]float64) map[string]float64 {
	if len(m) == 0 {
		return nil
	}
	out := make(map[string]float64, len(m))
	for k, v := range m {
		out[strings.Clone(k)] = v
	}
	return out
}

// RefuseLoadReport counts a report that did not parse; err is what
// orca.Parse returned. The last good report stays. Only the error's kind
// is kept (an orca.Err* value, or err itself if it has none), never text
// quoted from the report.
func (s *Stats) RefuseLoadReport(err error) {
	s.reports.refused.Add(1)
	kind := err
	var oe *orca.Error
	if errors.As(err, &oe) {
		kind = oe.Kind
	}
	// a backend that sends garbage sends it on every response: store
	// only when the kind changes
	if p := s.reports.lastKind.Load(); p == nil || *p != kind {
		s.reports.lastKind.Store(&kind)
	}
}

// LoadReport returns the upstream's latest good load report, nil if it
// never sent one. It costs one atomic load; the report must not be
// modified.
func (s *Stats) LoadReport() *LoadReport { return s.reports.latest.Load() }

// LoadReportsRefused returns how many of the upstream's reports were
// refused, and the kind of fault of the last one (nil if none was).
func (s *Stats) LoadReportsRefused() (n uint64, lastKind error) {
	n = s.reports.refused.Load()
	if p := s.reports.lastKind.Load(); p != nil {
		lastKind = *p
	}
	return n, lastKind
}

// How reported load shapes selection.
//
// A proxy in a fleet sees only its own requests to a backend; the backend's
// report tells how busy it is with everyone's. Each report is turned into
// the share of selections in which the upstream is considered at all (an
// admission, drawn per selection as slow start's ramp is), not into a cost:
// every proxy of a fleet receives much the same reports, and a cost would
// send all of them to the least loaded backend at once, to find it
// overloaded a moment later. An admission moves load in proportion, so the
// proxies of a fleet lean away from a hot backend together, each a little.
//
// The load a report states is its utilization (application_utilization,
// else cpu_utilization) plus its share of errors (eps / rps, when it gives
// both: Envoy's and gRPC's error penalty of 1), capped at 1: beyond it a
// backend is saturated, and how deep its queue is the policy sees in its
// latency. A backend's headroom is 1 − load (at least minHeadroom); its
// admission is its headroom over the headroom of the mean load of the
// pool's reporting members, at most 1 and at least MinReportedShare. So a
// report only ever takes share away from a backend busier than its peers:
// one below the mean keeps its share, one that reports alone is compared to
// itself and keeps it, and a new backend's first report of an idle machine
// draws no rush to it (what Envoy's blackout period guards against).
//
// A report's pull fades with its age, from full when received to none at
// its MaxAge: a backend priced out draws few requests, so its reports come
// rarely, and an old report must not hold it out once it has recovered.

// MinReportedShare is the least share of selections a report can leave
// an upstream: a twentieth of what it would have without it. A report
// never takes an upstream out, which is health's and ejection's job, and
// the trickle it keeps brings the next report.
const MinReportedShare = 0.05

// minHeadroom keeps the headroom of a saturated backend above 0: every
// saturated backend then counts alike.
const minHeadroom = 0.01

// Load returns the load r states, for selection: its utilization plus its
// share of errors, between 0 and 1. ok is false when r states no
// utilization.
func (r *LoadReport) Load() (load float64, ok bool) {
	u, ok := r.Utilization()
	if !ok {
		return 0, false
	}
	if r.Has(orca.RPS) && r.Has(orca.EPS) && r.RPS > 0 {
		u += min(r.EPS/r.RPS, 1)
	}
	return min(u, 1), true
}

// Pull returns how much r counts at now: 1 when it was received, falling
// linearly to 0 at its MaxAge.
func (r *LoadReport) Pull(now int64) float64 {
	if r.MaxAge <= 0 {
		return 0
	}
	return max(1-float64(r.Age(now))/float64(r.MaxAge), 0)
}

// ReportedShare returns the share of selections in which an upstream whose
// report states load, with a pull of pull, is considered, when the mean
// load of its pool's reporting members is mean.
func ReportedShare(load, mean, pull float64) float64 {
	share := min(max(1-load, minHeadroom)/max(1-mean, minHeadroom), 1)
	share = max(share, MinReportedShare)
	return 1 - pull*(1-share)
}

// ReportedShare returns the share of selections in which the upstream is
// considered at now, given its pool's mean reported load: see the package
// function ReportedShare; 1 when it has no report that counts.
func (s *Stats) ReportedShare(now int64, mean float64) float64 {
	load, pull, ok := s.ReportedLoad(now)
	if !ok {
		return 1
	}
	return ReportedShare(load, mean, pull)
}

// ReportedLoad returns the load stats' latest report states and the
// report's pull at now; ok is false when it has none that counts (none
// at all, no utilization in it, or too old).
func (s *Stats) ReportedLoad(now int64) (load, pull float64, ok bool) {
	r := s.LoadReport()
	if r == nil {
		return 0, 0, false
	}
	if pull = r.Pull(now); pull <= 0 {
		return 0, 0, false
	}
	load, ok = r.Load()
	return load, pull, ok
}

// MeanReportedLoad returns the mean load the n members of a pool report
// at now (see ReportedLoad), member(i) giving member i's state; ok is
// false when fewer than two members report, since a report is only ever
// weighed against its peers'.
func MeanReportedLoad(now int64, n int, member func(i int) *Stats) (mean float64, ok bool) {
	sum, k := 0.0, 0
	for i := range n {
		if load, _, ok := member(i).ReportedLoad(now); ok {
			sum += load
			k++
		}
	}
	if k < 2 {
		return 0, false
	}
	return sum / float64(k), true
}
