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

// cost is what one more request to an upstream is expected to cost, in
// its factors: the queue it joins (requests in flight + 1), the inverse of
// the upstream's weight, and the latency it is expected to serve at.
type cost struct {
	queue, invWeight, latency float64
	// busy is how long the upstream has been working without finishing
	// anything (0 when idle): between equal queues of equally fast
	// upstreams, the one furthest into its current work frees up first.
	busy float64
}

// beats reports whether c is clearly cheaper than o: whether its queue,
// relative to o's, is shorter than its advantage in speed and size.
//
// Latency estimates of equally fast upstreams differ by noise (a slow
// answer here, a GC pause there); acting on that noise would pile requests
// onto whichever upstream measured a few percent faster, and do worse than
// least-connections. So the first tieBand of a difference in latency does
// not count: upstreams within it of each other are equally fast, and
// between those the queues alone decide, divided by the weights — exactly
// weighted least-connections. Only the part of a difference beyond the band
// is weighed against the queue: an upstream measured 3× faster counts as
// 2× (3 ÷ 1.5), one 10× faster as 6.7×. The advantage grows smoothly from
// the band's edge, so two upstreams measured near it do not flip between
// least-connections and a strong preference as their estimates wander.
//
// A weight and a speed that both favour one upstream are two readings of
// the same capacity — a machine twice the size is configured with weight 2
// and measured faster — so the larger of the two counts, not their
// product, which would count the capacity twice and overload the bigger
// machine. When they disagree, they partly cancel.
func (c cost) beats(o cost) bool {
	const k = 1 + tieBand
	if c.invWeight == o.invWeight {
		// the common case, without a division
		switch {
		case c.latency*k < o.latency: // c clearly faster
			return c.queue*c.latency*k < o.queue*o.latency
		case o.latency*k < c.latency: // c clearly slower
			return c.queue*c.latency < o.queue*o.latency*k
		case c.queue != o.queue:
			return c.queue < o.queue
		default:
			return c.busy > o.busy
		}
	}
	speed := 1.0 // how many times faster c counts as serving than o
	switch {
	case c.latency*k < o.latency:
		speed = o.latency / (c.latency * k)
	case o.latency*k < c.latency:
		speed = o.latency * k / c.latency
	}
	size := o.invWeight / c.invWeight // how many times bigger c is configured
	var adv float64
	switch {
	case speed >= 1 && size >= 1:
		adv = max(speed, size)
	case speed <= 1 && size <= 1:
		adv = min(speed, size)
	default:
		adv = speed * size
	}
	return c.queue < o.queue*adv
}

// costOf is the cost of one more request to an upstream with inFlight
// requests in flight, the inverse of its weight, the latency it is
// expected to serve at and how long it has been busy (hoststate.Table.Judge).
func costOf(inFlight int, invWeight, latency, busy float64) cost {
	return cost{queue: float64(inFlight + 1), invWeight: invWeight, latency: latency, busy: busy}
}

// tieBand is the relative difference in latency below which two upstreams
// count as equally fast, and which is discounted from any larger one.
// Measured on loopback backends of equal speed, the medians of recent
// answers stay within 20–30% of each other; a degraded upstream is several
// times slower, a machine half the size twice.
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
	i, _ := bestOfK(c, k)
	return i
}

// bestOfK is chooseBestOfK that also returns the cost of its choice (the
// zero cost with -1).
func bestOfK[C candidates](c C, k int) (int, cost) {
	n := c.Len()
	if n == 0 {
		return -1, cost{}
	}
	if k >= n {
		i := chooseCheapest(c)
		if i < 0 {
			return -1, cost{}
		}
		return i, c.Cost(i)
	}
	best, bestCost := -1, cost{}
	for range k {
		i := drawUsable(c, n, best)
		if i < 0 {
			if best < 0 {
				if i = chooseCheapest(c); i < 0 {
					return -1, cost{}
				}
				return i, c.Cost(i)
			}
			break
		}
		// draws come in random order, so keeping the first of near-equal
		// candidates is a random tie-break
		if ci := c.Cost(i); best < 0 || ci.beats(bestCost) {
			best, bestCost = i, ci
		}
	}
	return best, bestCost
}

// secondLook gives a sampled choice i of cost ci (of k random candidates) one more
// draw of k when i is clearly slower than the pool's typical latency base,
// and returns the better of the two. With two choices among n upstreams of
// which d are degraded, both draws land on degraded ones for about
// (d/n)² of the requests — a floor under the tail that no estimate can
// lift; a second look when the first came up bad squares that share again
// at the price of two more candidates, and only then.
func secondLook[C candidates](c C, k, i int, ci cost, base float64) int {
	if i < 0 || !ci.clearlySlow(base) {
		return i
	}
	if j, cj := bestOfK(c, k); j >= 0 && cj.beats(ci) {
		return j
	}
	return i
}

// clearlySlow reports whether c's latency is outside the tie band above
// the pool's typical latency base: a choice worth a second look.
func (c cost) clearlySlow(base float64) bool { return c.latency > base*(1+tieBand) }

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

// chooseCheapest returns the index of a cheapest usable member, or -1 if
// none is usable: a cheapest cost is found first, then one member is chosen
// uniformly at random among those it does not beat (see cost.beats), so an
// idle or evenly loaded pool is spread, not served by its first or
// marginally fastest member.
func chooseCheapest[C candidates](c C) int {
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
