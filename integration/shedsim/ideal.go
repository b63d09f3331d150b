// Package shedsim computes the yardstick for a rebalancer's shed count:
// how many connections a perfect rebalancer would shed behind an outer
// load balancer that gives every new connection to a random node, to the
// node holding the fewest, or to the nodes in turn (IdealShedsFor).
package shedsim

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
	return median(Sheds(counts, threshold, runs, seed))
}

// Sheds returns the shed counts of runs simulations of the perfect
// rebalancer that IdealSheds describes, sorted, so that a caller can read
// any quantile: with a few hundred connections a perfect rebalancer's
// count itself scatters by ±15% or more between runs (the random
// reconnections), and a bound on one run must allow for that. It returns
// nil when there are no counts or no runs.
func Sheds(counts []int, threshold float64, runs int, seed uint64) []int {
	return ShedsFor(counts, threshold, runs, seed, Random)
}

// median returns the median of sorted (the mean of the middle two for an
// even count), or 0 for none.
func median(sorted []int) float64 {
	n := len(sorted)
	switch {
	case n == 0:
		return 0
	case n%2 == 1:
		return float64(sorted[n/2])
	}
	return float64(sorted[n/2-1]+sorted[n/2]) / 2
}
