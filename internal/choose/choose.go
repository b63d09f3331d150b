// Package choose holds lbx's choosing algorithms: how the expected cost
// of sending one more request to each member of a pool is compared, and
// how a member is chosen by a scan or by the best of k random draws. lb_policy
// ewma chooses upstreams with them, and the selective handler groups.
package choose

import "math/rand/v2"

// Candidates is what the choosing algorithms see of a pool: how many
// members it has, whether member i may be chosen right now, and what
// sending one more request to it is expected to cost. Keeping it abstract
// keeps the algorithms testable without Caddy.
type Candidates interface {
	Len() int
	Usable(i int) bool
	Cost(i int) Cost
}

// Cost is what one more request to an upstream is expected to cost, in
// its factors.
type Cost struct {
	// Queue is the queue the request joins: requests in flight + 1.
	Queue float64
	// InvWeight is the inverse of the upstream's weight (or capacity).
	InvWeight float64
	// Latency is the latency the upstream is expected to serve at.
	Latency float64
	// Busy is how long the upstream has been working without finishing
	// anything (0 when idle): between equal queues of equally fast
	// upstreams, the one furthest into its current work frees up first.
	Busy float64
}

// Beats reports whether c is clearly cheaper than o: whether its queue,
// relative to o's, is shorter than its advantage in speed and size.
//
// Latency estimates of equally fast upstreams differ by noise (a slow
// answer here, a GC pause there); acting on that noise would pile requests
// onto whichever upstream measured a few percent faster, and do worse than
// least-connections. So the first TieBand of a difference in latency does
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
func (c Cost) Beats(o Cost) bool {
	const k = 1 + TieBand
	if c.InvWeight == o.InvWeight {
		// the common case, without a division
		switch {
		case c.Latency*k < o.Latency: // c clearly faster
			return c.Queue*c.Latency*k < o.Queue*o.Latency
		case o.Latency*k < c.Latency: // c clearly slower
			return c.Queue*c.Latency < o.Queue*o.Latency*k
		case c.Queue != o.Queue:
			return c.Queue < o.Queue
		default:
			return c.Busy > o.Busy
		}
	}
	speed := 1.0 // how many times faster c counts as serving than o
	switch {
	case c.Latency*k < o.Latency:
		speed = o.Latency / (c.Latency * k)
	case o.Latency*k < c.Latency:
		speed = o.Latency * k / c.Latency
	}
	size := o.InvWeight / c.InvWeight // how many times bigger c is configured
	var adv float64
	switch {
	case speed >= 1 && size >= 1:
		adv = max(speed, size)
	case speed <= 1 && size <= 1:
		adv = min(speed, size)
	default:
		adv = speed * size
	}
	return c.Queue < o.Queue*adv
}

// CostOf is the cost of one more request to an upstream with inFlight
// requests in flight, the inverse of its weight, the Latency it is
// expected to serve at and how long it has been Busy (hoststate.Table.Judge).
func CostOf(inFlight int, invWeight, latency, busy float64) Cost {
	return Cost{Queue: float64(inFlight + 1), InvWeight: invWeight, Latency: latency, Busy: busy}
}

// TieBand is the relative difference in Latency below which two upstreams
// count as equally fast, and which is discounted from any larger one.
// Measured on loopback backends of equal speed, the medians of recent
// answers stay within 20–30% of each other; a degraded upstream is several
// times slower, a machine half the size twice.
const TieBand = 0.5

// drawTries bounds how many random draws are spent looking for a usable
// member before falling back to a full scan.
const drawTries = 4

// ChooseBestOfK draws k members at random (distinct for k = 2, the common
// case) and returns the index of the cheapest usable one, or -1 if the pool
// has no usable member. It is O(k) when most members are usable; when draws
// keep hitting unusable members it scans, which is exact and happens only
// when much of the pool is down.
func ChooseBestOfK[C Candidates](c C, k int) int {
	i, _ := BestOfK(c, k)
	return i
}

// BestOfK is ChooseBestOfK that also returns the cost of its choice (the
// zero Cost with -1).
func BestOfK[C Candidates](c C, k int) (int, Cost) {
	n := c.Len()
	if n == 0 {
		return -1, Cost{}
	}
	if k >= n {
		i := Cheapest(c)
		if i < 0 {
			return -1, Cost{}
		}
		return i, c.Cost(i)
	}
	best, bestCost := -1, Cost{}
	for range k {
		i := drawUsable(c, n, best)
		if i < 0 {
			if best < 0 {
				if i = Cheapest(c); i < 0 {
					return -1, Cost{}
				}
				return i, c.Cost(i)
			}
			break
		}
		// draws come in random order, so keeping the first of near-equal
		// candidates is a random tie-break
		if ci := c.Cost(i); best < 0 || ci.Beats(bestCost) {
			best, bestCost = i, ci
		}
	}
	return best, bestCost
}

// SecondLook gives a sampled choice i of cost ci (of k random candidates) one more
// draw of k when i is clearly slower than the pool's typical Latency base,
// and returns the better of the two. With two choices among n upstreams of
// which d are degraded, both draws land on degraded ones for about
// (d/n)² of the requests — a floor under the tail that no estimate can
// lift; a second look when the first came up bad squares that share again
// at the price of two more candidates, and only then.
func SecondLook[C Candidates](c C, k, i int, ci Cost, base float64) int {
	if i < 0 || !ci.ClearlySlow(base) {
		return i
	}
	if j, cj := BestOfK(c, k); j >= 0 && cj.Beats(ci) {
		return j
	}
	return i
}

// ClearlySlow reports whether c's Latency is outside the tie band above
// the pool's typical Latency base: a choice worth a second look.
func (c Cost) ClearlySlow(base float64) bool { return c.Latency > base*(1+TieBand) }

// drawUsable returns a random usable index other than not (-1 excludes
// nothing), or -1 after drawTries misses.
func drawUsable[C Candidates](c C, n, not int) int {
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

// Cheapest returns the index of a cheapest usable member, or -1 if
// none is usable: a cheapest cost is found first, then one member is chosen
// uniformly at random among those it does not beat (see cost.Beats), so an
// idle or evenly loaded pool is spread, not served by its first or
// marginally fastest member.
func Cheapest[C Candidates](c C) int {
	cheapest, minCost := -1, Cost{}
	for i := range c.Len() {
		if !c.Usable(i) {
			continue
		}
		if ci := c.Cost(i); cheapest < 0 || ci.Beats(minCost) {
			cheapest, minCost = i, ci
		}
	}
	if cheapest < 0 {
		return -1
	}
	best, ties := -1, 0
	for i := range c.Len() {
		if !c.Usable(i) || minCost.Beats(c.Cost(i)) {
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
