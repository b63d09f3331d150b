package hoststate

// Recent picks: how often a policy chose the host lately, counted at the
// choice (see internal/pickrate). The panic wrapper's slow start holds a
// ramping upstream to a share of the pool's picks with them.

// CountPick counts that a policy chose the host at now.
func (s *Stats) CountPick(now int64) { s.picks.Count(now) }

// RecentPicks returns the host's picks over about the last quarter second
// before now (pickrate.Counter.Recent).
func (s *Stats) RecentPicks(now int64) float64 { return s.picks.Recent(now) }

// ForgetPicks forgets the host's recent picks, for a clock that jumps: a
// simulation or a test that moves a ramp's start back instead of waiting.
func (s *Stats) ForgetPicks() { s.picks.Forget() }
