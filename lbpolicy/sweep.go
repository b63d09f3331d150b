package lbpolicy

import (
	"math"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// sweeps reports whether any interval rule (success rate, failure
// percentage) is on.
func (o *Outlier) sweeps() bool {
	return !o.DisableSuccessRate || o.FailurePercentageThreshold != nil
}

// startSweeping evaluates the interval rules for table every Interval in a
// goroutine of its own, until done closes. It does nothing when no
// interval rule is on, or when a loop was already started for o.
func (o *Outlier) startSweeping(table *hoststate.Table, done <-chan struct{}) {
	if !o.sweeps() || o.sweepDone != nil {
		return
	}
	sw := newSweeper(o, table)
	o.sweepDone = make(chan struct{})
	// Validate has refused a shorter interval already; the floor here only
	// keeps a caller that skipped it from panicking in NewTicker.
	go sw.run(done, max(time.Duration(o.Interval), minOutlierInterval), o.sweepDone)
}

// sweeper applies the interval rules of outlier detection to one table
// (one handler's upstreams). It works on the attempts judged since its
// previous sweep: the counters in the shared state are cumulative, so it
// keeps its own previous reading per dial address. Only its own goroutine
// uses it.
type sweeper struct {
	o     *Outlier
	table *hoststate.Table
	prev  map[string]hoststate.Tally
}

// newSweeper returns a sweeper for table whose first interval starts now.
func newSweeper(o *Outlier, table *hoststate.Table) *sweeper {
	sw := &sweeper{o: o, table: table}
	sw.interval()
	return sw
}

// run sweeps every interval until done closes, then closes exited.
func (sw *sweeper) run(done <-chan struct{}, every time.Duration, exited chan<- struct{}) {
	defer close(exited)
	tickUntil(done, every, sw.safeSweep)
}

// tickUntil calls fn with monoclock.Now every interval until done closes:
// the loop of each background task of a policy (the outlier sweep, the
// release of upstreams no longer offered).
func tickUntil(done <-chan struct{}, every time.Duration, fn func(now int64)) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
			fn(monoclock.Now())
		}
	}
}

// safeSweep is sweep with a panic logged rather than taking down the
// process; the next tick tries again.
func (sw *sweeper) safeSweep(now int64) {
	defer func() {
		if r := recover(); r != nil {
			sw.o.logger.Error("outlier sweep panicked", zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	sw.sweep(now)
}

// hostInterval is one upstream's attempts in the last interval.
type hostInterval struct {
	s              *hoststate.Stats
	judged, failed uint64
}

// failureRatio is the share of the interval's attempts that failed.
func (h hostInterval) failureRatio() float64 { return float64(h.failed) / float64(h.judged) }

// interval returns each upstream's attempts since the previous call and
// remembers the current readings. An upstream the previous call did not
// see (new to the table) is left out: its counters may hold any amount of
// history from other configs.
func (sw *sweeper) interval() []hostInterval {
	members := sw.table.Members()
	next := make(map[string]hoststate.Tally, len(members))
	var out []hostInterval
	for _, s := range members {
		cur := s.Tally()
		next[s.Dial()] = cur
		prev, ok := sw.prev[s.Dial()]
		if !ok {
			continue
		}
		h := hostInterval{s: s}
		h.judged, h.failed = cur.Since(prev)
		out = append(out, h)
	}
	sw.prev = next
	return out
}

// candidate is an upstream that an interval rule would eject.
type candidate struct {
	h      hostInterval
	reason hoststate.EjectReason
	detail []zap.Field
}

// sweep applies the interval rules to the attempts judged since the
// previous sweep and ejects the outliers found, worst (highest failure
// ratio) first, within max_ejection_percent. It returns the dial addresses
// it ejected and those it left in because the pool was at the cap (logged
// in one line).
func (sw *sweeper) sweep(now int64) (ejected, skipped []string) {
	o := sw.o
	hosts := sw.interval()
	var cands []candidate
	if !o.DisableSuccessRate {
		cands = o.successRateOutliers(hosts)
	}
	if o.FailurePercentageThreshold != nil {
		flagged := make(map[*hoststate.Stats]bool, len(cands))
		for _, c := range cands {
			flagged[c.h.s] = true
		}
		for _, c := range o.failurePercentageOutliers(hosts) {
			if !flagged[c.h.s] { // success rate is checked first, as in Envoy
				cands = append(cands, c)
			}
		}
	}
	if len(cands) == 0 {
		return nil, nil
	}
	sort.SliceStable(cands, func(i, j int) bool {
		ri, rj := cands[i].h.failureRatio(), cands[j].h.failureRatio()
		if ri != rj {
			return ri > rj
		}
		return cands[i].h.s.Dial() < cands[j].h.s.Dial()
	})
	sw.table.LockEjections()
	n, total := sw.table.CountEjected(now)
	var reasons []string
	for _, c := range cands {
		if c.h.s.Ejected(now) {
			continue
		}
		if !o.mayEject(n, total) {
			c.h.s.NoteOverflow()
			skipped = append(skipped, c.h.s.Dial())
			reasons = append(reasons, c.reason.String())
			continue
		}
		if o.eject(c.h.s, now, c.reason, c.detail...) {
			n++
			ejected = append(ejected, c.h.s.Dial())
		}
	}
	sw.table.UnlockEjections()
	if len(skipped) > 0 {
		if ce := o.logger.Check(zap.WarnLevel, "outliers not ejected: pool at max_ejection_percent"); ce != nil {
			ce.Write(zap.Strings("upstreams", skipped), zap.Strings("reasons", reasons),
				zap.Int("ejected", n), zap.Int("pool", total),
				zap.Float64("max_ejection_percent", *o.MaxEjectionPercent))
		}
	}
	return ejected, skipped
}

// successRateOutliers returns the upstreams whose success rate in the
// interval is below mean − SuccessRateStdevFactor × σ, mean and σ (the
// population standard deviation) taken over the upstreams with at least
// SuccessRateMinRequests attempts, when there are at least
// SuccessRateMinHosts of them. Rates are percentages. Upstreams already
// ejected count toward the statistics like the others (sweep does not
// eject them again).
func (o *Outlier) successRateOutliers(hosts []hostInterval) []candidate {
	var qualified []hostInterval
	for _, h := range hosts {
		if h.judged >= uint64(o.SuccessRateMinRequests) {
			qualified = append(qualified, h)
		}
	}
	if len(qualified) == 0 || len(qualified) < o.SuccessRateMinHosts {
		return nil
	}
	rates := make([]float64, len(qualified))
	var sum float64
	for i, h := range qualified {
		rates[i] = 100 * float64(h.judged-h.failed) / float64(h.judged)
		sum += rates[i]
	}
	mean := sum / float64(len(rates))
	var sq float64
	for _, r := range rates {
		sq += (r - mean) * (r - mean)
	}
	stdev := math.Sqrt(sq / float64(len(rates)))
	// Equal rates can leave a rounding error's worth of deviation; a
	// billionth of a percentage point is no spread at all.
	if stdev < 1e-9 {
		return nil
	}
	threshold := mean - o.SuccessRateStdevFactor*stdev
	var out []candidate
	for i, h := range qualified {
		if rates[i] < threshold {
			out = append(out, candidate{h: h, reason: hoststate.ReasonSuccessRate, detail: []zap.Field{
				zap.Float64("success_rate", rates[i]), zap.Float64("pool_mean", mean),
				zap.Float64("threshold", threshold), zap.Uint64("attempts", h.judged),
			}})
		}
	}
	return out
}

// failurePercentageOutliers returns the upstreams whose failure percentage
// in the interval is above FailurePercentageThreshold, among those with at
// least FailurePercentageMinRequests attempts, when there are at least
// FailurePercentageMinHosts of them.
func (o *Outlier) failurePercentageOutliers(hosts []hostInterval) []candidate {
	var qualified []hostInterval
	for _, h := range hosts {
		if h.judged >= uint64(o.FailurePercentageMinRequests) {
			qualified = append(qualified, h)
		}
	}
	if len(qualified) == 0 || len(qualified) < o.FailurePercentageMinHosts {
		return nil
	}
	limit := *o.FailurePercentageThreshold
	var out []candidate
	for _, h := range qualified {
		if pct := 100 * float64(h.failed) / float64(h.judged); pct > limit {
			out = append(out, candidate{h: h, reason: hoststate.ReasonFailurePercentage, detail: []zap.Field{
				zap.Float64("failure_percentage", pct), zap.Float64("threshold", limit),
				zap.Uint64("attempts", h.judged),
			}})
		}
	}
	return out
}
