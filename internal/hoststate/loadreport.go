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
	s.reports.latest.Store(&LoadReport{Report: r, AtNs: now, MaxAge: maxAge})
}

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

// How reported load enters selection.
//
// A proxy in a fleet sees only its own requests to a backend; the backend's
// report tells how busy it is with everyone's. What matters to the next
// request is whether it will wait: a backend below its capacity serves it
// at its usual speed however busy it is, and one past it (more requests
// than it serves at once) makes it wait behind the excess. So the report
// multiplies the latency selection expects of the backend by the load it
// states, when that is above 1, and leaves it alone below:
//
//	factor = 1 + pull × (load − 1)   for load > 1, else 1
//
// The load is the report's utilization (application_utilization, else
// cpu_utilization: both defined by ORCA as above 1 past the reporter's
// capacity) plus its share of errors (eps / rps when it gives both: Envoy's
// and gRPC's error penalty of 1), capped at MaxReportedLoad. The pull is
// the report's freshness, 1 when received and falling linearly to 0 at its
// MaxAge, so an upstream a report priced out is tried again once the
// report has aged, and its next answer brings a new one.
//
// Below capacity a report changes nothing: the proxies of a fleet all
// receive much the same reports, and weighing small differences in them
// would move every proxy the same way at once (a herd onto the least
// loaded backend, found overloaded a moment later). Past capacity every
// proxy should leave the backend, and they spread over the others by what
// each sees of them itself, as without reports. Nor can a report make a
// backend look better than without it, so a backend new to the pool, or
// one that lies low, draws no rush (what Envoy's blackout period guards
// against).

// MaxReportedLoad caps the load a report can state: a backend that says
// it holds 32 times what it serves at once is priced as 32 times slower,
// and no more, whatever it says.
const MaxReportedLoad = 32

// Load returns the load r states, for selection: its utilization plus its
// share of errors, at most MaxReportedLoad. ok is false when r states no
// utilization.
func (r *LoadReport) Load() (load float64, ok bool) {
	u, ok := r.Utilization()
	if !ok {
		return 0, false
	}
	if r.Has(orca.RPS) && r.Has(orca.EPS) && r.RPS > 0 {
		u += min(r.EPS/r.RPS, 1)
	}
	return min(u, MaxReportedLoad), true
}

// Pull returns how much r counts at now: 1 when it was received, falling
// linearly to 0 at its MaxAge.
func (r *LoadReport) Pull(now int64) float64 {
	if r.MaxAge <= 0 {
		return 0
	}
	return max(1-float64(r.Age(now))/float64(r.MaxAge), 0)
}

// ReportedFactor returns the factor by which the upstream's latest report
// multiplies the latency selection expects of it at now: 1 + pull × (load
// − 1) when the report states a load above 1, else 1 (also with no
// report, or none that counts). It is within [1, MaxReportedLoad].
func (s *Stats) ReportedFactor(now int64) float64 {
	r := s.LoadReport()
	if r == nil {
		return 1
	}
	load, ok := r.Load()
	if !ok || load <= 1 {
		return 1
	}
	return 1 + r.Pull(now)*(load-1)
}
