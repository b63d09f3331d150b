package hoststate

// Slow start state. The ramp itself (how the weight grows) is the policy's
// business; this records when each host's current ramp began.

// StartRamp records that the upstream (re)joins its pools at now: it was
// new to a pool already serving, or it came back from being unhealthy.
func (s *Stats) StartRamp(now int64) { s.rampFromNs.Store(now) }

// StartRampIfNew starts the upstream's ramp at now if it has never served
// a request and never ramped: it is new. It reports whether it started.
func (s *Stats) StartRampIfNew(now int64) bool {
	return s.samples.Load() == 0 && s.rampFromNs.CompareAndSwap(0, now)
}

// RampStart returns when the upstream's latest return began, as of now:
// the later of its last StartRamp and the end of its last ejection (if
// that end has passed); 0 if it never (re)joined.
func (s *Stats) RampStart(now int64) int64 {
	r := s.rampFromNs.Load()
	if e := s.ejectedUntilNs.Load(); e != 0 && e > r && e <= now {
		r = e
	}
	return r
}

// Served reports whether the upstream has answered any request.
func (s *Stats) Served() bool { return s.samples.Load() > 0 }

// ProbePassed counts an active health check the upstream passed while
// ejected and returns how many it passed in a row.
func (s *Stats) ProbePassed() int64 { return s.probePasses.Add(1) }

// ProbeFailed resets the count of passed health checks.
func (s *Stats) ProbeFailed() {
	if s.probePasses.Load() != 0 {
		s.probePasses.Store(0)
	}
}

// Restore ends the upstream's ejection at now, before its time, and
// reports whether it was ejected. The return counts as the end of the
// ejection: slow start begins, and the backoff multiplier decays from now.
// The return is announced by the caller, not by TakeRestored.
func (s *Stats) Restore(now int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.Ejected(now) {
		return false
	}
	s.ejectedUntilNs.Store(now)
	s.restoreDue.Store(false)
	s.probePasses.Store(0)
	ejectionEpoch.Add(1)
	return true
}
