// Package shedsim computes the yardstick for a rebalancer's shed count:
// how many connections a perfect rebalancer would shed behind an outer
// load balancer that gives every new connection to a random node.
package shedsim

import (
	"math/rand/v2"
	"slices"
)

// IdealSheds returns the median, over runs simulations, of the number of
// connections a perfect rebalancer sheds to bring every node within
// ±threshold (0.2 = 20%) of the average: it knows every node's exact
// count, always sheds from the node holding the most, and stops the moment
// every node is within the band. Every shed client reconnects to a node
// chosen uniformly at random among all of them, possibly the one it left,
// which is why even this rebalancer sheds about twice the connections that
// must move when the fleet doubles. counts holds the connections of each
// node at the start, new nodes included (with 0). The runs are seeded from
// seed, so a result can be reproduced.
func IdealSheds(counts []int, threshold float64, runs int, seed uint64) float64 {
	results := Sheds(counts, threshold, runs, seed)
	if len(results) == 0 {
		return 0
	}
	if runs%2 == 1 {
		return float64(results[runs/2])
	}
	return float64(results[runs/2-1]+results[runs/2]) / 2
}

// Sheds returns the shed counts of runs simulations of the perfect
// rebalancer that IdealSheds describes, sorted, so that a caller can read
// any quantile: with a few hundred connections a perfect rebalancer's
// count itself scatters by ±15% or more between runs (the random
// reconnections), and a bound on one run must allow for that. It returns
// nil when there are no counts or no runs.
func Sheds(counts []int, threshold float64, runs int, seed uint64) []int {
	if len(counts) == 0 || runs <= 0 {
		return nil
	}
	total := 0
	for _, c := range counts {
		total += c
	}
	avg := float64(total) / float64(len(counts))
	lo, hi := avg*(1-threshold), avg*(1+threshold)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	results := make([]int, runs)
	nodes := make([]int, len(counts))
	for r := range runs {
		copy(nodes, counts)
		shed := 0
		// The loop ends: every shed moves a client to a uniformly random
		// node, so the counts reach the band with probability 1; the cap
		// only guards against a band too narrow for whole connections.
		for limit := 1000 * (total + 1); shed < limit; shed++ {
			most, least := 0, 0
			for i, c := range nodes {
				if c > nodes[most] {
					most = i
				}
				if c < nodes[least] {
					least = i
				}
			}
			if float64(nodes[most]) <= hi && float64(nodes[least]) >= lo {
				break
			}
			nodes[most]--
			nodes[rng.IntN(len(nodes))]++
		}
		results[r] = shed
	}
	slices.Sort(results)
	return results
}
