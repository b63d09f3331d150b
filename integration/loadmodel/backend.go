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
//  4. It answers 200 with a short body and a BackendHeader naming itself,
//     and, while load reports are on (SetLoadReports), an ORCA load report
//     of its own state in LoadReportHeader (see report.go).
//
// Two exceptions come first. A request for HealthPath is answered 200 at
// once, whatever the model says (no worker, no freeze, no failure), as a
// health endpoint served by its own thread would be; it counts only in
// HealthChecks. LoadReportPath is answered the same way, with the load
// report while reports are on: the endpoint a proxy probes for load. And a backend with a failure mode (Model.Fail) answers
// every other request at once with a 503, or by resetting the connection,
// without taking a worker: a black hole whose health check passes.
//
// A model can change once during a case (Model.Change): a degraded backend
// that recovers at a given time after the epoch.
//
// Each request is counted under its phase (PhaseHeader), so a benchmark can
// tell what arrived during the measured window from warm-up traffic, and
// load traffic (warm-up and measured) is also counted by arrival time in
// buckets of ArrivalBucket since the epoch (see Arrivals).
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
	"math"
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
	// Seed selects the jitter: the service time of the n-th request to
	// start work since the epoch is a pure function of Seed and n, so every
	// case that resets the epoch draws the same sequence. Freeze has its
	// own seed.
	Seed uint64 `json:"seed"`
	// Fail is the backend's failure mode; FailNone (the zero value)
	// serves normally. A failing backend still answers HealthPath with
	// 200.
	Fail FailMode `json:"fail,omitempty"`
	// FailRate is the fraction of requests, in (0, 1], that Fail applies
	// to; the others are served by the model. 0 means every request (the
	// black hole). Which requests fail is a pure function of Seed and the
	// request's number since the epoch, so every case meets the same
	// sequence: a partly failing backend, as issue 24's flaky one.
	FailRate float64 `json:"fail_rate,omitempty"`
	// Change, when its At is positive, replaces Service and Freeze from
	// At after the epoch on. The zero Change changes nothing.
	Change Change `json:"change,omitzero"`
}

// Change is a change of a backend's model at a fixed time after its
// epoch: for example a degraded backend (slow, stalling) that becomes
// healthy. Workers and Jitter stay as they are. A request whose work
// begins before At is served by the old model, one that begins at or after
// At by the new one.
type Change struct {
	// At is when the change takes effect, relative to the epoch; more
	// than 0 (zero: no change).
	At time.Duration `json:"at_ns"`
	// Service is the mean service time from At on.
	Service time.Duration `json:"service_ns"`
	// Freeze is the schedule of stalls from At on, timed from the epoch
	// as before; zero for none.
	Freeze Freeze `json:"freeze"`
}

// Enabled reports whether the change ever takes effect.
func (c Change) Enabled() bool { return c.At > 0 }

// FailMode is how a failing backend answers the requests it gets, other
// than health checks.
type FailMode uint8

// The failure modes.
const (
	// FailNone serves by the model.
	FailNone FailMode = iota
	// Fail503 answers 503 Service Unavailable at once.
	Fail503
	// FailReset resets the connection at once (the server closes it with
	// SO_LINGER 0, so the peer reads an RST), before any response byte.
	FailReset
)

// String returns the mode's name: "none", "503" or "reset".
func (f FailMode) String() string {
	switch f {
	case FailNone:
		return "none"
	case Fail503:
		return "503"
	case FailReset:
		return "reset"
	default:
		return "FailMode(" + strconv.Itoa(int(f)) + ")"
	}
}

// ParseFailMode parses the name of a failure mode, as String writes it
// ("" also means none).
func ParseFailMode(s string) (FailMode, error) {
	switch s {
	case "", "none":
		return FailNone, nil
	case "503":
		return Fail503, nil
	case "reset":
		return FailReset, nil
	}
	return FailNone, fmt.Errorf("unknown failure mode %q (known: none, 503, reset)", s)
}

// MarshalText writes the mode's name.
func (f FailMode) MarshalText() ([]byte, error) {
	if f > FailReset {
		return nil, fmt.Errorf("invalid failure mode %d", f)
	}
	return []byte(f.String()), nil
}

// UnmarshalText reads a mode's name.
func (f *FailMode) UnmarshalText(b []byte) error {
	m, err := ParseFailMode(string(b))
	if err != nil {
		return err
	}
	*f = m
	return nil
}

// HealthPath is the path every backend answers with 200 at once, whatever
// its model: a health endpoint for active health checks and readiness
// probes.
const HealthPath = "/health"

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
	case m.Freeze.validate() != nil:
		return fmt.Errorf("backend %s: %w", m.Name, m.Freeze.validate())
	case m.Fail > FailReset:
		return fmt.Errorf("backend %s: invalid failure mode %d", m.Name, m.Fail)
	case m.FailRate < 0 || m.FailRate > 1 || math.IsNaN(m.FailRate):
		return fmt.Errorf("backend %s: fail rate must be between 0 and 1, got %v", m.Name, m.FailRate)
	case m.FailRate > 0 && m.Fail == FailNone:
		return fmt.Errorf("backend %s: fail rate %v without a failure mode", m.Name, m.FailRate)
	case m.Change.At < 0:
		return fmt.Errorf("backend %s: change at a negative time %v", m.Name, m.Change.At)
	case m.Change.Enabled() && m.Change.Service < 0:
		return fmt.Errorf("backend %s: change to a negative service time %v", m.Name, m.Change.Service)
	case m.Change.Enabled() && m.Change.Freeze.validate() != nil:
		return fmt.Errorf("backend %s: change: %w", m.Name, m.Change.Freeze.validate())
	case !m.Change.Enabled() && m.Change != (Change{}):
		return fmt.Errorf("backend %s: a change needs a positive time (at), got %v", m.Name, m.Change.At)
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
	// Failed is the number answered by the failure mode (a 503 or a
	// reset) instead of being served; they are part of Arrivals, not of
	// Served.
	Failed int64 `json:"failed,omitempty"`
}

type phaseCounters struct {
	arrivals, served, abandoned, failed atomic.Int64
	maxInSystem                         atomic.Int64
	busy                                atomic.Int64 // nanoseconds
}

func (c *phaseCounters) reset() {
	c.arrivals.Store(0)
	c.served.Store(0)
	c.abandoned.Store(0)
	c.failed.Store(0)
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

// ArrivalBucket is the width of the time buckets in which a backend counts
// the arrivals of load traffic; see Backend.Arrivals.
const ArrivalBucket = 100 * time.Millisecond

// MaxArrivalBuckets is the number of buckets a backend keeps: ten minutes
// from the epoch. Later arrivals are not bucketed (they are still counted
// in Counters).
const MaxArrivalBuckets = 6000

// Backend is an HTTP server on 127.0.0.1 that serves by its Model.
type Backend struct {
	model        Model
	body         []byte
	bodyLen      string
	slots        chan struct{}
	epoch        atomic.Int64 // unix nanoseconds; freezes are timed from it
	started      atomic.Uint64
	arrived      atomic.Uint64 // load requests since the epoch, for FailRate
	inSystem     atomic.Int64
	health       atomic.Int64
	reports      atomic.Bool  // SetLoadReports
	probes       atomic.Int64 // requests for LoadReportPath
	reportBehind atomic.Bool  // SetReportBehind
	rates        rateWindow   // answers and failures per second, for the reports
	phases       [numPhases]phaseCounters
	buckets      []atomic.Int64 // arrivals of load traffic per ArrivalBucket since the epoch

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
		model:   m,
		body:    []byte("served by " + m.Name + "\n"),
		slots:   make(chan struct{}, m.Workers),
		buckets: make([]atomic.Int64, MaxArrivalBuckets),
		ln:      ln,
		done:    make(chan struct{}),
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

// SetEpoch restarts the freeze schedule, the model's Change and the jitter
// sequence at t, so that a benchmark case started at t meets the same
// stalls and draws the same service times as every other case. Call it
// while the backend is idle, after ResetCounters.
func (b *Backend) SetEpoch(t time.Time) {
	b.epoch.Store(t.UnixNano())
	b.started.Store(0)
	b.arrived.Store(0)
}

// HealthChecks returns the number of requests for HealthPath served since
// the backend started.
func (b *Backend) HealthChecks() int64 { return b.health.Load() }

// Arrivals returns the number of load requests (warm-up and measured) that
// arrived in each ArrivalBucket since the epoch, since the counters were
// last reset, up to the last bucket with an arrival.
func (b *Backend) Arrivals() []int64 {
	last := -1
	out := make([]int64, len(b.buckets))
	for i := range b.buckets {
		if out[i] = b.buckets[i].Load(); out[i] != 0 {
			last = i
		}
	}
	return out[:last+1]
}

// InSystem returns the number of requests queued or in service now.
func (b *Backend) InSystem() int64 { return b.inSystem.Load() }

// ResetCounters zeroes the counters of every phase and the arrival
// buckets.
func (b *Backend) ResetCounters() {
	for i := range b.phases {
		b.phases[i].reset()
	}
	for i := range b.buckets {
		b.buckets[i].Store(0)
	}
}

// BusyTime returns the time the backend's workers were held, by requests
// of every phase together, since the counters were last reset (a request
// counts when its work ends). The difference of two readings over a
// window, divided by Workers × the window, is the backend's utilization
// in it, whoever sent the load.
func (b *Backend) BusyTime() time.Duration {
	var d int64
	for i := range b.phases {
		d += b.phases[i].busy.Load()
	}
	return time.Duration(d)
}

// Counters returns the counters of phase p.
func (b *Backend) Counters(p Phase) Counters {
	c := &b.phases[p]
	out := Counters{
		Arrivals:    c.arrivals.Load(),
		Served:      c.served.Load(),
		Abandoned:   c.abandoned.Load(),
		MaxInSystem: c.maxInSystem.Load(),
		Failed:      c.failed.Load(),
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
	if r.URL.Path == HealthPath {
		b.health.Add(1)
		b.answer(w, http.StatusOK)
		return
	}
	if r.URL.Path == LoadReportPath {
		b.probes.Add(1)
		b.report(w, b.inSystem.Load())
		b.answer(w, http.StatusOK)
		return
	}
	phase := phaseOf(r)
	c := &b.phases[phase]
	c.arrivals.Add(1)
	if phase != PhaseOther {
		if k := (time.Now().UnixNano() - b.epoch.Load()) / int64(ArrivalBucket); k >= 0 && k < int64(len(b.buckets)) {
			b.buckets[k].Add(1)
		}
	}
	fail := b.model.Fail
	if fail != FailNone && !b.failsNext() {
		fail = FailNone
	}
	switch fail {
	case Fail503:
		c.failed.Add(1)
		b.rates.note(time.Now(), true)
		b.report(w, b.inSystem.Load())
		b.answer(w, http.StatusServiceUnavailable)
		return
	case FailReset:
		c.failed.Add(1)
		resetConn(w)
		return
	}
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
	end := time.Now()
	c.busy.Add(int64(end.Sub(start)))
	c.served.Add(1)
	b.rates.note(end, false)
	// This request is still counted in inSystem (the deferred decrement
	// runs after the answer): the report includes it, as a server's
	// count of requests in the system does while it writes a response,
	// unless it reports what it leaves behind.
	n := b.inSystem.Load()
	if b.reportBehind.Load() {
		n--
	}
	b.report(w, n)
	b.answer(w, http.StatusOK)
}

// answer writes a response with the backend's body and BackendHeader.
func (b *Backend) answer(w http.ResponseWriter, status int) {
	h := w.Header()
	h.Set(BackendHeader, b.model.Name)
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", b.bodyLen)
	w.WriteHeader(status)
	_, _ = w.Write(b.body)
}

// resetConn takes the request's connection over and closes it with
// SO_LINGER 0, so that the kernel sends an RST instead of a FIN and the
// client reads "connection reset by peer" before any response byte.
func resetConn(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		// Not hijackable (HTTP/2): abort the response instead, which
		// resets the stream.
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

// holdTime returns how long a request whose work may begin at start holds
// its worker: the service time, with the start postponed past a freeze
// under way and the end postponed past a freeze that covers it.
func (b *Backend) holdTime(start time.Time) time.Duration {
	rel := time.Duration(start.UnixNano() - b.epoch.Load())
	service, freeze := b.model.Service, b.model.Freeze
	if ch := b.model.Change; ch.Enabled() && rel >= ch.At {
		service, freeze = ch.Service, ch.Freeze
	}
	begin := freeze.Thaw(rel)
	end := freeze.Thaw(begin + b.serviceTime(service))
	return end - rel
}

// failsNext reports whether the next load request is one of the FailRate
// that fail: a draw from a hash of the model's Seed and the request's
// number since the epoch (salted apart from the service-time draws).
func (b *Backend) failsNext() bool {
	r := b.model.FailRate
	if r == 0 || r >= 1 {
		return true
	}
	n := b.arrived.Add(1)
	return unitFloat(splitmix64(b.model.Seed^0x9e3779b97f4a7c15^n*0xbf58476d1ce4e5b9)) < r
}

// serviceTime draws the service time of the next request to start work,
// of mean mean: uniform in mean × [1−Jitter, 1+Jitter], from a hash of the
// model's Seed and the request's number since the epoch.
func (b *Backend) serviceTime(mean time.Duration) time.Duration {
	m := b.model
	if m.Jitter == 0 {
		return mean
	}
	n := b.started.Add(1)
	u := unitFloat(splitmix64(m.Seed ^ n*0xd1b54a32d192ed03))
	f := 1 + m.Jitter*(2*u-1)
	return time.Duration(f * float64(mean))
}
