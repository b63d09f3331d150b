package rebalance

import "time"

// rateMeter turns a counter that only grows (bytes so far) into a rate
// per second between consecutive samples. The zero value has no baseline
// yet. A rateMeter is not safe for concurrent use.
type rateMeter struct {
	last uint64
	at   time.Time
	rate float64
}

// prime sets the baseline without producing a rate, so that the first
// sample measures from now on (a config's source is primed when it is
// provisioned: a reload does not show one interval of zero).
func (m *rateMeter) prime(total uint64, now time.Time) {
	m.last, m.at = total, now
}

// sample returns the counter's rate per second since the previous sample
// (or prime). Without a baseline it returns 0 and takes this one. When no
// time has passed (two samples at the same instant) it returns the
// previous rate and keeps the baseline, so the next sample measures the
// whole time since; a counter that went backwards (a reset) restarts the
// baseline and returns 0.
func (m *rateMeter) sample(total uint64, now time.Time) float64 {
	if m.at.IsZero() {
		m.prime(total, now)
		return 0
	}
	elapsed := now.Sub(m.at)
	if elapsed <= 0 {
		return m.rate
	}
	if total < m.last {
		m.prime(total, now)
		m.rate = 0
		return 0
	}
	m.rate = float64(total-m.last) / elapsed.Seconds()
	m.last, m.at = total, now
	return m.rate
}
