package hoststate

import "sync/atomic"

// Recent picks: how often a policy chose the host lately, counted at the
// choice rather than when the attempt ends. A wrapped stock policy's slow
// start is held to a share of the pool's picks with it (see the panic
// policy's ramp cap): a cap on what a policy did in the last moment has
// to see a choice at once, and the finished attempts the failure ratio
// counts lag by the host's latency and decay over seconds.
//
// Two buckets of pickBucket each: the count of the current one, and that
// of the one before, which fades out linearly over the current one, so
// the estimate slides instead of dropping to nothing at each turn. Three
// words per host; a turn is one compare-and-swap.

// pickBucket is the length (ns) of one bucket of picks: short enough that
// the estimate follows a ramp measured in seconds, long enough to hold
// tens of picks at the rates where a ramp matters.
const pickBucket = int64(250e6)

// pickCount is a host's recent picks (see above).
type pickCount struct {
	startNs atomic.Int64 // when the current bucket began
	cur     atomic.Int64
	prev    atomic.Int64
}

// turn makes the bucket holding now the current one. Concurrent picks
// across a turn may land in either bucket: an estimate, not an account.
func (p *pickCount) turn(now int64) {
	start := p.startNs.Load()
	elapsed := now - start
	if elapsed < pickBucket {
		return
	}
	if !p.startNs.CompareAndSwap(start, now-elapsed%pickBucket) {
		return // another pick turned it
	}
	if elapsed < 2*pickBucket {
		p.prev.Store(p.cur.Swap(0))
	} else {
		p.prev.Store(0)
		p.cur.Store(0)
	}
}

// CountPick counts that a policy chose the host at now.
func (s *Stats) CountPick(now int64) {
	s.picks.turn(now)
	s.picks.cur.Add(1)
}

// RecentPicks returns the host's picks over about the last pickBucket
// before now: the current bucket's, plus the share of the previous one's
// that the window still covers.
func (s *Stats) RecentPicks(now int64) float64 {
	p := &s.picks
	elapsed := now - p.startNs.Load()
	cur, prev := float64(p.cur.Load()), float64(p.prev.Load())
	switch {
	case elapsed >= 2*pickBucket:
		return 0
	case elapsed >= pickBucket:
		// cur is the previous bucket now; nothing counted since
		return cur * (1 - float64(elapsed-pickBucket)/float64(pickBucket))
	case elapsed < 0:
		return cur + prev
	}
	return cur + prev*(1-float64(elapsed)/float64(pickBucket))
}

// ForgetPicks forgets the host's recent picks, for a clock that jumps: a
// simulation or a test that moves a ramp's start back instead of waiting
// has picks made under one ramp factor still counted under the next.
func (s *Stats) ForgetPicks() {
	s.picks.cur.Store(0)
	s.picks.prev.Store(0)
}
