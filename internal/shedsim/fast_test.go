package shedsim

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestIdealShedsForMatchesIdealSheds: with the random balancer the fast
// function takes the same draws and sheds from the same node as
// IdealSheds, so on any input the two agree exactly.
func TestIdealShedsForMatchesIdealSheds(t *testing.T) {
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
			want := IdealSheds(counts, 0.2, runs, 3)
			if got := IdealShedsFor(counts, 0.2, runs, 3, Random); got != want {
				t.Errorf("%v, %d runs: IdealShedsFor %v, IdealSheds %v", counts, runs, got, want)
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
