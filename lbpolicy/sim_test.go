package lbpolicy

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/choose"
	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// A discrete-event simulation of a pool of backends behind one selection
// rule, in virtual time: the ewma rule reads the very hoststate estimator
// and choosing algorithms that serve real traffic, fed with the simulated
// clock, so scenario tests are exact and take milliseconds instead of
// minutes of wall-clock load. The backends are FIFO servers with a number
// of workers, a service time, stalls and failure modes.

// simBackend is one simulated backend.
type simBackend struct {
	workers int
	service time.Duration // mean; uniform within ±25%
	// stalls are [from, to) windows in which the backend serves nothing:
	// work that would start or end inside one waits for its end.
	stalls [][2]time.Duration
	// slowUntil: until then, service is slowFactor times longer.
	slowUntil  time.Duration
	slowFactor float64
	// fails: every request is answered at once with a failure (a 503
	// from a black hole).
	fails bool
	// failRate: this share of requests is answered at once with a
	// failure (a partly failing backend); the rest are served.
	failRate float64

	busy     int
	queue    []*simReq
	inFlight int
	stats    *hoststate.Stats
	arrivals []time.Duration // when each request was sent to it
}

type simReq struct {
	sent, due time.Duration // sent to the backend; due from the client
	backend   int
	tried     []int
	start     int64 // BeginAt time
	failed    bool  // answered at once with a failure
}

func (b *simBackend) thaw(t time.Duration) time.Duration {
	for _, w := range b.stalls {
		if t >= w[0] && t < w[1] {
			return w[1]
		}
	}
	return t
}

func (b *simBackend) serviceTime(t time.Duration, rng *rand.Rand) time.Duration {
	d := time.Duration(float64(b.service) * (0.75 + 0.5*rng.Float64()))
	if t < b.slowUntil {
		d = time.Duration(float64(d) * b.slowFactor)
	}
	return d
}

// simEvent is a request arriving from the client or finishing at a backend.
type simEvent struct {
	at   time.Duration
	done bool
	req  *simReq
}

type simQueue []simEvent

func (q simQueue) Len() int           { return len(q) }
func (q simQueue) Less(i, j int) bool { return q[i].at < q[j].at }
func (q simQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)        { *q = append(*q, x.(simEvent)) }
func (q *simQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// simRule chooses a backend for a request; tried lists the backends this
// request already failed on.
type simRule interface {
	choose(s *sim, tried []int) int
}

// simEWMA is the ewma policy's rule: the real estimator and the real
// choosing algorithms, k candidates (0: all).
type simEWMA struct {
	k       int
	weights []float64
	// unpriced leaves out the failure price, to show what it does
	unpriced bool
}

type simCandidates struct {
	s       *sim
	now     int64
	base    float64
	weights []float64
	tried   []int
	// priced: the queue is charged the failure price, as ewma's Cost does
	priced bool
}

func (c simCandidates) Len() int { return len(c.s.backends) }
func (c simCandidates) Usable(i int) bool {
	return !slices.Contains(c.tried, i)
}
func (c simCandidates) Cost(i int) choose.Cost {
	inv := 1.0
	if c.weights != nil {
		inv = 1 / c.weights[i]
	}
	b := c.s.backends[i]
	latency, busy := c.s.table.Judge(b.stats, c.now, c.base)
	cost := choose.CostOf(b.inFlight, inv, latency, busy)
	if c.priced {
		cost.Queue *= c.s.table.QueueCharge(b.stats, c.now, inv, c.shareReference)
	}
	return cost
}

// shareReference is hoststate.ShareReference over the simulated pool.
func (c simCandidates) shareReference() float64 {
	return hoststate.ShareReference(c.now, len(c.s.backends), func(i int) (*hoststate.Stats, float64) {
		inv := 1.0
		if c.weights != nil {
			inv = 1 / c.weights[i]
		}
		return c.s.backends[i].stats, inv
	})
}

func (r simEWMA) choose(s *sim, tried []int) int {
	c := simCandidates{s: s, now: s.clock(), base: s.table.Baseline(), weights: r.weights, tried: tried, priced: !r.unpriced}
	var i int
	if r.k == 0 {
		i = choose.Cheapest(c)
	} else {
		j, cj := choose.BestOfK(c, r.k)
		i = choose.SecondLook(c, r.k, j, cj, c.base)
	}
	if i < 0 {
		c.tried = nil
		i = choose.Cheapest(c)
	}
	return i
}

// simLeastConn is Caddy's least_conn: fewest in flight, ties at random.
type simLeastConn struct{}

func (simLeastConn) choose(s *sim, tried []int) int {
	best, ties := -1, 0
	for i, b := range s.backends {
		if slices.Contains(tried, i) && len(tried) < len(s.backends) {
			continue
		}
		switch {
		case best < 0 || b.inFlight < s.backends[best].inFlight:
			best, ties = i, 1
		case b.inFlight == s.backends[best].inFlight:
			ties++
			if s.rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// sim is one run of a pool under open-loop Poisson load.
type sim struct {
	backends []*simBackend
	table    *hoststate.Table
	rule     simRule
	rng      *rand.Rand
	now      time.Duration
	q        simQueue
	retries  int
	// constant sends at exact intervals, as the benchmark's load
	// generator does, instead of Poisson arrivals.
	constant bool
	// epoch offsets virtual time from the process's own clock, so that
	// the estimator's "never tried" (0) is far in the past.
	epoch time.Duration

	// closedUntil, when set, makes the load closed-loop (see runClosed):
	// each finished client request is followed at once by a new one
	// until then.
	closedUntil time.Duration

	latencies []time.Duration // of finished client requests
	errors    int
}

// simCount makes every simulated backend's address unique, so that no two
// simulations share upstream state.
var simCount atomic.Int64

func newSim(t testing.TB, backends []*simBackend, rule simRule, seed uint64) *sim {
	s := &sim{backends: backends, rule: rule, rng: rand.New(rand.NewPCG(seed, 1)),
		table: hoststate.NewTable(hoststate.Config{}), epoch: time.Hour}
	t.Cleanup(s.table.Release)
	for i, b := range backends {
		b.stats = s.table.Stats(fmt.Sprintf("%s-sim%d-%d", t.Name(), simCount.Add(1), i))
	}
	return s
}

func (s *sim) clock() int64 { return int64(s.epoch + s.now) }

// run offers rate requests per second for d and finishes what is in flight.
func (s *sim) run(rate float64, d time.Duration) {
	s.runSchedule(func(time.Duration) float64 { return rate }, d)
}

// runSchedule offers load at a rate that may change with time.
func (s *sim) runSchedule(rate func(time.Duration) float64, d time.Duration) {
	t := time.Duration(0)
	for {
		gap := 1 / rate(t)
		if !s.constant {
			gap *= s.rng.ExpFloat64()
		}
		t += time.Duration(gap * float64(time.Second))
		if t >= d {
			break
		}
		heap.Push(&s.q, simEvent{at: t, req: &simReq{due: t}})
	}
	for bound := 0; s.q.Len() > 0 && bound < 100_000_000; bound++ {
		e := heap.Pop(&s.q).(simEvent)
		s.now = e.at
		if e.done {
			s.finish(e.req)
		} else {
			s.send(e.req)
		}
	}
}

// runClosed runs conc clients that each send a request as soon as their
// previous one finished, for d, and finishes what is in flight: the
// load generator's fixed concurrency.
func (s *sim) runClosed(conc int, d time.Duration) {
	s.closedUntil = d
	for range conc {
		heap.Push(&s.q, simEvent{at: 0, req: &simReq{}})
	}
	s.runSchedule(func(time.Duration) float64 { return 1e-9 }, 0)
}

func (s *sim) send(r *simReq) {
	i := s.rule.choose(s, r.tried)
	b := s.backends[i]
	r.backend, r.sent = i, s.now
	b.inFlight++
	b.arrivals = append(b.arrivals, s.now)
	r.start = s.clock()
	b.stats.BeginAt(r.start)
	r.failed = b.fails || (b.failRate > 0 && s.rng.Float64() < b.failRate)
	if r.failed {
		heap.Push(&s.q, simEvent{at: s.now + 100*time.Microsecond, done: true, req: r})
		return
	}
	if b.busy < b.workers {
		s.startWork(b, r)
	} else {
		b.queue = append(b.queue, r)
	}
}

func (s *sim) startWork(b *simBackend, r *simReq) {
	b.busy++
	start := b.thaw(s.now)
	end := b.thaw(start + b.serviceTime(start, s.rng))
	heap.Push(&s.q, simEvent{at: end, done: true, req: r})
}

func (s *sim) finish(r *simReq) {
	b := s.backends[r.backend]
	b.inFlight--
	outcome := hoststate.Success
	if r.failed {
		outcome = hoststate.Failure
	} else {
		b.busy--
		if len(b.queue) > 0 {
			next := b.queue[0]
			b.queue = b.queue[1:]
			s.startWork(b, next)
		}
	}
	s.table.ObserveAt(b.stats, r.start, s.clock(), outcome)
	if outcome == hoststate.Failure {
		if len(r.tried) < s.retries {
			r.tried = append(r.tried, r.backend)
			s.send(r)
			return
		}
		s.errors++
	}
	s.latencies = append(s.latencies, s.now-r.due)
	if s.now < s.closedUntil {
		heap.Push(&s.q, simEvent{at: s.now, req: &simReq{due: s.now}})
	}
}

func (s *sim) percentile(p float64) time.Duration {
	l := slices.Clone(s.latencies)
	slices.Sort(l)
	if len(l) == 0 {
		return 0
	}
	return l[min(int(p*float64(len(l))), len(l)-1)]
}

// share returns the fraction of all sends that went to backend i within
// [from, to).
func (s *sim) share(i int, from, to time.Duration) float64 {
	var mine, all int
	for j, b := range s.backends {
		for _, at := range b.arrivals {
			if at >= from && at < to {
				all++
				if j == i {
					mine++
				}
			}
		}
	}
	if all == 0 {
		return 0
	}
	return float64(mine) / float64(all)
}

// simPool returns n backends of one worker serving in service.
func simPool(n int, service time.Duration) []*simBackend {
	bs := make([]*simBackend, n)
	for i := range bs {
		bs[i] = &simBackend{workers: 1, service: service}
	}
	return bs
}

// stallsEvery returns stalls of length within [minLen, maxLen] about every
// period over d, at offsets drawn from seed.
func stallsEvery(d, period, minLen, maxLen time.Duration, seed uint64) [][2]time.Duration {
	rng := rand.New(rand.NewPCG(seed, 7))
	var out [][2]time.Duration
	for k := time.Duration(0); k < d; k += period {
		l := minLen + time.Duration(rng.Float64()*float64(maxLen-minLen))
		at := k + time.Duration(rng.Float64()*float64(period-l))
		out = append(out, [2]time.Duration{at, at + l})
	}
	return out
}
