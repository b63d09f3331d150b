package partition

import (
	"math/rand/v2"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// The cost model of choosing (see docs/partition.md). A small layout is
// judged exactly on every request: its schemes' capacities are counted
// from every replica's health, as brpc does. A large one would make every
// request pay for every replica, so its capacities come from an audit
// (audit) kept with the layout, redone in the background when an
// ejection or return happened anywhere (hoststate.EjectionEpoch) or when
// it is older than capRefresh; requests read the last one and never wait
// for a new one. A large partition hands reverse_proxy's selection policy
// a random sample of at most aperture of its replicas rather than all of
// them.
const (
	// exactSlots is the most replica slots (a replica counts once per
	// partition it serves) a layout may have to be judged exactly on
	// every request.
	exactSlots = 512

	// capRefresh is the oldest a large layout's audit may be before a
	// request starts a new one: how long Caddy's own health changes
	// (passive health check failures, max_requests) may go unseen in the
	// choice of a scheme.
	capRefresh = 200 * time.Millisecond

	// aperture is the most replicas of one partition handed to the
	// selection policy for one attempt. It keeps the policy's scan
	// bounded while leaving it enough candidates to compare (the power
	// of d choices with d = 32).
	aperture = 32

	// stableAbove is the partition size above which a request's
	// candidates come from the audit's sample first rather than from
	// fresh random draws (see drawUpstreams).
	stableAbove = 4096

	// maxDescribed is the most partitions a 503 answer names as having
	// no usable replica; the rest are counted.
	maxDescribed = 8
)

// audit is a large layout's health at one time: each scheme's capacity
// and, per partition, its usable and ejected replica counts and a random
// sample of its usable replicas. It is immutable once published.
type audit struct {
	at      int64  // monoclock reading it was taken at
	epoch   uint64 // hoststate.EjectionEpoch() before it was taken
	total   int    // the sum of the schemes' capacities
	schemes []schemeAudit
}

type schemeAudit struct {
	capacity int
	parts    []partAudit
}

type partAudit struct {
	usable, ejected int
	sample          []*replica // at most aperture usable replicas, uniformly drawn
}

// takeAudit counts every replica's health at now: O(replicas), for a
// background goroutine or a naming apply, never a request.
func (l *layout) takeAudit(now int64) *audit {
	a := &audit{at: now, epoch: hoststate.EjectionEpoch(), schemes: make([]schemeAudit, len(l.schemes))}
	for i, s := range l.schemes {
		sa := &a.schemes[i]
		sa.parts = make([]partAudit, len(s.parts))
		sa.capacity = -1
		for p, reps := range s.parts {
			pa := &sa.parts[p]
			for _, r := range reps {
				switch {
				case r.usable(now):
					pa.usable++
					// Reservoir sampling: each usable replica ends up
					// in the sample with equal probability.
					if len(pa.sample) < aperture {
						pa.sample = append(pa.sample, r)
					} else if k := rand.IntN(pa.usable); k < aperture {
						pa.sample[k] = r
					}
				case r.ejected(now):
					pa.ejected++
				}
			}
			if sa.capacity < 0 || pa.usable < sa.capacity {
				sa.capacity = pa.usable
			}
		}
		sa.capacity = max(sa.capacity, 0)
		a.total += sa.capacity
	}
	return a
}

// current returns the layout's audit for a request at now, and starts a
// new one in the background when it is stale. It is nil for a layout
// judged exactly.
func (l *layout) current(now int64) *audit {
	a := l.audited.Load()
	if a == nil {
		return nil
	}
	if (now-a.at > int64(capRefresh) || hoststate.EjectionEpoch() != a.epoch) && l.auditing.CompareAndSwap(false, true) {
		go l.reaudit()
	}
	return a
}

// sample returns the last audit's sample of usable replicas of partition
// i, for a partition large enough to draw from (see drawUpstreams); nil
// otherwise.
func (s *scheme) sample(i int) []*replica {
	if len(s.parts[i]) <= aperture {
		return nil
	}
	if a := s.l.audited.Load(); a != nil {
		return a.schemes[s.idx].parts[i].sample
	}
	return nil
}

// reaudit takes and publishes a new audit; one runs at a time per layout.
func (l *layout) reaudit() {
	defer l.auditing.Store(false)
	defer func() { _ = recover() }() // keep the last audit; the next stale request retries
	l.audited.Store(l.takeAudit(monoclock.Now()))
}

// Returning memory after a large list shrinks. Go's heap lets go of the
// old list's objects at the next collection, but the runtime hands the
// pages back to the operating system only gradually, so the process's
// RSS would stay near its peak for minutes after 200,000 upstreams became
// 3. After a shrink by at least bigShrink replica slots the handler asks
// the runtime to return them (debug.FreeOSMemory, a full collection) once
// the old version is let go of everywhere: after returnDelay, when the
// naming watcher has replaced its own copy and requests that had loaded
// the old layout have finished. At most once per returnEvery, since the
// collection it forces stops the world briefly.
const (
	bigShrink   = 50000
	returnDelay = time.Second
	returnEvery = time.Minute
)

// lastReturn is when returnMemorySoon last scheduled a return (monoclock).
var lastReturn atomic.Int64

// returnMemorySoon schedules debug.FreeOSMemory after returnDelay, unless
// one was scheduled within returnEvery.
func returnMemorySoon() {
	now, last := monoclock.Now(), lastReturn.Load()
	if last != 0 && now-last < int64(returnEvery) || !lastReturn.CompareAndSwap(last, now) {
		return
	}
	time.AfterFunc(returnDelay, debug.FreeOSMemory)
}
