package selective

import (
	"math"
	"math/rand/v2"

	"github.com/cespare/xxhash/v2"

	"github.com/caddy-lbx/lbx/internal/choose"
)

// choiceView is what one choice sees of the groups: which may be chosen,
// and the capacity and usable share of each. It is built per choice, on
// the stack.
type choiceView struct {
	n        int
	eligible [maxGroups]bool    // not excluded, and usable (or nothing is)
	capacity [maxGroups]float64 // usable upstreams × weight, > 0 when eligible
	share    [maxGroups]float64 // usable upstreams ÷ upstreams, for failover
}

// choiceView builds the choiceView of the groups this attempt may go to:
// excluded(i) leaves group i out. Groups with nothing usable, or in their
// failure cooldown, are left out too, unless no other group is left: then
// every group not excluded is eligible, as a pool in panic would be.
func (h *Handler) choiceView(now int64, excluded func(int) bool) (v choiceView, any bool) {
	v.n = len(h.groups)
	some := false
	for i, g := range h.groups {
		if excluded(i) {
			continue
		}
		usable, total := g.capacity(now)
		if g.failingNow(now) {
			usable = 0
		}
		v.capacity[i] = usable * g.weight
		if total > 0 {
			v.share[i] = usable / total
		}
		if usable > 0 {
			v.eligible[i] = true
			some = true
		}
	}
	if some {
		return v, true
	}
	for i, g := range h.groups {
		if !excluded(i) {
			v.eligible[i], v.capacity[i], v.share[i] = true, g.weight, 1
			some = true
		}
	}
	return v, some
}

// pick chooses a group for an attempt of c, leaving out the groups
// excluded says; -1 when every group is excluded.
func (h *Handler) pick(c *call, now int64, excluded func(int) bool) int {
	v, ok := h.choiceView(now, excluded)
	if !ok {
		return -1
	}
	switch h.Policy.name() {
	case policyWeighted:
		return v.weighted(rand.Float64())
	case policyHash:
		if key := c.hashKey(); key != "" {
			return h.rendezvous(&v, key)
		}
	case policyFailover:
		return v.failover(h.Policy.threshold()/100, rand.Float64())
	}
	return h.cheapest(&v, now)
}

// cheapest is the latency policy: the group of lowest expected cost, with
// lb_policy least_time's estimator and comparison (see choose.Cost.Beats), the
// capacity standing for the weight.
func (h *Handler) cheapest(v *choiceView, now int64) int {
	return choose.Cheapest(groupCandidates{h: h, v: v, now: now, base: h.table.Baseline()})
}

// groupCandidates presents the groups to choose.Cheapest.
type groupCandidates struct {
	h    *Handler
	v    *choiceView
	now  int64
	base float64
}

func (c groupCandidates) Len() int          { return c.v.n }
func (c groupCandidates) Usable(i int) bool { return c.v.eligible[i] }
func (c groupCandidates) Cost(i int) choose.Cost {
	st := c.h.groups[i].state
	latency, busy := c.h.table.Judge(st.stats, c.now, c.base)
	return choose.CostOf(int(st.inFlight.Load()), 1/c.v.capacity[i], latency, busy)
}

// weighted draws an eligible group in proportion to its capacity; r is
// uniform in [0, 1).
func (v *choiceView) weighted(r float64) int {
	var sum float64
	for i := range v.n {
		if v.eligible[i] {
			sum += v.capacity[i]
		}
	}
	return v.draw(func(i int) float64 { return v.capacity[i] }, sum, r)
}

// draw returns the eligible group at which r × sum falls when the groups'
// amounts (by amount) are laid end to end, or the last eligible one when
// rounding leaves r past the end.
func (v *choiceView) draw(amount func(int) float64, sum, r float64) int {
	x := r * sum
	last := -1
	for i := range v.n {
		if !v.eligible[i] {
			continue
		}
		last = i
		if a := amount(i); a > 0 {
			if x < a {
				return i
			}
			x -= a
		}
	}
	return last
}

// failover lays the eligible groups out as priorities, in order: each
// takes the traffic left to it up to its usable share divided by
// threshold (a fraction), and the rest spills to the next. When the
// groups together cannot take all of it, their loads are scaled up to
// add to one (Envoy's normalisation when the total health is below 100%).
func (v *choiceView) failover(threshold, r float64) int {
	var load [maxGroups]float64
	left := 1.0
	for i := range v.n {
		if !v.eligible[i] || left <= 0 {
			continue
		}
		load[i] = min(left, v.share[i]/threshold)
		left -= load[i]
	}
	return v.draw(func(i int) float64 { return load[i] }, 1-max(left, 0), r)
}

// rendezvous is the hash policy: weighted rendezvous hashing (highest
// random weight) of key over the eligible groups. A key keeps its group
// while that group is eligible, and a group's keys move only when it is
// not, each to its own next choice, so they spread over the other groups
// in proportion to their weights instead of landing on one neighbour.
func (h *Handler) rendezvous(v *choiceView, key string) int {
	k := xxhash.Sum64String(key)
	best, bestScore := -1, math.Inf(-1)
	for i, g := range h.groups {
		if !v.eligible[i] {
			continue
		}
		if s := rendezvousScore(k, g.nameHash, g.weight); s > bestScore {
			best, bestScore = i, s
		}
	}
	return best
}

// rendezvousScore is the weighted rendezvous score of a key on a group,
// from their hashes: -weight / ln(u), with u uniform in (0, 1) from the
// two mixed. The hashes are the same in every process (xxhash), so every
// Caddy node sends a key to the same group.
func rendezvousScore(key, name uint64, weight float64) float64 {
	u := (float64(mix64(key^name)>>11) + 0.5) / (1 << 53)
	return -weight / math.Log(u)
}

// mix64 is the SplitMix64 finalizer: it spreads every input bit over the
// output, so keys that differ in one bit score independently.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
