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
