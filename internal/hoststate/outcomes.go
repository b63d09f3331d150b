package hoststate

import "sort"

// EjectReason says which outlier-detection rule ejected an upstream.
type EjectReason uint8

// The outlier-detection rules, in the order Envoy checks them.
const (
	// ReasonConsecutiveFailures: too many failed attempts in a row.
	ReasonConsecutiveFailures EjectReason = iota
	// ReasonSuccessRate: a success rate far below the pool's mean.
	ReasonSuccessRate
	// ReasonFailurePercentage: a failure percentage above a fixed threshold.
	ReasonFailurePercentage

	// NumEjectReasons is the number of reasons, for arrays indexed by one.
	NumEjectReasons
)

var reasonNames = [NumEjectReasons]string{"consecutive_failures", "success_rate", "failure_percentage"}

// String returns the reason as it appears in logs, events and metrics.
func (r EjectReason) String() string {
	if r < NumEjectReasons {
		return reasonNames[r]
	}
	return "unknown"
}

// Dial returns the upstream's dial address.
func (s *Stats) Dial() string { return s.dial }

// countJudged adds one attempt judged by outlier detection to the
// cumulative tally that the interval rules (success rate, failure
// percentage) read.
func (s *Stats) countJudged(failed bool) {
	d := uint64(1) << 32
	if failed {
		d++
	}
	s.tally.Add(d)
}

// Tally is a reading of an upstream's cumulative count of attempts judged
// by outlier detection and of those that failed, packed in one word (the
// attempts above bit 32, the failures below) so that one atomic load reads
// a consistent pair. It is never reset — the Stats is shared by every
// handler that uses the address — so whoever evaluates it keeps its own
// previous reading and works on the difference (Since).
type Tally uint64

// Tally reads the cumulative count of judged and failed attempts.
func (s *Stats) Tally() Tally { return Tally(s.tally.Load()) }

// Since returns how many attempts were judged, and of those failed,
// between the earlier reading prev and t. It is exact, wrap-around
// included, while fewer than 2³² attempts lie between the two readings.
func (t Tally) Since(prev Tally) (judged, failed uint64) {
	d := uint64(t - prev)
	return d >> 32, d & (1<<32 - 1)
}

// noteEjection records an ejection's reason; the caller holds s.mu.
func (s *Stats) noteEjection(reason EjectReason) {
	if reason >= NumEjectReasons {
		reason = ReasonConsecutiveFailures
	}
	s.ejectionsByReason[reason].Add(1)
	s.lastReason.Store(uint32(reason) + 1)
}

// EjectionSnapshot is the outlier-ejection part of a Snapshot.
type EjectionSnapshot struct {
	// ByReason counts ejections by reason, indexed by EjectReason; they
	// add up to Snapshot.Ejections.
	ByReason [NumEjectReasons]uint64
	// LastReason is why the upstream was last ejected (or is ejected
	// now); meaningful when HasEjected is.
	LastReason EjectReason
	HasEjected bool
}

// ejectionSnapshot reads the outlier counters without locking.
func (s *Stats) ejectionSnapshot() EjectionSnapshot {
	var e EjectionSnapshot
	for i := range e.ByReason {
		e.ByReason[i] = s.ejectionsByReason[i].Load()
	}
	if r := s.lastReason.Load(); r != 0 {
		e.LastReason, e.HasEjected = EjectReason(r-1), true
	}
	return e
}

// Members returns the upstream state of every address this table uses,
// sorted by dial address.
func (t *Table) Members() []*Stats {
	var out []*Stats
	t.byDial.Range(func(_, v any) bool {
		out = append(out, v.(*Stats))
		return true
	})
	sort.Slice(out, func(i, j int) bool { return out[i].dial < out[j].dial })
	return out
}
