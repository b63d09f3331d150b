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
	Cost(i int) float64
}

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
	best, bestCost := -1, 0.0
	for range k {
		i := drawUsable(c, n, best)
		if i < 0 {
			if best < 0 {
				return chooseScan(c)
			}
			break
		}
		if cost := c.Cost(i); best < 0 || cost < bestCost {
			best, bestCost = i, cost
		}
	}
	return best
}

// twoDistinct maps a random word to two distinct indices in [0, n), n ≥ 2,
// using each half of the word with a multiply-shift (Lemire's reduction;
// its bias, below n/2³², is immaterial here).
func twoDistinct(r uint64, n int) (int, int) {
	i := int((r & 0xffffffff) * uint64(n) >> 32)
	j := int((r >> 32) * uint64(n-1) >> 32)
	if j >= i {
		j++
	}
	return i, j
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

// chooseScan returns the index of the cheapest usable member, or -1 if none
// is usable. Exact ties (common while nothing has been measured yet) are
// broken uniformly at random, so an idle pool is not always served by its
// first member.
func chooseScan[C candidates](c C) int {
	best, bestCost, ties := -1, 0.0, 0
	for i := range c.Len() {
		if !c.Usable(i) {
			continue
		}
		cost := c.Cost(i)
		switch {
		case best < 0 || cost < bestCost:
			best, bestCost, ties = i, cost, 1
		case cost == bestCost:
			ties++
			if rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}
