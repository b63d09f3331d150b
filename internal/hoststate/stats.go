package hoststate

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/pickrate"
)

// ejectionEpoch counts ejections and early returns process-wide, so that
// cached counts of available upstreams can tell they are stale.
var ejectionEpoch atomic.Uint64

// EjectionEpoch returns a number that changes whenever an upstream is
// ejected or returns early anywhere in the process.
func EjectionEpoch() uint64 { return ejectionEpoch.Load() }

// Stats is the state of one upstream dial address. It is shared by all
// handlers and configs that use the address. Reads are lock-free; updates
// are serialised per address by mu, which only Observe takes.
type Stats struct {
	dial string
	// bornNs is when the state was created (monoclock.Now()); never changed.
	bornNs int64

	// mu serialises updates of the estimate; reads are lock-free.
	mu         sync.Mutex
	win        window       // recent answers, under mu
	estimateNs atomic.Int64 // median of win; 0 until the first answer
	stampNs    atomic.Int64 // monoclock.Now() of the last answer counted in win
	// answerNs is the last non-zero median of win. Unlike estimateNs it
	// outlives an ejection (which forgets the window so the host returns
	// as a new one), so that what is reported of an ejected host is the
	// speed it last answered at, never 0.
	answerNs atomic.Int64

	// The failure ratio: time-decayed counts of finished attempts and of
	// failed ones (float64 bits), and when they were last decayed (see
	// failures.go). Written under mu, read without it.
	attemptsW atomic.Uint64
	failedW   atomic.Uint64
	weighedNs atomic.Int64

	lastDoneNs  atomic.Int64 // monoclock.Now() of the last answer or failure
	busySinceNs atomic.Int64 // monoclock.Now() when pending last went from 0 to 1
	// An attempt given up on after longer than the estimate reveals a
	// stall that its end does not end: the host still holds the work (a
	// server notices a closed connection only when it writes), and a hedge
	// that cancels its loser would otherwise make a frozen host look idle
	// and fresh again. The stall seen so far (since stuckFromNs) goes on
	// counting until the host answers or fails, or until stuckUntilNs:
	// as long again as it had lasted, after which the host gets traffic
	// again to show whether it is still stuck. stuckUntilNs is 0 when no
	// such stall is known.
	stuckFromNs  atomic.Int64
	stuckUntilNs atomic.Int64
	failStreak   atomic.Int64 // failed attempts in a row, for the estimate

	samples       atomic.Uint64
	failures      atomic.Uint64
	lastFailureNs atomic.Int64
	pending       atomic.Int64 // round trips waiting for response headers

	consecutive    atomic.Int64 // failed attempts in a row
	ejectedUntilNs atomic.Int64 // monoclock.Now() until which the host is ejected
	ejections      atomic.Int64 // ejections in a row: the backoff multiplier
	ejectionsTotal atomic.Uint64
	overflows      atomic.Uint64 // ejections the pool's cap refused
	restoreDue     atomic.Bool   // ejected, and its return not yet announced

	// rampFromNs is when the host last joined or returned to a pool that
	// was already serving (slow start); 0 if never. The end of an ejection
	// is a return too, read from ejectedUntilNs.
	rampFromNs atomic.Int64
	// probePasses counts active health checks passed in a row while
	// ejected (see Restore).
	probePasses atomic.Int64

	// host is Caddy's own per-address record (in-flight requests, passive
	// failures), remembered from the last request so the admin API can show
	// it. Selection reads it from the pool directly.
	host atomic.Pointer[reverseproxy.Host]

	// Outlier detection by success rate and failure percentage, and
	// ejections by reason (see outcomes.go). The counters are cumulative
	// and never reset: each evaluator keeps its own previous reading.
	tally             atomic.Uint64 // judged and failed attempts, packed: see Tally
	ejectionsByReason [NumEjectReasons]atomic.Uint64
	lastReason        atomic.Uint32 // EjectReason+1 of the last ejection; 0 if never

	// reports are the upstream's ORCA load reports (see loadreport.go).
	reports loadReports

	// picks are the host's recent selections (see picks.go).
	picks pickrate.Counter
}

// Destruct implements caddy.Destructor; Stats holds no resources.
func (*Stats) Destruct() error { return nil }

// Begin marks the start of a round trip to the upstream and returns its start time.
func (s *Stats) Begin() int64 {
	now := monoclock.Now()
	s.BeginAt(now)
	return now
}

// BeginAt is Begin at a given time, for callers (and simulations) that
// keep their own clock.
func (s *Stats) BeginAt(now int64) {
	if s.pending.Add(1) == 1 {
		s.busySinceNs.Store(now)
	}
}

// busy reports whether a round trip to the upstream is in flight: one
// awaiting headers, or one Caddy still counts (a body being streamed).
func (s *Stats) busy() bool {
	if s.pending.Load() > 0 {
		return true
	}
	h := s.host.Load()
	return h != nil && h.NumRequests() > 0
}

// SetHost remembers Caddy's per-address record for reporting.
func (s *Stats) SetHost(h *reverseproxy.Host) {
	if h != nil && s.host.Load() != h {
		s.host.Store(h)
	}
}

// Outcome classifies a finished round trip.
type Outcome uint8

const (
	// Success is a round trip that produced response headers.
	Success Outcome = iota
	// Failure is a transport error or timeout: the upstream did not answer.
	Failure
	// Abandoned is a round trip the client (or a hedge) gave up on: the
	// elapsed time is only a lower bound on the upstream's latency, and
	// the upstream finished nothing.
	Abandoned
)

// observe folds one finished round trip into the state: an answer joins
// the window and moves the median; a failure extends the failure streak,
// and joins the window only when it took longer than the estimate (a
// timeout says the host is slow; an instant refusal says nothing about its
// speed). An abandoned attempt (the client left) is a lower bound on the
// latency: it joins the window only when above the estimate, and then
// the stall it reveals goes on (see stuckFromNs). A host with
// no answer yet has no estimate to compare with, and its failures speak
// through the streak alone. It returns
// the latency of a successful answer, 0 otherwise.
func (s *Stats) observe(now, start int64, outcome Outcome, horizon int64) (answer int64) {
	elapsed := max(now-start, 1)
	if outcome != Abandoned {
		s.lastDoneNs.Store(now)
		if s.stuckUntilNs.Load() != 0 {
			s.stuckUntilNs.Store(0)
		}
	}
	// read while this attempt still counts as pending, so that busySince
	// is the start of the busy period it belonged to; a known stall still
	// on when it began started earlier
	stallFrom := max(s.lastDoneNs.Load(), s.busySinceNs.Load())
	if s.stuckUntilNs.Load() > start {
		stallFrom = min(stallFrom, s.stuckFromNs.Load())
	}
	s.pending.Add(-1)
	switch outcome {
	case Success:
		s.samples.Add(1)
		if s.failStreak.Load() != 0 {
			s.failStreak.Store(0)
		}
		answer = elapsed
	case Failure:
		s.samples.Add(1)
		s.failures.Add(1)
		s.lastFailureNs.Store(now)
		s.failStreak.Add(1)
		if est := s.estimateNs.Load(); est == 0 || elapsed <= est {
			s.mu.Lock()
			s.weigh(now, true)
			s.mu.Unlock()
			return 0
		}
	case Abandoned:
		if est := s.estimateNs.Load(); est == 0 || elapsed <= est {
			return 0
		}
		if stalled := now - stallFrom; stalled > 0 {
			s.stuckFromNs.Store(stallFrom)
			s.stuckUntilNs.Store(now + stalled)
		}
	}
	s.mu.Lock()
	if outcome != Abandoned {
		s.weigh(now, outcome == Failure)
	}
	s.win.add(now, elapsed)
	m := s.win.median(now - horizon)
	s.estimateNs.Store(m)
	if m != 0 {
		s.answerNs.Store(m)
	}
	s.stampNs.Store(now)
	s.mu.Unlock()
	return answer
}

// Snapshot is a point-in-time view of one upstream's state.
type Snapshot struct {
	Dial     string
	Estimate time.Duration // median of recent answers; 0 when never sampled
	// AnswerMedian is the median of the host's recent answers, kept while it is ejected or
	// failing (Estimate may be 0 then); 0 only when it never answered.
	AnswerMedian time.Duration
	// FailureRatio is the recent, time-decayed share of the host's attempts that failed, 0..1.
	FailureRatio float64
	Age          time.Duration // since the last answer counted in the estimate
	FailStreak   int64         // failed attempts in a row
	Samples      uint64
	Failures     uint64
	SinceFailure time.Duration // 0 when it never failed
	Pending      int64
	InFlight     int // Caddy's count of requests in flight
	PassiveFails int // Caddy's passive health-check failure count
	// EjectedFor is how long the host stays ejected; 0 when it is not.
	EjectedFor time.Duration
	Ejections  uint64 // times ejected, in total
	// Overflows counts the times an ejection rule condemned the host but
	// the pool was at its ejection cap, so it stayed in.
	Overflows      uint64
	ConsecFailures int64
	Outlier        EjectionSnapshot // ejections by reason
	// LoadReport is the latest good load report; nil if none came.
	LoadReport *LoadReport
	// ReportsRefused counts load reports that did not parse, and
	// ReportError is the kind of fault of the last one (nil if none).
	ReportsRefused uint64
	ReportError    error
	// Probes counts the load probes sent to the host, by ProbeResult.
	Probes [NumProbeResults]uint64
}

// Snapshot reads the state without locking.
func (s *Stats) Snapshot(now int64) Snapshot {
	snap := Snapshot{
		Dial:         s.dial,
		Estimate:     time.Duration(s.estimateNs.Load()),
		AnswerMedian: time.Duration(s.answerNs.Load()),
		FailureRatio: s.FailureRatio(now),
		Samples:      s.samples.Load(),
		Failures:     s.failures.Load(),
		Pending:      s.pending.Load(),
	}
	if lf := s.lastFailureNs.Load(); lf != 0 {
		snap.SinceFailure = time.Duration(now - lf)
	}
	if until := s.ejectedUntilNs.Load(); until > now {
		snap.EjectedFor = time.Duration(until - now)
	}
	if snap.Estimate != 0 {
		snap.Age = time.Duration(now - s.stampNs.Load())
	}
	snap.FailStreak = s.failStreak.Load()
	snap.Ejections = s.ejectionsTotal.Load()
	snap.Overflows = s.overflows.Load()
	snap.ConsecFailures = s.consecutive.Load()
	snap.Outlier = s.ejectionSnapshot()
	snap.LoadReport = s.LoadReport()
	snap.ReportsRefused, snap.ReportError = s.LoadReportsRefused()
	snap.Probes = s.LoadProbes()
	if h := s.host.Load(); h != nil {
		snap.InFlight = h.NumRequests()
		snap.PassiveFails = h.Fails()
	}
	return snap
}

// Outlier state: written by lbpolicy's outlier detection under no lock of
// ours (each field is a single atomic), read by selection.

// RecordOutcome counts one attempt for outlier detection and returns the
// number of consecutive failed attempts, 0 after a success. It also counts
// the attempt for the interval rules (see Tally).
func (s *Stats) RecordOutcome(failed bool) int64 {
	s.countJudged(failed)
	if !failed {
		s.consecutive.Store(0)
		return 0
	}
	return s.consecutive.Add(1)
}

// NoteOverflow counts an ejection the pool's cap refused (Envoy's
// ejections_overflow): the sign that max_ejection_percent is holding
// failing hosts in.
func (s *Stats) NoteOverflow() { s.overflows.Add(1) }

// Ejected reports whether the upstream is ejected at now.
func (s *Stats) Ejected(now int64) bool { return s.ejectedUntilNs.Load() > now }

// Eject marks the upstream ejected until until and returns how many times
// it has been ejected in a row (the backoff multiplier), counting this one.
// A multiplier that was not used for decay periods is first reduced by one
// per period, so a host that behaved for a while starts again near the
// base ejection time. reason is counted in the per-reason totals. ok is
// false, and nothing changes, when the upstream is already ejected at now
// (another rule or another handler sharing the address got there first).
// The latency estimate is forgotten: the host returns as a new one.
func (s *Stats) Eject(now int64, decay time.Duration, duration func(multiplier int64) time.Duration, reason EjectReason) (until int64, multiplier int64, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.Ejected(now) {
		return s.ejectedUntilNs.Load(), s.ejections.Load(), false
	}
	m := s.ejections.Load()
	if last := s.ejectedUntilNs.Load(); m > 0 && last > 0 && decay > 0 {
		m = max(m-(now-last)/int64(decay), 0)
	}
	m++
	until = now + int64(duration(m))
	s.ejections.Store(m)
	s.ejectionsTotal.Add(1)
	s.noteEjection(reason)
	ejectionEpoch.Add(1)
	// The estimate was charged for the failures that led here; when the
	// host returns it starts afresh at the pool's typical latency, like a
	// new host, and slow start (if any) shapes its share.
	s.win.reset()
	s.estimateNs.Store(0)
	s.failStreak.Store(0)
	s.ejectedUntilNs.Store(until)
	s.consecutive.Store(0)
	s.restoreDue.Store(true)
	return until, m, true
}

// TakeRestored reports, once per ejection, that the upstream's ejection
// has ended: true for the first caller at or after the end, false before
// and after.
func (s *Stats) TakeRestored(now int64) bool {
	return s.restoreDue.Load() && !s.Ejected(now) && s.restoreDue.CompareAndSwap(true, false)
}
