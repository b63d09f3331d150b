// Package hoststate keeps what lbx knows about each upstream, keyed by its
// dial address: a peak-sensitive latency estimate and outcome counters. The
// state is shared by every handler that proxies to the same address and
// survives config reloads; handlers reach it through a Table.
package hoststate

import "math"

// The estimator's arithmetic is kept pure (times are passed in) so it can be
// tested exactly; Stats applies it under its own lock.

// nextEstimate folds one latency sample into a peak-sensitive EWMA. A sample
// slower than the current estimate replaces it at once, so a host that
// degrades is noticed on its first slow answer. A faster sample blends in
// with weight 1-exp(-dt/tau), so recovery is believed gradually, and a host
// sampled rarely moves further per sample than one sampled often. All values
// are nanoseconds.
func nextEstimate(est, sample, dt, tau float64) float64 {
	if est <= 0 || sample >= est {
		return sample
	}
	w := math.Exp(-math.Max(dt, 0) / tau)
	return est*w + sample*(1-w)
}

// decayToward returns the estimate as seen dt after its last update: it
// relaxes toward target (the pool's typical latency) with time constant tau.
// Decaying toward the pool rather than toward zero means a host that was
// slow and then left alone is eventually tried again, yet an idle host never
// looks faster than the hosts that are really serving.
func decayToward(est, target, dt, tau float64) float64 {
	if dt <= 0 || target <= 0 {
		return est
	}
	return target + (est-target)*expNeg(dt/tau)
}

// expNeg returns exp(-x) for x ≥ 0. Selection decays every candidate's
// estimate, almost always by a tiny x (the host was updated moments ago),
// where a short series is exact to 1e-6 and much cheaper than math.Exp.
func expNeg(x float64) float64 {
	if x < 1.0/64 {
		return 1 - x + x*x/2
	}
	return math.Exp(-x)
}

// failureSample is the latency charged for a failed attempt (transport
// error, timeout). A connection refused in 100µs must not make a host look
// fast, so the sample is at least twice the current estimate, and never less
// than the time the attempt really took. The penalty part is capped so a
// host that failed for a while can recover in bounded time.
func failureSample(elapsed, est, maxPenalty float64) float64 {
	p := math.Min(2*est, maxPenalty)
	return math.Max(elapsed, p)
}
