package shedsim

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// scanSheds is the perfect rebalancer behind a random or round-robin
// balancer written the plain way, a scan of every node per shed: the
// oracle the heap simulation is checked against.
func scanSheds(counts []int, threshold float64, runs int, seed uint64, lb Balancer) []int {
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
		shed, next := 0, 0
		if lb == RoundRobin {
			next = rng.IntN(len(nodes))
		}
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
			if lb == RoundRobin {
				nodes[next]++
				next = (next + 1) % len(nodes)
			} else {
				nodes[rng.IntN(len(nodes))]++
			}
		}
		results[r] = shed
	}
	slices.Sort(results)
	return results
}

// TestShedsMatchesScan: the heap simulation behind Random and RoundRobin
// takes the same draws and sheds from the same node (the lowest index
// among those holding the most) as the plain scan, so on any input the
// two agree exactly, run by run.
func TestShedsMatchesScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	inputs := [][]int{
		{1000, 1000, 1000, 0, 0, 0},
		{100, 110, 90},
		{300, 300, 0},
		{1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 0},
		{5},
	}
	for range 20 {
		c := make([]int, 2+rng.IntN(12))
		for i := range c {
			c[i] = rng.IntN(400)
		}
		inputs = append(inputs, c)
	}
	for _, counts := range inputs {
		for _, runs := range []int{1, 4, 11} {
			want := scanSheds(counts, 0.2, runs, 3, Random)
			if got := Sheds(counts, 0.2, runs, 3); !slices.Equal(got, want) {
				t.Errorf("%v, %d runs: Sheds %v, the scan %v", counts, runs, got, want)
			}
			want = scanSheds(counts, 0.2, runs, 3, RoundRobin)
			if got := ShedsFor(counts, 0.2, runs, 3, RoundRobin); !slices.Equal(got, want) {
				t.Errorf("%v, %d runs: ShedsFor round robin %v, the scan %v", counts, runs, got, want)
			}
			if got, med := IdealShedsFor(counts, 0.2, runs, 3, Random), IdealSheds(counts, 0.2, runs, 3); got != med {
				t.Errorf("%v, %d runs: IdealShedsFor %v, IdealSheds %v", counts, runs, got, med)
			}
		}
	}
	if got := IdealShedsFor(nil, 0.2, 3, 1, Random); got != 0 {
		t.Errorf("no nodes: %v; want 0", got)
	}
}

// TestIdealShedsForLeastConn: behind least-connections every shed client
// lands on the emptiest node, so the perfect rebalancer sheds what must
// move: doubling 3×1000 to 6 nodes needs the new nodes at 0.8 × 500 each,
// 1200 in all, and the old ones at most 1.2 × 500, 300 each: 1200 sheds.
func TestIdealShedsForLeastConn(t *testing.T) {
	got := IdealShedsFor([]int{1000, 1000, 1000, 0, 0, 0}, 0.2, 5, 1, LeastConn)
	if math.Abs(got-1200) > 3 {
		t.Errorf("least-connections ideal for 3×1000 → 6: %v; want about 1200", got)
	}
	// Large fleets take well under a second: 1000 nodes of 1000, doubled.
	counts := make([]int, 2000)
	for i := range 1000 {
		counts[i] = 1000
	}
	r := IdealShedsFor(counts, 0.2, 1, 1, Random)
	l := IdealShedsFor(counts, 0.2, 1, 1, LeastConn)
	t.Logf("1000×1000 → 2000 nodes: random %.0f, least-connections %.0f", r, l)
	if l < 400_000 || l > 410_000 || r < 2*l*0.95 {
		t.Errorf("random %v, least-connections %v; want least-connections about 400,000 and random about twice that", r, l)
	}
}

// TestShedsForRoundRobin: behind round robin the shed clients go to the
// nodes in turn from a random start. {4, 0} (band 1.6–2.4) takes 3
// sheds when the rotation starts at the empty node (to 1, 0, 1) and 4
// when it starts at the full one (0, 1, 0, 1): both, and nothing else,
// over many runs. Doubling 3×1000 to 6 nodes sends half the shed clients
// back to old nodes, as behind Random, so the ideal is about twice
// least-connections' 1200, and it scatters less than Random's.
func TestShedsForRoundRobin(t *testing.T) {
	got := ShedsFor([]int{4, 0}, 0.2, 200, 1, RoundRobin)
	if got[0] != 3 || got[len(got)-1] != 4 {
		t.Errorf("{4, 0} behind round robin: sheds from %d to %d; want 3 and 4", got[0], got[len(got)-1])
	}
	counts := []int{1000, 1000, 1000, 0, 0, 0}
	rr := ShedsFor(counts, 0.2, 201, 1, RoundRobin)
	rnd := Sheds(counts, 0.2, 201, 1)
	t.Logf("3×1000 → 6: round robin %d–%d (median %d), random %d–%d (median %d)", rr[0], rr[200], rr[100], rnd[0], rnd[200], rnd[100])
	if rr[100] < 2200 || rr[100] > 2600 {
		t.Errorf("round-robin ideal for 3×1000 → 6: %d; want about 2400", rr[100])
	}
	if rr[200]-rr[0] >= rnd[200]-rnd[0] {
		t.Errorf("round robin ranges %d–%d, random %d–%d; want round robin's narrower", rr[0], rr[200], rnd[0], rnd[200])
	}
}
