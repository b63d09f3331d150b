package loadmodel

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Load is an open-loop load of GET requests to one URL, at a constant rate
// or by a schedule of rate steps.
//
// Request i (counting from 0) is due at start + i/Rate. A single dispatcher
// sleeps until each due time and hands the request to its own goroutine, so
// a slow response never delays the requests after it; when the dispatcher
// itself wakes late it sends every overdue request at once. The first
// Rate × Warmup requests are warm-up (sent with PhaseHeader "warmup", not
// recorded), the next Rate × Duration are measured (PhaseHeader
// "measure"). With Steps, the measured window is cut into segments at the
// steps' times, and each segment of length d at rate r holds r × d
// requests, evenly spaced from its start.
//
// A request's latency runs from its due time to the end of its response
// body. A request not answered within Timeout of being sent is abandoned
// and recorded as a timeout with the latency it had reached (at least
// Timeout), so it weighs in the percentiles with its full duration.
type Load struct {
	// URL is the target.
	URL string
	// Path, if set, varies the target per request: the n-th request sent
	// (counting from 0, warm-up included) goes to URL with its trailing
	// slash replaced by Path(n), which starts with a slash. Requests of a
	// closed loop are numbered in the order they are sent, so a Path that
	// is a pure function of n gives every run the same sequence of
	// targets (a key stream) whatever the timing.
	Path func(n uint64) string
	// Rate is the number of requests per second; more than 0.
	Rate float64
	// Warmup is how long warm-up traffic runs before measuring; ≥ 0.
	Warmup time.Duration
	// Duration is the length of the measured window; more than 0.
	Duration time.Duration
	// Timeout bounds each request, from its send time. Default: 2s.
	Timeout time.Duration
	// Client sends the requests. Default: a client of its own with a
	// large idle-connection pool, closed when Run returns.
	Client *http.Client
	// OnMeasure, if set, is called by the dispatcher just before it sends
	// the first measured request (e.g. to sample a process's CPU time).
	OnMeasure func()
	// Steps, if any, change the rate during the measured window: from
	// each step's At (relative to the start of the measured window) on,
	// requests are sent at the step's Rate. The warm-up and the window
	// up to the first step run at Rate. Steps must be in increasing
	// order of At, within (0, Duration).
	Steps []Step
	// Concurrency, if more than 0, makes the load a closed loop instead:
	// that many clients each send a request as soon as their previous one
	// finished, through the warm-up and the measured window, and Rate and
	// Steps are ignored. A request's latency then runs from its send
	// time. Fast failures come back at once and draw the next request
	// sooner, as with real clients that keep a fixed number in flight.
	Concurrency int
}

// Step is a change of the load's rate at a time in the measured window.
type Step struct {
	// At is when the step begins, relative to the start of the measured
	// window.
	At time.Duration `json:"at_ns"`
	// Rate is the rate from At on, in requests per second; more than 0.
	Rate float64 `json:"rate"`
}

// RateAt returns the rate the load sends at, at time t of the measured
// window.
func (l Load) RateAt(t time.Duration) float64 {
	r := l.Rate
	for _, s := range l.Steps {
		if t >= s.At {
			r = s.Rate
		}
	}
	return r
}

// Outcome classifies a request's fate.
type Outcome uint8

// The outcomes of a request.
const (
	// OK is a 200 response, read in full.
	OK Outcome = iota
	// BadStatus is any other response.
	BadStatus
	// Timeout is a request abandoned after Load.Timeout.
	Timeout
	// Failed is a transport error (refused or reset connection, …).
	Failed
)

// String names the outcome.
func (o Outcome) String() string {
	switch o {
	case OK:
		return "ok"
	case BadStatus:
		return "bad status"
	case Timeout:
		return "timeout"
	default:
		return "failed"
	}
}

// Sample is the record of one measured request.
type Sample struct {
	// Latency runs from the request's due time to the end of its
	// response, or to its failure.
	Latency time.Duration
	// Due is when the request was due, relative to the start of the
	// measured window.
	Due time.Duration
	// Done is when the request finished, relative to the start of the
	// measured window.
	Done time.Duration
	// Outcome is the request's fate.
	Outcome Outcome
	// Backend is the value of BackendHeader in the response, if any.
	Backend string
}

// Result is the record of a Load run.
type Result struct {
	// Samples has one entry per measured request, in due order.
	Samples []Sample
	// Window is the length of the measured window (Load.Duration).
	Window time.Duration
	// MaxSendLag is the largest delay between a measured request's due
	// time and the moment the dispatcher handed it off. A large value
	// means the load generator itself was starved of CPU.
	MaxSendLag time.Duration
}

// Validate checks the load's settings.
func (l Load) Validate() error {
	switch {
	case l.URL == "":
		return errors.New("load: no URL")
	case l.Concurrency < 0:
		return fmt.Errorf("load: negative concurrency %d", l.Concurrency)
	case l.Concurrency == 0 && !(l.Rate > 0):
		return fmt.Errorf("load: rate must be positive, got %v", l.Rate)
	case l.Warmup < 0:
		return fmt.Errorf("load: negative warm-up %v", l.Warmup)
	case l.Duration <= 0:
		return fmt.Errorf("load: duration must be positive, got %v", l.Duration)
	case l.Timeout < 0:
		return fmt.Errorf("load: negative timeout %v", l.Timeout)
	}
	prev := time.Duration(0)
	for i, s := range l.Steps {
		switch {
		case s.At <= prev:
			return fmt.Errorf("load: step %d at %v is not after %v", i+1, s.At, prev)
		case s.At >= l.Duration:
			return fmt.Errorf("load: step %d at %v is not inside the measured window of %v", i+1, s.At, l.Duration)
		case !(s.Rate > 0):
			return fmt.Errorf("load: step %d: rate must be positive, got %v", i+1, s.Rate)
		}
		prev = s.At
	}
	return nil
}

// schedule returns the due times of every request relative to the start
// of the load, and how many of the first are warm-up.
func (l Load) schedule() (due []time.Duration, nWarm int) {
	interval := float64(time.Second) / l.Rate
	nWarm = int(l.Rate * l.Warmup.Seconds())
	if len(l.Steps) == 0 {
		n := nWarm + max(1, int(l.Rate*l.Duration.Seconds()))
		due = make([]time.Duration, n)
		for i := range due {
			due[i] = time.Duration(float64(i) * interval)
		}
		return due, nWarm
	}
	due = make([]time.Duration, 0, nWarm+int(l.Rate*l.Duration.Seconds())*2)
	for i := range nWarm {
		due = append(due, time.Duration(float64(i)*interval))
	}
	measureStart := time.Duration(float64(nWarm) * interval)
	from, rate := time.Duration(0), l.Rate
	for i := 0; i <= len(l.Steps); i++ {
		to := l.Duration
		if i < len(l.Steps) {
			to = l.Steps[i].At
		}
		n := int(rate * (to - from).Seconds())
		for j := range n {
			due = append(due, measureStart+from+time.Duration(float64(j)*float64(time.Second)/rate))
		}
		if i < len(l.Steps) {
			from, rate = l.Steps[i].At, l.Steps[i].Rate
		}
	}
	if len(due) == nWarm { // a measured window too short for any request
		due = append(due, measureStart)
	}
	return due, nWarm
}

// NewClient returns an HTTP/1.1 client suited to load generation on
// loopback: no proxy from the environment, no compression, and an idle
// pool large enough that a burst never forces connections to be closed
// and re-dialled. Close its idle connections when done.
func NewClient(timeout time.Duration) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:         (&net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        0, // no overall limit
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}}
}

// Run sends the load and returns once every request it sent has finished.
// If ctx is cancelled, no more requests are sent, those in flight are
// abandoned, and Run returns ctx's error.
func (l Load) Run(ctx context.Context) (*Result, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	timeout := l.Timeout
	if timeout == 0 {
		timeout = 2 * time.Second
	}
	client := l.Client
	if client == nil {
		client = NewClient(timeout)
		defer client.CloseIdleConnections()
	}

	if l.Concurrency > 0 {
		return l.runClosed(ctx, client, timeout)
	}
	offsets, nWarm := l.schedule()
	res := &Result{Samples: make([]Sample, len(offsets)-nWarm), Window: l.Duration}

	var wg sync.WaitGroup
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C

	t0 := time.Now()
	var measureStart time.Time
	for i, off := range offsets {
		due := t0.Add(off)
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			break
		}
		if i < nWarm {
			wg.Go(func() { l.send(ctx, client, timeout, l.target(uint64(i)), PhaseWarmup, due, time.Time{}) })
			continue
		}
		if i == nWarm {
			measureStart = due
			if l.OnMeasure != nil {
				l.OnMeasure()
			}
		}
		res.MaxSendLag = max(res.MaxSendLag, time.Since(due))
		s := &res.Samples[i-nWarm]
		wg.Go(func() { *s = l.send(ctx, client, timeout, l.target(uint64(i)), PhaseMeasure, due, measureStart) })
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return res, nil
}

// runClosed is Run for a closed loop of l.Concurrency clients. Samples are
// returned in order of their send time.
func (l Load) runClosed(ctx context.Context, client *http.Client, timeout time.Duration) (*Result, error) {
	t0 := time.Now()
	measureStart := t0.Add(l.Warmup)
	end := measureStart.Add(l.Duration)
	var once sync.Once
	var mu sync.Mutex
	var sent atomic.Uint64 // requests sent, for Path
	res := &Result{Window: l.Duration}
	var wg sync.WaitGroup
	for range l.Concurrency {
		wg.Go(func() {
			var mine []Sample
			for ctx.Err() == nil {
				now := time.Now()
				if !now.Before(end) {
					break
				}
				if now.Before(measureStart) {
					l.send(ctx, client, timeout, l.target(sent.Add(1)-1), PhaseWarmup, now, time.Time{})
					continue
				}
				if l.OnMeasure != nil {
					once.Do(l.OnMeasure)
				}
				mine = append(mine, l.send(ctx, client, timeout, l.target(sent.Add(1)-1), PhaseMeasure, now, measureStart))
			}
			mu.Lock()
			res.Samples = append(res.Samples, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	slices.SortFunc(res.Samples, func(a, b Sample) int { return cmp.Compare(a.Due, b.Due) })
	return res, nil
}

// target returns the URL of the n-th request sent (see Path).
func (l Load) target(n uint64) string {
	if l.Path == nil {
		return l.URL
	}
	return strings.TrimSuffix(l.URL, "/") + l.Path(n)
}

// send makes one request to url and records it.
func (l Load) send(ctx context.Context, client *http.Client, timeout time.Duration, url string, phase Phase, due, measureStart time.Time) Sample {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var s Sample
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, url, nil)
	if err == nil {
		req.Header.Set(PhaseHeader, phase.String())
		var resp *http.Response
		resp, err = client.Do(req)
		if err == nil {
			s.Backend = resp.Header.Get(BackendHeader)
			_, err = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
			if err == nil && resp.StatusCode != http.StatusOK {
				s.Outcome = BadStatus
			}
		}
	}
	now := time.Now()
	s.Latency = now.Sub(due)
	if !measureStart.IsZero() {
		s.Due = due.Sub(measureStart)
		s.Done = now.Sub(measureStart)
	}
	if err != nil {
		s.Outcome = Failed
		if errors.Is(rctx.Err(), context.DeadlineExceeded) {
			s.Outcome = Timeout
		}
	}
	return s
}
