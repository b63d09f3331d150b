package hoststate

import (
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// registry holds one *Stats per dial address, reference-counted by the
// Tables (one per handler) that use it, so state survives a reload — the new
// config takes its references before the old one releases its own — and is
// dropped when no config uses the address any more.
var registry = caddy.NewUsagePool()

// Default estimator settings.
const (
	defaultHorizon = time.Second
	defaultPrior   = 5 * time.Millisecond
)

// Config tunes how a Table's observations become estimates.
type Config struct {
	// Horizon is how long an answer counts toward a host's estimate, and
	// how long a host goes without an attempt before one request is let
	// through to learn whether it changed (see Expected).
	Horizon time.Duration
	// Prior is the estimate of a host nobody has sampled yet, used until the
	// pool itself has a typical latency.
	Prior time.Duration
}

func (c *Config) setDefaults() {
	if c.Horizon <= 0 {
		c.Horizon = defaultHorizon
	}
	if c.Prior <= 0 {
		c.Prior = defaultPrior
	}
}

// Table is one handler's view of the shared state: it takes references on
// the addresses it uses, remembers them for Release, and keeps the pool's
// typical latency (the baseline) that new and idle hosts are measured
// against. Lookups are lock-free once an address has been seen.
type Table struct {
	cfg       Config
	horizonNs int64

	// mu serialises taking and dropping references, so that byDial and
	// the registry agree. byDial (dial -> *Stats) is read without it: a
	// sync.Map adds an address in O(1) where a copy-on-write map would
	// copy every address for each new one (quadratic when a list of
	// thousands arrives at once).
	mu       sync.Mutex
	byDial   sync.Map
	released bool

	// ejectMu serialises counting ejected upstreams with the ejections
	// that count allows (see LockEjections).
	ejectMu sync.Mutex

	// baseline is a plain EWMA (float64 bits, ns) of every sample this
	// table observed: the latency a typical request in this pool sees.
	baseline atomic.Uint64
}

// NewTable returns an empty Table with cfg's zero fields defaulted.
func NewTable(cfg Config) *Table {
	cfg.setDefaults()
	return &Table{cfg: cfg, horizonNs: int64(cfg.Horizon)}
}

// Stats returns the shared state for dial, taking a reference the first time
// this table sees the address. It is O(1), also for a new address.
func (t *Table) Stats(dial string) *Stats {
	if s, ok := t.byDial.Load(dial); ok {
		return s.(*Stats)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.byDial.Load(dial); ok {
		return s.(*Stats)
	}
	if t.released {
		// A straggling request of a config being torn down: hand out
		// state without taking a reference nobody would drop.
		return &Stats{dial: dial}
	}
	v, _, _ := registry.LoadOrNew(dial, func() (caddy.Destructor, error) {
		return &Stats{dial: dial, bornNs: monoclock.Now()}, nil
	})
	s := v.(*Stats)
	t.byDial.Store(dial, s)
	return s
}

// NewStats returns state for something that is not an upstream address
// (a selective group), named name: its owner keeps it, outside the
// registry of addresses, and gives it to a Table's methods as it would an
// address's.
func NewStats(name string) *Stats { return &Stats{dial: name, bornNs: monoclock.Now()} }

// Lookup returns the state of dial if this table uses the address,
// without taking a reference.
func (t *Table) Lookup(dial string) (*Stats, bool) {
	s, ok := t.byDial.Load(dial)
	if !ok {
		return nil, false
	}
	return s.(*Stats), true
}

// Drop releases this table's reference on dial, for an address that left
// the table's upstream list: without it a table whose list churns would
// hold every address it ever saw until the config is unloaded. The state
// survives while another table (another handler, or the next config of a
// reload) holds the address; otherwise it is forgotten, and the address
// starts afresh if it returns. Holders of the *Stats may keep using it.
func (t *Table) Drop(dial string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.released {
		return
	}
	if _, ok := t.byDial.LoadAndDelete(dial); ok {
		_, _ = registry.Delete(dial)
	}
}

// DropIdle drops (see Drop) the addresses that no attempt has used for
// idle and that keep does not claim, and returns how many it dropped. An
// address with an attempt in flight (awaiting headers, or, as Caddy
// counts it, still streaming its body), or ejected in the last idle,
// stays: its ejection is state worth keeping. It is O(addresses); a policy
// whose pools churn calls it now and then, so that its table holds about
// what its pools hold rather than every address it ever saw.
func (t *Table) DropIdle(now int64, idle time.Duration, keep func(dial string) bool) int {
	var gone []string
	t.byDial.Range(func(k, v any) bool {
		dial, s := k.(string), v.(*Stats)
		last := max(s.lastDoneNs.Load(), s.bornNs, s.ejectedUntilNs.Load())
		if now-last > int64(idle) && !s.busy() && !keep(dial) {
			gone = append(gone, dial)
		}
		return true
	})
	for _, dial := range gone {
		t.Drop(dial)
	}
	return len(gone)
}

// Len returns how many addresses the table holds references on.
func (t *Table) Len() int {
	n := 0
	t.byDial.Range(func(_, _ any) bool {
		n++
		return true
	})
	return n
}

// Release drops this table's references. It is idempotent.
func (t *Table) Release() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.released {
		return
	}
	t.released = true
	t.byDial.Range(func(dial, _ any) bool {
		_, _ = registry.Delete(dial)
		return true
	})
}

// baselineWeight is how much one sample moves the pool baseline.
const baselineWeight = 1.0 / 64

// Observe records a finished round trip that started at start (from
// s.Begin) on s.
func (t *Table) Observe(s *Stats, start int64, outcome Outcome) {
	t.ObserveAt(s, start, monoclock.Now(), outcome)
}

// ObserveAt is Observe of a round trip that finished at now, for callers
// (and simulations) that keep their own clock.
func (t *Table) ObserveAt(s *Stats, start, now int64, outcome Outcome) {
	answer := s.observe(now, start, outcome, t.horizonNs)
	if answer <= 0 {
		return
	}
	sample := float64(answer)
	for {
		old := t.baseline.Load()
		b := math.Float64frombits(old)
		nb := sample
		if b > 0 {
			nb = b + (sample-b)*baselineWeight
		}
		if t.baseline.CompareAndSwap(old, math.Float64bits(nb)) {
			return
		}
	}
}

// Baseline returns the pool's typical latency in ns, or the prior when
// nothing has been observed yet.
func (t *Table) Baseline() float64 {
	if b := math.Float64frombits(t.baseline.Load()); b > 0 {
		return b
	}
	return float64(t.cfg.Prior)
}

// Expected returns the latency in ns that one more request to s should
// expect at now, before queueing behind the requests already in flight
// (the policy counts those): base is the pool's typical latency, from
// Baseline. It is
//
//   - base for a host that has not been tried for the horizon and has
//     nothing in flight: whatever it was, it may have changed, and one
//     request will tell (a recovered host regains its share within a
//     horizon, a still-slow one costs one slow answer per horizon);
//   - otherwise the median of its recent answers (base if it has none),
//     raised to how long it has gone without finishing anything while
//     requests are in flight, when that is longer — a stall is seen as it
//     happens, not when its answers arrive — and doubled for every failed
//     attempt in a row. (Pricing a stall at twice its overrun measured
//     worse in both stall variants of the benchmark, and in simulation: a
//     few requests parked in a stall sit above the p99 anyway, while
//     steering every one of them onto the other hosts raises the queueing
//     that sets it.)
func (t *Table) Expected(s *Stats, now int64, base float64) float64 {
	latency, _ := t.Judge(s, now, base)
	return latency
}

// SelectionLatency returns, in ns, the latency that selection expects of
// one more request to s at now: Expected at the pool's Baseline, times
// the host's FailurePrice (which lb_policy ewma charges its queue: the
// two are one product in its cost). It is +Inf for a host
// ejected at now, which selection does not choose at all (except in
// panic mode), so that a report of it can never read as fast. Unlike
// Snapshot's Estimate, which is a plain median and is 0 for a host that
// was just ejected, it is what a host is judged by.
func (t *Table) SelectionLatency(s *Stats, now int64) float64 {
	if s.Ejected(now) {
		return math.Inf(1)
	}
	return t.Expected(s, now, t.Baseline()) * t.FailurePrice(s, now)
}

// FailurePrice is the host's FailurePrice, except that a rested host
// (see rested) pays none: like its latency, its failures may be over,
// and one request will tell. Without this a host that failed once at
// light load would lose every tie to an idle host, get no request to
// show it recovered, and keep its price for as long as its counts take
// to fade (TestSlowStartRampAfterEjection).
func (t *Table) FailurePrice(s *Stats, now int64) float64 {
	if t.rested(s, now) {
		return 1
	}
	return s.FailurePrice(now)
}

// QueueCharge returns the factor by which selection multiplies the queue
// of one more request to s, of inverse weight invWeight, for its recent
// failures: its FailurePrice, or +Inf while it is OverShare, so that it
// loses to every host that is not (and ties with those that are).
// reference is called for a failing host only, as computing it visits
// the pool.
func (t *Table) QueueCharge(s *Stats, now int64, invWeight float64, reference func() float64) float64 {
	if t.rested(s, now) {
		return 1
	}
	// the ratio is read once for both: each read decays the counts to now
	f := s.FailureRatio(now)
	if f <= 0 {
		return 1
	}
	if s.overShare(now, f, invWeight, reference) {
		return math.Inf(1)
	}
	return priceOf(f)
}

// rested reports whether the host has nothing in flight, no stall marked
// and no attempt finished for the horizon: what it did before may no
// longer be true of it, so selection expects of it what it expects of
// the pool.
func (t *Table) rested(s *Stats, now int64) bool {
	return s.pending.Load() <= 0 && s.stuckUntilNs.Load() <= now && now-s.lastDoneNs.Load() >= t.horizonNs
}

// Judge returns what Expected does, and for how long the host has been
// busy without finishing anything (0 when it has nothing in flight): with
// equal queues, the host furthest into its current work frees up first.
func (t *Table) Judge(s *Stats, now int64, base float64) (latency, busy float64) {
	if t.rested(s, now) {
		// a report past capacity still counts: it is news of the host
		// that the rest is not (see ReportedFactor)
		return base * s.ReportedFactor(now), 0
	}
	pending := s.pending.Load()
	lastDone := s.lastDoneNs.Load()
	stuck := int64(0)
	if until := s.stuckUntilNs.Load(); until > now {
		stuck = now - s.stuckFromNs.Load()
	}
	est := float64(s.estimateNs.Load())
	if est == 0 {
		est = base
	}
	busy = float64(stalledFor(now, lastDone, s.busySinceNs.Load(), pending))
	if stall := max(busy, float64(stuck)); stall > est {
		// a stall is seen as it happens: the host is expected to be at
		// least as slow as the stall so far
		est = stall
	}
	if f := s.failStreak.Load(); f > 0 {
		est *= failurePenalty(f)
	}
	return est * s.ReportedFactor(now), busy
}

// All returns a snapshot of every upstream known to any config, sorted by
// dial address.
func All() []Snapshot {
	now := monoclock.Now()
	var out []Snapshot
	registry.Range(func(_, v any) bool {
		out = append(out, v.(*Stats).Snapshot(now))
		return true
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Dial < out[j].Dial })
	return out
}

// References reports how many tables hold dial (for tests).
func References(dial string) int {
	n, _ := registry.References(dial)
	return n
}

// LockEjections makes a cap check (CountEjected) and the ejections it
// allows one step with respect to every other caller: without it, two
// upstreams failing at the same moment could both see room for one more
// ejection and overshoot the cap. Ejections are rare, so the lock is
// never contended on the request path.
func (t *Table) LockEjections() { t.ejectMu.Lock() }

// UnlockEjections ends what LockEjections began.
func (t *Table) UnlockEjections() { t.ejectMu.Unlock() }

// CountEjected returns how many of this table's upstreams are ejected at
// now, and how many upstreams it has.
func (t *Table) CountEjected(now int64) (ejected, total int) {
	t.byDial.Range(func(_, v any) bool {
		if v.(*Stats).Ejected(now) {
			ejected++
		}
		total++
		return true
	})
	return ejected, total
}
