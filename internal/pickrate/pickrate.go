// Package pickrate counts how often a policy chose something lately,
// counted at the choice: a cap on a share (a slow-start ramp, an
// operator's reweight) that a load-seeking wrapped policy would otherwise
// exceed has to see each choice at once, which counts of finished
// attempts, lagging by the latency and decaying over seconds, do not.
//
// A Counter keeps two buckets of Bucket each: the count of the current
// one and of the one before, which fades out linearly over the current
// one, so the estimate slides instead of dropping to nothing at each
// turn. Three words; a turn is one compare-and-swap. Pure: the caller
// passes the time (monoclock nanoseconds).
package pickrate

import "sync/atomic"

// Bucket is the length (ns) of one bucket: short enough that the estimate
// follows a ramp measured in seconds, long enough to hold tens of choices
// at the rates where a cap matters.
const Bucket = int64(250e6)

// Counter is a recent count of choices. The zero value is ready.
type Counter struct {
	startNs atomic.Int64 // when the current bucket began
	cur     atomic.Int64
	prev    atomic.Int64
}

// turn makes the bucket holding now the current one. Concurrent counts
// across a turn may land in either bucket: an estimate, not an account.
func (c *Counter) turn(now int64) {
	start := c.startNs.Load()
	elapsed := now - start
	if elapsed < Bucket {
		return
	}
	if !c.startNs.CompareAndSwap(start, now-elapsed%Bucket) {
		return // another count turned it
	}
	if elapsed < 2*Bucket {
		c.prev.Store(c.cur.Swap(0))
	} else {
		c.prev.Store(0)
		c.cur.Store(0)
	}
}

// Count counts one choice at now.
func (c *Counter) Count(now int64) {
	c.turn(now)
	c.cur.Add(1)
}

// Recent returns the choices over about the last Bucket before now: the
// current bucket's, plus the share of the previous one's that the window
// still covers.
func (c *Counter) Recent(now int64) float64 {
	elapsed := now - c.startNs.Load()
	cur, prev := float64(c.cur.Load()), float64(c.prev.Load())
	switch {
	case elapsed >= 2*Bucket:
		return 0
	case elapsed >= Bucket:
		// cur is the previous bucket now; nothing counted since
		return cur * (1 - float64(elapsed-Bucket)/float64(Bucket))
	case elapsed < 0:
		return cur + prev
	}
	return cur + prev*(1-float64(elapsed)/float64(Bucket))
}

// Forget forgets every count, for a clock that jumps: a simulation or a
// test that moves a ramp's start back instead of waiting has choices made
// under one factor still counted under the next.
func (c *Counter) Forget() {
	c.cur.Store(0)
	c.prev.Store(0)
}

// HeldTo reports whether something with mine recent choices is at or over
// factor times others, the recent choices per member of the rest of its
// pool, plus one (so that at a trickle of traffic it is not starved).
func HeldTo(factor, mine, others float64) bool {
	return mine >= factor*others+1
}
