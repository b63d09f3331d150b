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
// sampled rarely moves further per sample than one sampled often — but by
// at least minBlend, so that one slow answer (a GC pause, a stall of the
// proxy itself, which hits every upstream at once) is forgotten after a few
// dozen normal answers instead of tens of seconds. All values are
// nanoseconds.
func nextEstimate(est, sample, dt, tau float64) float64 {
	if est <= 0 || sample >= est {
		return sample
	}
	w := max(1-expNeg(max(dt, 0)/tau), minBlend)
	return est + (sample-est)*w
}

// minBlend is the least weight a faster sample gets. A busy upstream
// answering 300 times a second recovers from a 40× spike in about a quarter
// of a second; a degraded one keeps producing slow answers, each of which
// raises its estimate again at once.
const minBlend = 1.0 / 16

// decayToward returns the estimate as seen x = dt/tau time constants after
// its last update: it relaxes toward target (the pool's typical latency).
// Decaying toward the pool rather than toward zero means a host that was
// slow and then left alone is eventually tried again, yet an idle host never
// looks faster than the hosts that are really serving.
func decayToward(est, target, x float64) float64 {
	if x <= 0 || target <= 0 {
		return est
	}
	return target + (est-target)*expNeg(x)
}

// expNeg returns exp(-x) for x ≥ 0 to within a relative error of 5e-6,
// several times faster than math.Exp: selection decays every candidate's
// estimate on every request. Almost always x is tiny (the host was updated
// moments ago) and a short series is exact to 1e-6; otherwise exp(-x) =
// 2^-n · exp(-f·ln2), with the second factor from a degree-7 series on
// [0, ln2).
func expNeg(x float64) float64 {
	switch {
	case x < 1.0/64:
		return 1 - x + x*x/2
	case x > 700:
		return 0
	}
	y := x * math.Log2E
	n := math.Floor(y)
	t := (y - n) * math.Ln2
	// Horner form of Σ (-t)^k/k! for k = 0..7
	p := 1 + t*(-1+t*(1.0/2+t*(-1.0/6+t*(1.0/24+t*(-1.0/120+t*(1.0/720+t*(-1.0/5040)))))))
	return p * math.Float64frombits(uint64(1023-int64(n))<<52)
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
