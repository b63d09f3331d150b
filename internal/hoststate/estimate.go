// Package hoststate keeps what lbx knows about each upstream, keyed by its
// dial address: a robust latency estimate, the state of its attempts in
// flight, and outcome counters. The state is shared by every handler that
// proxies to the same address and survives config reloads; handlers reach
// it through a Table.
package hoststate

// The estimator's arithmetic is kept pure (times are passed in) so it can be
// tested exactly; Stats applies it under its own lock.
//
// What it estimates, and why so. A selection policy multiplies the latency
// estimate by the requests in flight (see lbpolicy), so the estimate must
// say how fast the host serves, not how long its queue is: the in-flight
// count already says that, and a queue-inflated latency counts the load
// twice and starves a slower host that is idle. It must also not believe
// one bad moment: the answers a stall held back all arrive together after
// the stall, when the host is fine again. So the estimate is the median of
// the host's last windowSize answers within a horizon — a burst of stalled
// answers is outvoted, a persistently slow host moves the median within a
// few answers — and what happens right now (a stall in progress, a run of
// failures) is judged from the live state at selection time, not from
// samples that arrive too late (see Table.Expected).

// windowSize is how many recent answers the median is taken over: enough
// that the few answers one stall holds back are outvoted, few enough that a
// host that really became slow is believed after a handful of answers.
const windowSize = 16

// sample is one answer: when it arrived and how long it took, in ns.
type sample struct{ at, ns int64 }

// window holds a host's most recent answers, oldest overwritten first.
type window struct {
	s    [windowSize]sample
	next int // where the next sample goes
	n    int // how many slots hold samples
}

// add records an answer of ns nanoseconds that arrived at at.
func (w *window) add(at, ns int64) {
	w.s[w.next] = sample{at, ns}
	w.next = (w.next + 1) % windowSize
	w.n = min(w.n+1, windowSize)
}

// reset forgets every answer.
func (w *window) reset() { *w = window{} }

// median returns the median of the answers that arrived after since, or 0
// if there is none. Answers older than the horizon describe a host that may
// have changed since; when a host answers again after a quiet spell, its
// new answers alone speak for it.
func (w *window) median(since int64) int64 {
	var v [windowSize]int64
	k := 0
	for i := range w.n {
		if s := w.s[i]; s.at > since {
			// insertion sort: at most windowSize values
			j := k
			for ; j > 0 && v[j-1] > s.ns; j-- {
				v[j] = v[j-1]
			}
			v[j] = s.ns
			k++
		}
	}
	switch {
	case k == 0:
		return 0
	case k%2 == 1:
		return v[k/2]
	default:
		return (v[k/2-1] + v[k/2]) / 2
	}
}

// maxFailureDoublings caps the failure penalty (see failurePenalty) at
// 2^10: a host that failed ten times in a row is priced out of any pool,
// and the cap keeps the arithmetic finite.
const maxFailureDoublings = 10

// failurePenalty is the factor by which failed attempts in a row multiply a
// host's expected latency: each one doubles it. A failure that answers at
// once (503 from a black hole, a reset) must make a host look worse, never
// faster, and a host failing every attempt is soon priced out entirely;
// one success clears the streak.
func failurePenalty(streak int64) float64 {
	if streak <= 0 {
		return 1
	}
	return float64(uint64(1) << min(streak, maxFailureDoublings))
}

// stalledFor returns how long a host with attempts in flight has gone
// without finishing any, at now: the time since the later of its last
// finished attempt and the moment it last became busy; 0 when it has
// nothing in flight.
func stalledFor(now, lastDone, busySince, pending int64) int64 {
	if pending <= 0 {
		return 0
	}
	return max(now-max(lastDone, busySince), 0)
}
