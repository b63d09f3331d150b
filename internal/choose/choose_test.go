package choose

import (
	"math"
	"math/rand/v2"
	"testing"
)

// fakePool is a pool whose costs follow the ewma formula from explicit
// in-flight counts, latencies and weights.
type fakePool struct {
	inflight []int
	latency  []float64
	weight   []float64
	down     []bool
}

func newFakePool(n int) *fakePool {
	p := &fakePool{inflight: make([]int, n), latency: make([]float64, n), weight: make([]float64, n), down: make([]bool, n)}
	for i := range n {
		p.latency[i], p.weight[i] = 1, 1
	}
	return p
}

func (p *fakePool) Len() int          { return len(p.inflight) }
func (p *fakePool) Usable(i int) bool { return !p.down[i] }
func (p *fakePool) Cost(i int) Cost {
	return CostOf(p.inflight[i], 1/p.weight[i], p.latency[i], 0)
}

type chooser func(*fakePool) int

var modes = map[string]chooser{
	"cheapest": func(p *fakePool) int { return Cheapest(p) },
	"choices2": func(p *fakePool) int { return ChooseBestOfK(p, 2) },
	"choices3": func(p *fakePool) int { return ChooseBestOfK(p, 3) },
}

func TestChooseNeverPicksUnusable(t *testing.T) {
	for name, choose := range modes {
		p := newFakePool(8)
		for i := range 8 {
			p.down[i] = i%2 == 0
			p.latency[i] = float64(8 - i) // the down ones are cheapest
		}
		for range 2000 {
			if i := choose(p); i < 0 || p.down[i] {
				t.Fatalf("%s: picked %d (down=%v)", name, i, i >= 0 && p.down[i])
			}
		}
	}
}

func TestChooseNoneUsable(t *testing.T) {
	for name, choose := range modes {
		p := newFakePool(5)
		for i := range 5 {
			p.down[i] = true
		}
		if i := choose(p); i != -1 {
			t.Fatalf("%s: want -1 with every upstream down, got %d", name, i)
		}
		if i := choose(newFakePool(0)); i != -1 {
			t.Fatalf("%s: want -1 for an empty pool, got %d", name, i)
		}
	}
}

func TestChooseFindsLoneSurvivor(t *testing.T) {
	// Random draws almost always miss the one usable member of 100; the
	// fallback scan must still find it every time.
	p := newFakePool(100)
	for i := range 100 {
		p.down[i] = i != 37
	}
	for range 500 {
		if i := ChooseBestOfK(p, 2); i != 37 {
			t.Fatalf("want 37, got %d", i)
		}
	}
}

func TestChooseOneHostPool(t *testing.T) {
	for name, choose := range modes {
		if i := choose(newFakePool(1)); i != 0 {
			t.Fatalf("%s: one-host pool must pick it, got %d", name, i)
		}
	}
}

func TestScanPicksCheapestAndBreaksTiesAtRandom(t *testing.T) {
	p := newFakePool(4)
	p.latency = []float64{5, 1, 1, 9}
	counts := make([]int, 4)
	for range 4000 {
		counts[Cheapest(p)]++
	}
	if counts[0] != 0 || counts[3] != 0 {
		t.Fatalf("scan picked a costlier upstream: %v", counts)
	}
	if counts[1] < 1600 || counts[2] < 1600 {
		t.Fatalf("ties must be broken evenly: %v", counts)
	}
}

func TestBestOfTwoAvoidsSlowHost(t *testing.T) {
	// 1 of 10 hosts is 20x slower: best of two picks it only when both
	// draws are... impossible (distinct draws), so never.
	p := newFakePool(10)
	p.latency[3] = 20
	for range 5000 {
		if ChooseBestOfK(p, 2) == 3 {
			t.Fatal("best of two distinct draws picked the slow host")
		}
	}
}

// TestHerdAvoidance shows why random choices exist: with information that
// does not change between picks (many picks in the window before any
// request is counted in flight), a full scan sends everything to the one
// host that looks clearly cheapest; best of two spreads the burst.
func TestHerdAvoidance(t *testing.T) {
	const n, picks = 10, 5000
	p := newFakePool(n)
	p.latency[0] = 0.5 // clearly cheaper
	counts := make([]int, n)
	for range picks {
		counts[ChooseBestOfK(p, 2)]++
	}
	// host 0 wins whenever it is drawn: P = 1-(9/10)(8/9) = 20%.
	share := float64(counts[0]) / picks
	if share > 0.25 {
		t.Fatalf("best of two herded %.0f%% of a burst onto one host", share*100)
	}
	for i, c := range counts {
		if c == 0 {
			t.Fatalf("host %d never chosen: %v", i, counts)
		}
	}
	for range 100 {
		if Cheapest(p) != 0 {
			t.Fatal("scan should pick the clearly cheapest")
		}
	}
}

// TestWeightsShareUnderLoad simulates a closed system with a fixed number
// of requests in flight: each completion (a random in-flight request, as
// with memoryless service) is replaced by a new pick. Equal latencies, so
// shares must follow the weights.
func TestWeightsShareUnderLoad(t *testing.T) {
	weights := []float64{1, 2, 3, 6}
	for name, choose := range modes {
		t.Run(name, func(t *testing.T) {
			p := newFakePool(len(weights))
			copy(p.weight, weights)
			const concurrency, picks = 120, 60000
			var flight []int
			for range concurrency {
				i := choose(p)
				p.inflight[i]++
				flight = append(flight, i)
			}
			counts := make([]int, len(weights))
			for range picks {
				k := rand.IntN(len(flight))
				p.inflight[flight[k]]--
				i := choose(p)
				p.inflight[i]++
				flight[k] = i
				counts[i]++
			}
			var total float64
			for _, w := range weights {
				total += w
			}
			for i, w := range weights {
				got, want := float64(counts[i])/picks, w/total
				if math.Abs(got-want) > 0.12*want+0.01 {
					t.Errorf("upstream %d (weight %v): share %.3f, want %.3f ±12%%", i, w, got, want)
				}
			}
		})
	}
}

func TestNearTiesAreSpread(t *testing.T) {
	// Four equally fast upstreams whose estimates differ by measurement
	// noise: every mode must spread picks instead of piling onto the
	// marginally fastest one.
	for name, choose := range modes {
		p := newFakePool(4)
		p.latency = []float64{1.00, 1.15, 1.30, 1.45}
		counts := make([]int, 4)
		for range 8000 {
			counts[choose(p)]++
		}
		for i, c := range counts {
			if c < 1200 {
				t.Errorf("%s: upstream %d got %d of 8000 picks: %v", name, i, c, counts)
			}
		}
	}
	// Just outside the band the cheaper one wins outright.
	p := newFakePool(2)
	p.latency = []float64{1, 1.51}
	for range 200 {
		if Cheapest(p) != 0 {
			t.Fatal("an upstream 1.51× faster must win a scan")
		}
	}
}

func TestCostBeats(t *testing.T) {
	// q: queue (in flight + 1) and latency, weight 1
	q := func(queue, latency float64) Cost { return Cost{Queue: queue, InvWeight: 1, Latency: latency} }
	// w: with a weight
	w := func(queue, weight, latency float64) Cost {
		return Cost{Queue: queue, InvWeight: 1 / weight, Latency: latency}
	}
	cases := []struct {
		name string
		a, b Cost
		want bool
	}{
		{"same queue, latency within the band: tie", q(1, 1), q(1, 1.49), false},
		{"same Queue, clearly faster", q(1, 1), q(1, 1.51), true},
		{"same Queue, slower within the band", q(1, 1.49), q(1, 1), false},
		{"within the band the Queue alone decides", q(1, 1.4), q(2, 1), true},
		{"within the band a longer Queue loses", q(3, 1), q(2, 1.4), false},
		// beyond the band only the excess counts: 1.9× faster is 1.27×
		{"outside the band the excess decides: 2 > 1.9 ÷ 1.5", q(2, 1), q(1, 1.9), false},
		{"outside the band: 2 < 3.1 ÷ 1.5", q(2, 1), q(1, 3.1), true},
		{"outside the band: 2 > 2.9 ÷ 1.5", q(2, 1), q(1, 2.9), false},
		{"clearly slower: 1 < 2 × 1.5 ÷ 2", q(1, 2), q(2, 1), true},
		{"weight 2 vs 1 at idle", w(1, 2, 1), w(1, 1, 1), true},
		{"equal queues: further into its work wins", Cost{Queue: 2, InvWeight: 1, Latency: 1, Busy: 0.8}, Cost{Queue: 2, InvWeight: 1, Latency: 1.2, Busy: 0.1}, true},
		{"equal queues: less far loses", Cost{Queue: 2, InvWeight: 1, Latency: 1, Busy: 0.1}, Cost{Queue: 2, InvWeight: 1, Latency: 1, Busy: 0.8}, false},
		{"busy never beats a shorter queue", Cost{Queue: 3, InvWeight: 1, Latency: 1, Busy: 0.9}, Cost{Queue: 2, InvWeight: 1, Latency: 1, Busy: 0}, false},
		{"weighted least-connections within the band: 3/2 > 1/1", w(3, 2, 1), w(1, 1, 1.2), false},
		{"weighted least-connections: 3/2 < 2/1", w(3, 2, 1), w(3, 1, 1.2), true},
		// a machine configured twice the size and measured twice as
		// fast is twice as cheap, not four times
		{"size and speed agree: the larger counts, not the product", w(3, 2, 1), w(1, 1, 2), false},
		{"size and speed agree: Queue 2 vs 1 at 2× Beats", w(2, 2, 1), w(1, 1, 2), false},
		{"size and speed agree: 1.9 < 2", w(1.9, 2, 1), w(1, 1, 2), true},
		{"size and speed disagree: they cancel", w(1.5, 2, 2), w(1, 1, 1), false},
		{"size and speed disagree, size wins by more", w(1, 4, 2), w(1, 1, 1), true},
	}
	for _, c := range cases {
		if got := c.a.Beats(c.b); got != c.want {
			t.Errorf("%s: %+v Beats %+v = %v, want %v", c.name, c.a, c.b, got, c.want)
		}
	}
}

// TestSamplingFloorOfTwoChoices is why ewma's choices auto scans small pools: with
// 2 of 4 upstreams slow, best of two draws both slow ones one time in six,
// however clear the costs; a scan never picks them.
func TestSamplingFloorOfTwoChoices(t *testing.T) {
	p := newFakePool(4)
	p.latency = []float64{1, 1, 10, 10}
	const picks = 30000
	slow := 0
	for range picks {
		if ChooseBestOfK(p, 2) >= 2 {
			slow++
		}
	}
	if share := float64(slow) / picks; share < 0.14 || share > 0.19 {
		t.Fatalf("best of two sent %.3f to the slow pair, want ≈1/6", share)
	}
	for range picks {
		if Cheapest(p) >= 2 {
			t.Fatal("a scan picked a slow upstream")
		}
	}
}
