// Package lbpolicy provides reverse_proxy selection policies: `ewma`, which
// picks the upstream with the lowest expected latency — (in-flight + 1) ×
// peak-EWMA latency / weight — and `panic`, which gives any selection policy
// Envoy-style panic mode: when too few upstreams are healthy, the health
// checks are the likelier culprits, so all upstreams are used.
package lbpolicy

import "math/rand/v2"

// candidates is what the choosing algorithms see of a pool: how many
// members it has, whether member i may be chosen right now, and what
// sending one more request to it is expected to cost. Keeping it abstract
// keeps the algorithms testable without Caddy.
type candidates interface {
	Len() int
	Usable(i int) bool
	Cost(i int) cost
}

// cost is the expected cost of one more request to an upstream, in its two
// factors: load = (requests in flight + 1) / weight, and the latency
// estimate. The cost itself is their product.
type cost struct {
	load, latency float64
}

// beats reports whether c is clearly cheaper than o. Latency estimates of
// equally fast upstreams differ by noise (a peak here, a GC pause there);
// a strict comparison would turn that noise into a preference and, at light
// load, pile nearly every request onto whichever upstream measured a few
// percent faster. So between upstreams with the same load, latencies within
// tieBand of each other are a tie. Any difference in load is real and
// compared strictly: that keeps weights exact and lets one more request in
// flight count in full.
func (c cost) beats(o cost) bool {
	if c.load == o.load {
		return c.latency*(1+tieBand) < o.latency
	}
	return c.load*c.latency < o.load*o.latency
}

// tieBand is the relative difference in latency, at equal load, below
// which two upstreams count as equally fast. Measured on loopback backends
// of equal speed, single peaks keep estimates 20–30% apart for seconds;
// a degraded upstream is several times slower. Half is well clear of both.
const tieBand = 0.5

// drawTries bounds how many random draws are spent looking for a usable
// member before falling back to a full scan.
const drawTries = 4

// chooseBestOfK draws k members at random (distinct for k = 2, the common
// case) and returns the index of the cheapest usable one, or -1 if the pool
// has no usable member. It is O(k) when most members are usable; when draws
// keep hitting unusable members it scans, which is exact and happens only
// when much of the pool is down.
func chooseBestOfK[C candidates](c C, k int) int {
	n := c.Len()
	if n == 0 {
		return -1
	}
	if k >= n {
		return chooseScan(c)
	}
	best, bestCost := -1, cost{}
	for range k {
		i := drawUsable(c, n, best)
		if i < 0 {
			if best < 0 {
				return chooseScan(c)
			}
			break
		}
		// draws come in random order, so keeping the first of near-equal
		// candidates is a random tie-break
		if ci := c.Cost(i); best < 0 || ci.beats(bestCost) {
			best, bestCost = i, ci
		}
	}
	return best
}

// drawUsable returns a random usable index other than not (-1 excludes
// nothing), or -1 after drawTries misses.
func drawUsable[C candidates](c C, n, not int) int {
	for range drawTries {
		var i int
		if not < 0 {
			i = rand.IntN(n)
		} else if i = rand.IntN(n - 1); i >= not {
			i++ // draw from the others, so two draws always differ
		}
		if c.Usable(i) {
			return i
		}
	}
	return -1
}

// chooseScan returns the index of a cheapest usable member, or -1 if none
// is usable: a cheapest cost is found first, then one member is chosen
// uniformly at random among those it does not beat (see cost.beats), so an
// idle or evenly loaded pool is spread, not served by its first or
// marginally fastest member.
func chooseScan[C candidates](c C) int {
	cheapest, minCost := -1, cost{}
	for i := range c.Len() {
		if !c.Usable(i) {
			continue
		}
		if ci := c.Cost(i); cheapest < 0 || ci.beats(minCost) {
			cheapest, minCost = i, ci
		}
	}
	if cheapest < 0 {
		return -1
	}
	best, ties := -1, 0
	for i := range c.Len() {
		if !c.Usable(i) || minCost.beats(c.Cost(i)) {
			continue
		}
		ties++
		if rand.IntN(ties) == 0 {
			best = i
		}
	}
	if best < 0 {
		// Costs moved between the passes (requests started or finished
		// concurrently): keep the first pass's answer.
		return cheapest
	}
	return best
}
