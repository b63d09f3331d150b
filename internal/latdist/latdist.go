// Package latdist keeps a recent latency distribution in a small,
// fixed-size histogram, for delays that should follow what a backend
// actually does (selective's backup_request auto).
//
// The histogram has logarithmic buckets, eight per doubling (each about
// 9% wide), from 16µs to about 137s: a quantile read from it is at most
// one bucket, 9%, above the true one, whatever the scale, in a few
// kilobytes. Recording is lock-free (one atomic add). Old answers are
// forgotten by two windows that take turns: a reading covers the current
// window and the one before, so it spans between one and two periods of
// recent answers, and a change in the backend shows within two periods.
package latdist

import (
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

const (
	subBits    = 3 // 2^subBits buckets per doubling
	subBuckets = 1 << subBits
	minExp     = 14 // latencies below 2^14 ns (16µs) share the first bucket
	maxExp     = 36 // the last doubling counted starts at 2^36 ns (about 69s)
	// numBuckets: the first bucket, one per sub-bucket of each doubling
	// from minExp to maxExp, and one for everything longer.
	numBuckets = 1 + (maxExp-minExp+1)*subBuckets + 1
)

// Dist is a recent latency distribution. The zero value is not usable:
// make one with New.
type Dist struct {
	period int64 // ns a window lasts

	mu       sync.Mutex // serialises turning the windows
	cur      atomic.Int32
	rotateAt atomic.Int64 // when the current window ends (the caller's clock)
	counts   [2][numBuckets]atomic.Uint64
}

// New returns an empty distribution whose windows last period each.
func New(period time.Duration) *Dist {
	return &Dist{period: max(int64(period), 1)}
}

// index returns the bucket a latency of ns falls in.
func index(ns int64) int {
	if ns < 1<<minExp {
		return 0
	}
	e := bits.Len64(uint64(ns)) - 1
	if e > maxExp {
		return numBuckets - 1
	}
	sub := int(ns>>(e-subBits)) & (subBuckets - 1)
	return 1 + (e-minExp)*subBuckets + sub
}

// upper returns the upper edge of bucket i, in ns: a latency read from
// the histogram is never below the one recorded.
func upper(i int) int64 {
	if i == 0 {
		return 1 << minExp
	}
	if i >= numBuckets-1 {
		return math.MaxInt64
	}
	i--
	e := minExp + i/subBuckets
	sub := int64(i%subBuckets) + 1
	return 1<<e + sub<<(e-subBits)
}

// Observe records a latency of ns, at now (any monotonic clock in ns, the
// same for every call).
func (d *Dist) Observe(now, ns int64) {
	d.turn(now)
	d.counts[d.cur.Load()][index(max(ns, 0))].Add(1)
}

// turn starts a new window when the current one has ended, forgetting
// the oldest; after two periods without a turn, both are forgotten.
func (d *Dist) turn(now int64) {
	if now < d.rotateAt.Load() {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	at := d.rotateAt.Load()
	if now < at {
		return
	}
	next := 1 - d.cur.Load()
	clear := func(w int32) {
		for i := range d.counts[w] {
			d.counts[w][i].Store(0)
		}
	}
	clear(next)
	if at != 0 && now >= at+d.period {
		clear(1 - next) // the current window is older than a period too
	}
	d.cur.Store(next)
	d.rotateAt.Store(now + d.period)
}

// Quantile returns the latency in ns below which a fraction q (0 to 1)
// of the recent answers fall, read at a bucket's upper edge, and how many
// answers it was read from. With no answers it returns 0, 0.
func (d *Dist) Quantile(now int64, q float64) (ns int64, n uint64) {
	d.turn(now)
	var sum [numBuckets]uint64
	for w := range d.counts {
		for i := range d.counts[w] {
			c := d.counts[w][i].Load()
			sum[i] += c
			n += c
		}
	}
	if n == 0 {
		return 0, 0
	}
	rank := uint64(math.Ceil(min(max(q, 0), 1) * float64(n)))
	rank = max(rank, 1)
	var seen uint64
	for i, c := range sum {
		seen += c
		if seen >= rank {
			return upper(i), n
		}
	}
	return upper(numBuckets - 1), n
}
