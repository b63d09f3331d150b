// Package loadmodel is a small harness for load-balancing experiments on
// loopback: HTTP backends with a latency model and limited concurrency, and
// an open-loop load generator that measures latency from the intended send
// time.
//
// # The backend model
//
// A Backend serves every request in the same way:
//
//  1. It waits for one of its Workers slots (a buffered channel used as a
//     semaphore; waiters are served first come, first served). Requests
//     beyond Workers queue here, so an overloaded backend builds a queue
//     and its latency grows without bound, as a real server's does. A
//     request whose client goes away while it waits leaves the queue.
//  2. Holding the slot, it "works" for a service time drawn uniformly from
//     Service × [1−Jitter, 1+Jitter], by sleeping: the model spends no CPU,
//     so backends do not compete with the proxy under test for the
//     machine's cores. Go's timers wake a little late (0.2–0.5 ms on a
//     2-core VM, more when it is short of CPU), so a 2 ms service time
//     takes about 2.5 ms; the lateness is the same for every proxy
//     measured, and Counters reports the time really taken.
//  3. If the backend is frozen (see Freeze) when the work would start or
//     end, it is postponed to the end of the freeze: a stall holds the
//     requests in service and stops new ones from starting.
//  4. It answers 200 with a short body and a BackendHeader naming itself.
//
// Each request is counted under its phase (PhaseHeader), so a benchmark can
// tell what arrived during the measured window from warm-up traffic.
//
// # The load generator
//
// Load sends requests open loop: request i is due at start + i/Rate, no
// matter how earlier requests fared, and its latency is taken from that due
// time, so a stall in the system under test is charged to every request it
// delays (no coordinated omission). See Load.
package loadmodel

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"
)

// BackendHeader is the response header that names the backend that
// answered.
const BackendHeader = "X-Lbx-Backend"

// PhaseHeader is the request header that tells a backend which phase of a
// benchmark a request belongs to; see Phase.
const PhaseHeader = "X-Lbx-Phase"

// Phase labels the requests of one part of a benchmark case.
type Phase int

// The phases a backend counts separately.
const (
	// PhaseOther is any request without a known PhaseHeader: readiness
	// probes, health checks.
	PhaseOther Phase = iota
	// PhaseWarmup is warm-up traffic, not measured.
	PhaseWarmup
	// PhaseMeasure is traffic in the measured window.
	PhaseMeasure
	numPhases
)

// String returns the value of PhaseHeader for p.
func (p Phase) String() string {
	switch p {
	case PhaseWarmup:
		return "warmup"
	case PhaseMeasure:
		return "measure"
	default:
		return "other"
	}
}

func phaseOf(r *http.Request) Phase {
	switch r.Header.Get(PhaseHeader) {
	case "warmup":
		return PhaseWarmup
	case "measure":
		return PhaseMeasure
	default:
		return PhaseOther
	}
}

// Model describes how a backend serves requests. See the package
// documentation for the sequence every request goes through.
type Model struct {
	// Name identifies the backend in BackendHeader and in reports.
	Name string `json:"name"`
	// Workers is how many requests are served at once; more wait in a
	// queue. At least 1.
	Workers int `json:"workers"`
	// Service is the mean service time of a request.
	Service time.Duration `json:"service_ns"`
	// Jitter spreads service times uniformly over Service × [1−Jitter,
	// 1+Jitter]; between 0 and 1.
	Jitter float64 `json:"jitter"`
	// Freeze is the backend's schedule of stalls; zero for none.
	Freeze Freeze `json:"freeze"`
}

// Validate checks that the model can be served.
func (m Model) Validate() error {
	switch {
	case m.Name == "":
		return errors.New("backend model needs a name")
	case m.Workers < 1:
		return fmt.Errorf("backend %s: workers must be at least 1, got %d", m.Name, m.Workers)
	case m.Service < 0:
		return fmt.Errorf("backend %s: negative service time %v", m.Name, m.Service)
	case m.Jitter < 0 || m.Jitter > 1:
		return fmt.Errorf("backend %s: jitter must be between 0 and 1, got %v", m.Name, m.Jitter)
	case m.Freeze.Every < 0 || m.Freeze.Min < 0 || m.Freeze.Max < m.Freeze.Min:
		return fmt.Errorf("backend %s: freeze needs 0 ≤ min ≤ max and every ≥ 0", m.Name)
	}
	return nil
}

// Counters are what a backend saw of one phase since its counters were
// last reset.
type Counters struct {
	// Arrivals is the number of requests that reached the backend.
	Arrivals int64 `json:"arrivals"`
	// Served is the number answered.
	Served int64 `json:"served"`
	// Abandoned is the number whose client went away while they queued.
	Abandoned int64 `json:"abandoned"`
	// MaxInSystem is the largest number of requests of any phase present
	// at once (queued or in service), sampled when a request of this
	// phase arrived.
	MaxInSystem int64 `json:"max_in_system"`
	// MeanService is the mean time a worker was held per served request
	// (service time plus freezes plus timer lateness).
	MeanService time.Duration `json:"mean_service_ns"`
}

type phaseCounters struct {
	arrivals, served, abandoned atomic.Int64
	maxInSystem                 atomic.Int64
	busy                        atomic.Int64 // nanoseconds
}

func (c *phaseCounters) reset() {
	c.arrivals.Store(0)
	c.served.Store(0)
	c.abandoned.Store(0)
	c.maxInSystem.Store(0)
	c.busy.Store(0)
}

func (c *phaseCounters) noteInSystem(n int64) {
	for {
		old := c.maxInSystem.Load()
		if n <= old || c.maxInSystem.CompareAndSwap(old, n) {
			return
		}
	}
}

// Backend is an HTTP server on 127.0.0.1 that serves by its Model.
type Backend struct {
	model    Model
	body     []byte
	bodyLen  string
	slots    chan struct{}
	epoch    atomic.Int64 // unix nanoseconds; freezes are timed from it
	inSystem atomic.Int64
	phases   [numPhases]phaseCounters

	ln   net.Listener
	srv  *http.Server
	done chan struct{}
}

// StartBackend starts a backend on an ephemeral 127.0.0.1 port. Its freeze
// epoch is the moment it starts; see SetEpoch. Close stops it.
func StartBackend(m Model) (*Backend, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("backend %s: %w", m.Name, err)
	}
	b := &Backend{
		model: m,
		body:  []byte("served by " + m.Name + "\n"),
		slots: make(chan struct{}, m.Workers),
		ln:    ln,
		done:  make(chan struct{}),
	}
	b.bodyLen = strconv.Itoa(len(b.body))
	b.epoch.Store(time.Now().UnixNano())
	b.srv = &http.Server{
		Handler:           b,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
	}
	go func() {
		defer close(b.done)
		_ = b.srv.Serve(ln) // returns http.ErrServerClosed on Close
	}()
	return b, nil
}

// Name returns the backend's name.
func (b *Backend) Name() string { return b.model.Name }

// Model returns the backend's model.
func (b *Backend) Model() Model { return b.model }

// Addr returns the backend's host:port.
func (b *Backend) Addr() string { return b.ln.Addr().String() }

// URL returns the backend's base URL.
func (b *Backend) URL() string { return "http://" + b.Addr() + "/" }

// SetEpoch restarts the freeze schedule at t, so that a benchmark case
// started at t meets the same stalls as every other case.
func (b *Backend) SetEpoch(t time.Time) { b.epoch.Store(t.UnixNano()) }

// InSystem returns the number of requests queued or in service now.
func (b *Backend) InSystem() int64 { return b.inSystem.Load() }

// ResetCounters zeroes the counters of every phase.
func (b *Backend) ResetCounters() {
	for i := range b.phases {
		b.phases[i].reset()
	}
}

// Counters returns the counters of phase p.
func (b *Backend) Counters(p Phase) Counters {
	c := &b.phases[p]
	out := Counters{
		Arrivals:    c.arrivals.Load(),
		Served:      c.served.Load(),
		Abandoned:   c.abandoned.Load(),
		MaxInSystem: c.maxInSystem.Load(),
	}
	if out.Served > 0 {
		out.MeanService = time.Duration(c.busy.Load() / out.Served)
	}
	return out
}

// WaitIdle waits until no request is queued or in service, or ctx is done.
func (b *Backend) WaitIdle(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for b.inSystem.Load() > 0 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("backend %s still has %d requests: %w", b.model.Name, b.inSystem.Load(), ctx.Err())
		case <-t.C:
		}
	}
	return nil
}

// Close stops the backend: it closes the listener and every connection,
// and waits (up to two seconds) for requests in service to finish.
func (b *Backend) Close() error {
	err := b.srv.Close()
	select {
	case <-b.done:
	case <-time.After(2 * time.Second):
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = b.WaitIdle(ctx)
	return err
}

// ServeHTTP serves a request according to the model.
func (b *Backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c := &b.phases[phaseOf(r)]
	c.arrivals.Add(1)
	c.noteInSystem(b.inSystem.Add(1))
	defer b.inSystem.Add(-1)

	select {
	case b.slots <- struct{}{}:
	case <-r.Context().Done():
		c.abandoned.Add(1)
		return
	}
	start := time.Now()
	if d := b.holdTime(start); d > 0 {
		// The worker is held for the whole service time even if the client
		// leaves meanwhile, as a real server's would be.
		time.Sleep(d)
	}
	<-b.slots
	c.busy.Add(int64(time.Since(start)))
	c.served.Add(1)

	h := w.Header()
	h.Set(BackendHeader, b.model.Name)
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", b.bodyLen)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b.body)
}

// holdTime returns how long a request whose work may begin at start holds
// its worker: the service time, with the start postponed past a freeze
// under way and the end postponed past a freeze that covers it.
func (b *Backend) holdTime(start time.Time) time.Duration {
	rel := time.Duration(start.UnixNano() - b.epoch.Load())
	begin := b.model.Freeze.Thaw(rel)
	end := b.model.Freeze.Thaw(begin + b.serviceTime())
	return end - rel
}

func (b *Backend) serviceTime() time.Duration {
	m := b.model
	if m.Jitter == 0 {
		return m.Service
	}
	f := 1 + m.Jitter*(2*rand.Float64()-1)
	return time.Duration(f * float64(m.Service))
}
