package hoststate

import (
	"math"
	"time"
)

// The failure ratio of a host: of its recent attempts, the share that
// failed. A failure streak (see failurePenalty) prices a host that fails
// every attempt, but a host failing one attempt in five almost never has
// a streak, and its instant failures keep its queue short, so by latency
// and load alone it looks as cheap as the best host and draws more than
// its share of traffic. The ratio is what lets selection price it.
//
// Both counts decay exponentially with time (time constant failureDecay),
// so the ratio describes the last few seconds whatever the request rate:
// a host that recovers is believed again within seconds, and memory is
// three words per host. The ratio is read as failures / (attempts +
// failurePrior): the prior, one attempt that succeeded, keeps a single
// failure from reading as a ratio of 1, and lets the ratio of a host
// nobody tries any more fade to 0 as its counts decay, instead of staying
// frozen at its last value.

// failureDecay is the time constant of the failure ratio's memory: an
// attempt counts e times less after it. A few seconds is tens to
// thousands of attempts at the rates where the ratio matters, enough to
// tell 10% from 20%, and short enough that a host that healed regains its
// share soon after.
const failureDecay = 2 * time.Second

// failurePrior is the weight, in attempts, of the success the ratio
// assumes before any is seen.
const failurePrior = 1.0

// decayOver returns how much a count keeps over elapsed ns.
func decayOver(elapsed int64) float64 {
	if elapsed <= 0 {
		return 1
	}
	return math.Exp(-float64(elapsed) / float64(failureDecay))
}

// weigh counts one finished attempt, failed or not, at now in the failure
// ratio. s.mu must be held: the counts are read, decayed and written as
// one step.
func (s *Stats) weigh(now int64, failed bool) {
	d := decayOver(now - s.weighedNs.Load())
	a := math.Float64frombits(s.attemptsW.Load())*d + 1
	f := math.Float64frombits(s.failedW.Load()) * d
	if failed {
		f++
	}
	s.attemptsW.Store(math.Float64bits(a))
	s.failedW.Store(math.Float64bits(f))
	if now > s.weighedNs.Load() {
		s.weighedNs.Store(now)
	}
}

// FailureRatio returns the recent, time-decayed share of the host's
// finished attempts that failed (transport errors, timeouts and failure
// statuses; attempts the client abandoned do not count), from 0 to 1.
// It is 0 for a host that never failed or has not failed for many
// seconds. It takes no lock: a read racing an update may mix old and new
// counts for an instant, which the clamp keeps within 0..1.
func (s *Stats) FailureRatio(now int64) float64 {
	f := math.Float64frombits(s.failedW.Load())
	if f <= 0 {
		return 0
	}
	a := math.Float64frombits(s.attemptsW.Load())
	d := decayOver(now - s.weighedNs.Load())
	return min(f*d/(a*d+failurePrior), 1)
}

// maxPricedFailureRatio caps the ratio FailurePrice reads, so that the
// price stays finite (at most 100): a host failing more than this is left
// to the failure streak, to outlier ejection and to Caddy's health checks.
const maxPricedFailureRatio = 0.9

// FailurePrice returns the factor by which selection multiplies the cost
// of one more request to the host for its recent failures:
// 1 / (1 − f)², f being FailureRatio (capped at maxPricedFailureRatio).
//
// Why this form. A host that fails a share f of its attempts delivers
// 1 − f answers per attempt, and its instant failures also let it take
// attempts faster than a healthy host of its speed, by about 1 / (1 − f)
// when failures cost it nothing. A least-loaded rule hands out attempts
// in proportion to how fast a host takes them at equal queues, so charging
// its queue once for each effect — (1 − f)⁻¹ twice — brings its share of
// attempts down to its success-weighted share: what it would get if
// healthy, times 1 − f. A host that never fails pays 1, so nothing
// changes for it. (Envoy's client-side weighted round robin lowers a
// host's weight by errors per query in the same spirit; Finagle's failure
// accrual instead removes a host after a run of failures, which the
// failure streak and outlier ejection already do here.)
func (s *Stats) FailurePrice(now int64) float64 {
	return priceOf(s.FailureRatio(now))
}

// priceOf is FailurePrice for a failure ratio f.
func priceOf(f float64) float64 {
	if f <= 0 {
		return 1
	}
	ok := 1 - min(f, maxPricedFailureRatio)
	return 1 / (ok * ok)
}

// The share cap. The price above works by shortening a failing host's
// queue, which lowers its share only while its queue empties now and
// then. When every host is saturated (a closed loop of clients keeps
// them all busy) its queue never empties, so it serves at its own pace,
// and its instant failures let it take more attempts than a healthy host
// of its speed (issue 24's partialfail class: 53% of the attempts where
// its success-weighted share is 43%). So a failing host is also held to
// a rate: at most shareCapMargin × (1 − f) times the attempts per unit of
// weight of the busiest host that is not failing. (1 − f) alone would
// hold it at its success-weighted share exactly, but a rate read with lag
// and noise sits above its cap about half the time; the margin keeps it
// below. A stricter cap, (1 − f)² as the price is, measured no better at
// 10% failures and cost half the throughput at 50% (the host's good
// answers are capacity too, and with retries its failures cost little).
// The rate is the decayed attempt count the failure ratio divides by, so
// the cap costs no more state per host.

// shareCapMargin is the fraction of its success-weighted share a failing
// host is held to under the share cap.
const shareCapMargin = 0.9

// healthyFailureRatio is the failure ratio under which a host is not
// failing: its rate is a reference for the cap, and it is not capped.
const healthyFailureRatio = 0.01

// Attempts returns the host's recent finished attempts, each counting
// e times less for every failureDecay since it finished: in a steady
// state, its attempt rate times failureDecay.
func (s *Stats) Attempts(now int64) float64 {
	return math.Float64frombits(s.attemptsW.Load()) * decayOver(now-s.weighedNs.Load())
}

// ShareReference returns what OverShare compares with: the most recent
// attempts per unit of weight among the n hosts that are not failing
// (host returns host i and the inverse of its weight), or 0 when every
// host is failing, so that none is capped: the price alone then sets
// their shares.
func ShareReference(now int64, n int, host func(i int) (s *Stats, invWeight float64)) float64 {
	top := 0.0
	for i := range n {
		s, inv := host(i)
		if s.FailureRatio(now) < healthyFailureRatio {
			top = max(top, s.Attempts(now)*inv)
		}
	}
	return top
}

// OverShare reports whether s, of inverse weight invWeight, is a failing
// host that has taken more than its share of attempts: more than
// shareCapMargin × (1 − f) times the reference per unit of weight, f
// being its failure ratio (capped as in FailurePrice) and the reference
// ShareReference's, which is asked for only when s is failing. A rested host (see Table.rested)
// is never over, as it pays no price either.
func (t *Table) OverShare(s *Stats, now int64, invWeight float64, reference func() float64) bool {
	return !t.rested(s, now) && s.overShare(now, s.FailureRatio(now), invWeight, reference)
}

// overShare is OverShare for a host that is not rested, of failure ratio f.
func (s *Stats) overShare(now int64, f, invWeight float64, reference func() float64) bool {
	if f < healthyFailureRatio {
		return false
	}
	ref := reference()
	return ref > 0 && s.Attempts(now)*invWeight > shareCapMargin*(1-min(f, maxPricedFailureRatio))*ref
}
