package loadmodel

import (
	"math"
	"slices"
	"time"
)

// Summary condenses the samples of a Result.
type Summary struct {
	// Requests is the number of measured requests.
	Requests int `json:"requests"`
	// OK is the number answered 200.
	OK int `json:"ok"`
	// Errors is the number not answered 200: bad statuses, timeouts and
	// transport failures.
	Errors int `json:"errors"`
	// Timeouts is the part of Errors that timed out.
	Timeouts int `json:"timeouts"`
	// Throughput is OK divided by the time from the start of the measured
	// window to the completion of its last successful request (or by the
	// window, if that is longer), in requests per second.
	Throughput float64 `json:"throughput"`
	// P50, P99, P999 and Max are exact latency quantiles over every
	// measured request, failures included at the latency they had.
	P50  time.Duration `json:"p50_ns"`
	P99  time.Duration `json:"p99_ns"`
	P999 time.Duration `json:"p999_ns"`
	Max  time.Duration `json:"max_ns"`
	// AnsweredP50 is the median latency of the requests answered 200: where
	// failures are instant, they lower P50 without anyone being served
	// faster.
	AnsweredP50 time.Duration `json:"answered_p50_ns"`
	// ByBackend counts the 200 responses by the backend that sent them.
	ByBackend map[string]int `json:"by_backend"`
}

// Summarize computes the summary of r.
func Summarize(r *Result) Summary {
	s := Summary{Requests: len(r.Samples), ByBackend: map[string]int{}}
	lat := make([]time.Duration, 0, len(r.Samples))
	var answered []time.Duration
	var lastOK time.Duration
	for _, x := range r.Samples {
		lat = append(lat, x.Latency)
		if x.Outcome == OK {
			answered = append(answered, x.Latency)
		}
		if x.Outcome != OK {
			s.Errors++
			if x.Outcome == Timeout {
				s.Timeouts++
			}
			continue
		}
		s.OK++
		s.ByBackend[x.Backend]++
		lastOK = max(lastOK, x.Done)
	}
	slices.Sort(lat)
	slices.Sort(answered)
	s.AnsweredP50 = Quantile(answered, 0.50)
	s.P50 = Quantile(lat, 0.50)
	s.P99 = Quantile(lat, 0.99)
	s.P999 = Quantile(lat, 0.999)
	if len(lat) > 0 {
		s.Max = lat[len(lat)-1]
	}
	if span := max(lastOK, r.Window); span > 0 {
		s.Throughput = float64(s.OK) / span.Seconds()
	}
	return s
}

// Between returns the part of r whose requests were due in [from, to) of
// the measured window, with times relative to from, for a summary of part
// of a window (a load step, say).
func (r *Result) Between(from, to time.Duration) *Result {
	out := &Result{Window: to - from, MaxSendLag: r.MaxSendLag}
	for _, s := range r.Samples {
		if s.Due >= from && s.Due < to {
			s.Due -= from
			s.Done -= from
			out.Samples = append(out.Samples, s)
		}
	}
	return out
}

// Quantile returns the q-quantile (0 < q ≤ 1) of sorted by the
// nearest-rank method: the smallest sample such that at least a fraction q
// of the samples are at or below it. It returns 0 for no samples.
func Quantile(sorted []time.Duration, q float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	// The small epsilon keeps 0.99 × 1000 (990.0000000000001 in floating
	// point) at rank 990.
	rank := int(math.Ceil(q*float64(n) - 1e-9))
	return sorted[min(max(rank, 1), n)-1]
}
