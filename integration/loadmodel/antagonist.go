package loadmodel

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
)

// Antagonist is an outside client that loads one backend directly, past
// the proxies, in bursts: open loop at Rate while on, silent while off,
// the lengths of the on and off periods drawn from a seed. It models a
// noisy neighbour or another service's traffic, which a proxy cannot see
// in its own requests in flight.
//
// Its requests carry PhaseHeader "other", so a backend counts them apart
// from the proxied load (Counters(PhaseOther)); they do take workers, so
// they show in the backend's queue, its load reports and BusyTime.
type Antagonist struct {
	// URL is the backend's URL.
	URL string
	// Rate is the load while on, in requests per second; more than 0.
	Rate float64
	// OnMin and OnMax bound the length of a burst; 0 < OnMin ≤ OnMax.
	OnMin, OnMax time.Duration
	// OffMin and OffMax bound the pause between bursts; 0 ≤ OffMin ≤
	// OffMax.
	OffMin, OffMax time.Duration
	// Seed selects the schedule: the same seed gives the same bursts.
	Seed uint64
	// Timeout bounds each request. Default: 2s.
	Timeout time.Duration
}

// Burst is one period of an Antagonist's load, [Start, End) from the start
// of its run.
type Burst struct {
	Start time.Duration `json:"start_ns"`
	End   time.Duration `json:"end_ns"`
}

// Validate checks the antagonist's settings.
func (a Antagonist) Validate() error {
	switch {
	case a.URL == "":
		return errors.New("antagonist: no URL")
	case !(a.Rate > 0) || math.IsInf(a.Rate, 0):
		return fmt.Errorf("antagonist: rate must be positive, got %v", a.Rate)
	case a.OnMin <= 0 || a.OnMax < a.OnMin:
		return fmt.Errorf("antagonist: bursts need 0 < min ≤ max, got %v–%v", a.OnMin, a.OnMax)
	case a.OffMin < 0 || a.OffMax < a.OffMin:
		return fmt.Errorf("antagonist: pauses need 0 ≤ min ≤ max, got %v–%v", a.OffMin, a.OffMax)
	case a.Timeout < 0:
		return fmt.Errorf("antagonist: negative timeout %v", a.Timeout)
	}
	return nil
}

// Schedule returns the bursts that begin before horizon, the last one cut
// at horizon. The run begins with a pause drawn from [0, OffMax], so that
// seeds differ in phase too; then bursts and pauses alternate, each length
// uniform in its bounds. It is a pure function of the settings: at most
// horizon ÷ OnMin + 1 bursts, each within its bounds unless cut.
func (a Antagonist) Schedule(horizon time.Duration) []Burst {
	if a.Validate() != nil || horizon <= 0 {
		return nil
	}
	draw := func(k uint64, lo, hi time.Duration) time.Duration {
		u := unitFloat(splitmix64(a.Seed ^ 0x3c6ef372fe94f82b ^ k*0x9e3779b97f4a7c15))
		return lo + time.Duration(u*float64(hi-lo))
	}
	var out []Burst
	t := draw(0, 0, a.OffMax)
	for k := uint64(1); t < horizon; k += 2 {
		end := min(t+draw(k, a.OnMin, a.OnMax), horizon)
		out = append(out, Burst{Start: t, End: end})
		t = end + draw(k+1, a.OffMin, a.OffMax)
	}
	return out
}

// OnTime returns the total length of bursts.
func OnTime(bursts []Burst) time.Duration {
	var d time.Duration
	for _, b := range bursts {
		d += b.End - b.Start
	}
	return d
}

// AntagonistResult is what an antagonist sent and how it fared.
type AntagonistResult struct {
	// Bursts is the schedule it ran.
	Bursts []Burst `json:"bursts"`
	// Sent, OK and Errors count its requests (Errors: not answered 200,
	// timeouts included).
	Sent   int `json:"sent"`
	OK     int `json:"ok"`
	Errors int `json:"errors"`
	// P50 and P99 are its requests' latencies, from their due times.
	P50 time.Duration `json:"p50_ns"`
	P99 time.Duration `json:"p99_ns"`
}

// Run sends the antagonist's load for horizon from now, by Schedule, and
// returns once every request it sent has finished. If ctx is cancelled it
// stops sending and returns what it has, with ctx's error.
func (a Antagonist) Run(ctx context.Context, horizon time.Duration) (AntagonistResult, error) {
	if err := a.Validate(); err != nil {
		return AntagonistResult{}, err
	}
	timeout := a.Timeout
	if timeout == 0 {
		timeout = 2 * time.Second
	}
	client := NewClient(timeout)
	defer client.CloseIdleConnections()
	res := AntagonistResult{Bursts: a.Schedule(horizon)}
	l := Load{URL: a.URL}
	var (
		mu  sync.Mutex
		lat []time.Duration
		wg  sync.WaitGroup
	)
	record := func(s Sample) {
		mu.Lock()
		defer mu.Unlock()
		lat = append(lat, s.Latency)
		if s.Outcome == OK {
			res.OK++
		} else {
			res.Errors++
		}
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	t0 := time.Now()
	interval := time.Duration(float64(time.Second) / a.Rate)
	send := func(due time.Time) {
		res.Sent++
		wg.Go(func() { record(l.send(ctx, client, timeout, l.URL, PhaseOther, due, time.Time{})) })
	}
	sleepUntil := func(due time.Time) bool {
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
			case <-timer.C:
			}
		}
		return ctx.Err() == nil
	}
loop:
	for _, b := range res.Bursts {
		for off := b.Start; off < b.End; off += interval {
			due := t0.Add(off)
			if !sleepUntil(due) {
				break loop
			}
			send(due)
		}
	}
	wg.Wait()
	slices.Sort(lat)
	res.P50, res.P99 = Quantile(lat, 0.5), Quantile(lat, 0.99)
	return res, ctx.Err()
}
