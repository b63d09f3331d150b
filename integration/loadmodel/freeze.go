package loadmodel

import (
	"errors"
	"time"
)

// Freeze describes a backend's stalls: moments when it stops serving
// altogether, as a process does in a long GC pause, a page-cache miss
// storm or a noisy neighbour's burst.
//
// Time is cut into periods of length Every, counted from the backend's
// epoch. Period k holds exactly one freeze, whose length is drawn from
// [Min, Max] and whose start is drawn so that the whole freeze lies inside
// the period. Both draws come from a hash of Seed and k, so the schedule is
// a pure function of time since the epoch: every case of a benchmark that
// resets the epoch at its start sees the very same stalls.
//
// The zero Freeze never stalls.
type Freeze struct {
	// Every is the length of a period, and so the mean time between the
	// starts of two freezes. Zero disables freezes.
	Every time.Duration `json:"every_ns"`
	// Min and Max bound the length of a freeze. Max is capped at Every.
	Min time.Duration `json:"min_ns"`
	Max time.Duration `json:"max_ns"`
	// Seed selects the schedule.
	Seed uint64 `json:"seed"`
}

// validate checks the schedule's bounds.
func (f Freeze) validate() error {
	if f.Every < 0 || f.Min < 0 || f.Max < f.Min {
		return errors.New("freeze needs 0 ≤ min ≤ max and every ≥ 0")
	}
	return nil
}

// Enabled reports whether the schedule has any freezes.
func (f Freeze) Enabled() bool { return f.Every > 0 && f.Max > 0 }

// Window returns the start and end, relative to the epoch, of the freeze
// in period k (k ≥ 0).
func (f Freeze) Window(k int64) (start, end time.Duration) {
	maxLen := min(f.Max, f.Every)
	minLen := min(max(f.Min, 0), maxLen)
	h1 := splitmix64(f.Seed ^ uint64(k)*0x9e3779b97f4a7c15)
	h2 := splitmix64(h1)
	length := minLen + time.Duration(unitFloat(h1)*float64(maxLen-minLen))
	offset := time.Duration(unitFloat(h2) * float64(f.Every-length))
	start = time.Duration(k)*f.Every + offset
	return start, start + length
}

// Thaw returns the first instant at or after t (relative to the epoch) at
// which the backend is not frozen: t itself, or the end of the freeze that
// covers t. Instants before the epoch are never frozen.
func (f Freeze) Thaw(t time.Duration) time.Duration {
	if !f.Enabled() || t < 0 {
		return t
	}
	start, end := f.Window(int64(t / f.Every))
	if t >= start && t < end {
		return end
	}
	return t
}

// Frozen returns the total frozen time in [0, d) since the epoch.
func (f Freeze) Frozen(d time.Duration) time.Duration {
	if !f.Enabled() || d <= 0 {
		return 0
	}
	var total time.Duration
	for k := int64(0); k <= int64(d/f.Every); k++ {
		start, end := f.Window(k)
		total += max(0, min(end, d)-start)
	}
	return total
}

// splitmix64 is the SplitMix64 finaliser: a fast, well-mixed hash of x.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// unitFloat maps a hash to [0, 1).
func unitFloat(h uint64) float64 { return float64(h>>11) / (1 << 53) }
