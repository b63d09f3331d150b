package shedsim

import (
	"fmt"
	"math/rand/v2"
	"slices"
)

// Balancer is how the outer load balancer places a client that
// reconnects.
type Balancer int

const (
	// Random gives every new connection to a node chosen uniformly at
	// random among all of them (IdealSheds' balancer).
	Random Balancer = iota
	// LeastConn gives every new connection to the node holding the fewest,
	// ties broken at random.
	LeastConn
	// RoundRobin gives new connections to the nodes in turn, starting at a
	// random one (HAProxy's balance roundrobin with equal weights, whose
	// place in the rotation when the rebalancing starts is unknown).
	RoundRobin
)

// String returns the balancer's name as the benchmark command spells it.
func (b Balancer) String() string {
	switch b {
	case Random:
		return "random"
	case LeastConn:
		return "leastconn"
	case RoundRobin:
		return "roundrobin"
	}
	return fmt.Sprintf("balancer(%d)", int(b))
}

// IdealShedsFor is IdealSheds for any balancer: the median, over runs
// simulations, of the connections the perfect rebalancer sheds, taking
// O(log nodes) per shed (IdealSheds and Sheds are this simulation behind
// Random). With LeastConn every shed client reconnects to the node
// holding the fewest connections at that moment (ties at random), so the
// perfect rebalancer sheds about the connections that must move and no
// more. With RoundRobin the shed clients go round the nodes, old ones
// included, so it sheds about as many as behind Random but scatters less.
func IdealShedsFor(counts []int, threshold float64, runs int, seed uint64, lb Balancer) float64 {
	return median(ShedsFor(counts, threshold, runs, seed, lb))
}

// ShedsFor is Sheds behind lb: the shed counts of runs simulations,
// sorted, for a caller that reads quantiles; nil when there are no counts
// or no runs.
func ShedsFor(counts []int, threshold float64, runs int, seed uint64, lb Balancer) []int {
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
	f := newFleet(len(counts))
	for r := range runs {
		f.reset(counts, lo)
		shed := 0
		next := 0 // RoundRobin's next node
		if lb == RoundRobin {
			next = rng.IntN(len(counts))
		}
		// The loop ends: every shed moves a client toward the band (behind
		// Random with probability 1); the cap only guards against a band
		// too narrow for whole connections.
		for limit := 1000 * (total + 1); shed < limit; shed++ {
			most := f.heap[0]
			if float64(f.counts[most]) <= hi && f.below == 0 {
				break
			}
			f.add(most, -1, lo)
			var to int
			switch lb {
			case LeastConn:
				to = f.least(rng)
			case RoundRobin:
				to, next = next, (next+1)%len(counts)
			default:
				to = rng.IntN(len(counts))
			}
			f.add(to, 1, lo)
		}
		results[r] = shed
	}
	slices.Sort(results)
	return results
}

// fleet is the perfect rebalancer's state: the counts, a max-heap of the
// nodes by count (then lowest index first), and the nodes grouped by
// count for the least-connections balancer.
type fleet struct {
	counts []int
	heap   []int // node indexes; heap[0] holds the most
	pos    []int // a node's place in heap
	// below is the number of nodes under the band's low line.
	below int
	// byCount[c] holds the nodes with c connections, at[i] node i's place
	// in its group; min is a count at or below the fewest held.
	byCount [][]int
	at      []int
	min     int
}

// newFleet returns a fleet of n nodes, to be reset before use.
func newFleet(n int) *fleet {
	return &fleet{counts: make([]int, n), heap: make([]int, n), pos: make([]int, n), at: make([]int, n)}
}

// reset loads counts.
func (f *fleet) reset(counts []int, lo float64) {
	copy(f.counts, counts)
	f.below = 0
	for i := range f.heap {
		f.heap[i], f.pos[i] = i, i
		if float64(counts[i]) < lo {
			f.below++
		}
	}
	for i := len(f.heap)/2 - 1; i >= 0; i-- {
		f.down(i)
	}
	for c := range f.byCount {
		f.byCount[c] = f.byCount[c][:0]
	}
	f.min = 0
	for i, c := range counts {
		f.join(i, c)
	}
}

// add changes node i's count by delta (±1).
func (f *fleet) add(i, delta int, lo float64) {
	old := f.counts[i]
	f.leave(i, old)
	f.counts[i] = old + delta
	f.join(i, old+delta)
	wasBelow, isBelow := float64(old) < lo, float64(old+delta) < lo
	switch {
	case wasBelow && !isBelow:
		f.below--
	case !wasBelow && isBelow:
		f.below++
	}
	if delta > 0 {
		f.up(f.pos[i])
	} else {
		f.down(f.pos[i])
	}
}

// least returns a node holding the fewest connections, ties at random.
func (f *fleet) least(rng *rand.Rand) int {
	for len(f.byCount[f.min]) == 0 {
		f.min++
	}
	g := f.byCount[f.min]
	return g[rng.IntN(len(g))]
}

// join puts node i in the group of count c.
func (f *fleet) join(i, c int) {
	for len(f.byCount) <= c {
		f.byCount = append(f.byCount, nil)
	}
	f.at[i] = len(f.byCount[c])
	f.byCount[c] = append(f.byCount[c], i)
	f.min = min(f.min, c)
}

// leave takes node i out of the group of count c.
func (f *fleet) leave(i, c int) {
	g := f.byCount[c]
	last := g[len(g)-1]
	g[f.at[i]], f.at[last] = last, f.at[i]
	f.byCount[c] = g[:len(g)-1]
}

// before orders the heap: more connections first, then the lower index.
func (f *fleet) before(a, b int) bool {
	ca, cb := f.counts[a], f.counts[b]
	return ca > cb || ca == cb && a < b
}

// swap exchanges heap places i and j.
func (f *fleet) swap(i, j int) {
	f.heap[i], f.heap[j] = f.heap[j], f.heap[i]
	f.pos[f.heap[i]], f.pos[f.heap[j]] = i, j
}

// up moves heap place i toward the top while it goes before its parent.
func (f *fleet) up(i int) {
	for i > 0 {
		parent := (i - 1) / 2
		if !f.before(f.heap[i], f.heap[parent]) {
			return
		}
		f.swap(i, parent)
		i = parent
	}
}

// down moves heap place i toward the leaves while a child goes before it.
func (f *fleet) down(i int) {
	n := len(f.heap)
	for {
		first := i
		if l := 2*i + 1; l < n && f.before(f.heap[l], f.heap[first]) {
			first = l
		}
		if r := 2*i + 2; r < n && f.before(f.heap[r], f.heap[first]) {
			first = r
		}
		if first == i {
			return
		}
		f.swap(i, first)
		i = first
	}
}
