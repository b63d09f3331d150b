// Package monoclock is the one clock lbx keeps its own timestamps on:
// nanoseconds since the process loaded the package, read from Go's
// monotonic clock, so that a wall-clock step never moves a deadline, an
// ejection or an estimate's age, and timestamps taken by different
// packages compare on the same scale.
package monoclock

import (
	"sync/atomic"
	"time"
)

// epoch is the clock's origin.
var epoch = time.Now()

// latest is the last reading any caller took with Now.
var latest atomic.Int64

// Now reads the clock. It also publishes the reading for Latest.
func Now() int64 {
	n := int64(time.Since(epoch))
	latest.Store(n)
	return n
}

// Latest returns the last reading any caller took with Now, without
// reading the clock. Reading the clock costs more than the rest of a
// selection on some virtual machines, while every proxied attempt reads it
// twice anyway (see lbpolicy's observingTransport), so selection uses this
// value: it lags real time by at most the gap between two round trips
// anywhere in the process, which is negligible next to the time scales it
// is compared with. Callers that may run without traffic call Now now and
// then.
func Latest() int64 { return latest.Load() }

// At returns t as a reading of the clock. A t from time.Now carries a
// monotonic reading, which At uses; other times count by the wall clock.
func At(t time.Time) int64 { return int64(t.Sub(epoch)) }
