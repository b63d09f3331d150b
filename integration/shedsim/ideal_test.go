package shedsim

import (
	"math"
	"slices"
	"testing"
)

// TestIdealShedsDoubling: 3 nodes of 1000 and 3 empty ones. The new nodes
// must reach 0.8 × 500 = 400 each (1200 in all), and a shed client lands
// on one of them with probability 1/2, so about 2400 sheds at the very
// least, a little more for the last node to cross the line.
func TestIdealShedsDoubling(t *testing.T) {
	got := IdealSheds([]int{1000, 1000, 1000, 0, 0, 0}, 0.2, 101, 1)
	t.Logf("ideal sheds for 3×1000 → 6 nodes: %.0f", got)
	if got < 2300 || got > 2700 {
		t.Errorf("ideal sheds %.0f; want about 2400-2600", got)
	}
}

// TestIdealShedsBalanced: nothing to do when every node is in the band.
func TestIdealShedsBalanced(t *testing.T) {
	if got := IdealSheds([]int{100, 110, 90}, 0.2, 11, 1); got != 0 {
		t.Errorf("balanced fleet: %v sheds; want 0", got)
	}
	if got := IdealSheds(nil, 0.2, 11, 1); got != 0 {
		t.Errorf("no nodes: %v; want 0", got)
	}
}

// TestIdealShedsAddOne: 10 nodes of 1000 and one empty. The new node needs
// 0.8 × 909 ≈ 727 connections and gets one shed client in 11: ≈ 8000.
func TestIdealShedsAddOne(t *testing.T) {
	counts := []int{1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 0}
	got := IdealSheds(counts, 0.2, 51, 2)
	want := 11 * 0.8 * 10000 / 11
	t.Logf("ideal sheds for 10×1000 → 11 nodes: %.0f (≈ %.0f expected)", got, want)
	if math.Abs(got-want)/want > 0.1 {
		t.Errorf("ideal sheds %.0f; want within 10%% of %.0f", got, want)
	}
	// Same seed, same answer.
	if again := IdealSheds(counts, 0.2, 51, 2); again != got {
		t.Errorf("not reproducible: %v then %v", got, again)
	}
}

// TestShedsSpread: Sheds is sorted, its median is IdealSheds, and a
// perfect rebalancer's count scatters more, relatively, with fewer
// connections (the random reconnections): the reason a bound on one run
// takes a high quantile rather than the median.
func TestShedsSpread(t *testing.T) {
	spread := func(counts []int) float64 {
		s := Sheds(counts, 0.2, 201, 1)
		if !slices.IsSorted(s) {
			t.Fatalf("Sheds(%v) is not sorted", counts)
		}
		if med := IdealSheds(counts, 0.2, 201, 1); float64(s[100]) != med {
			t.Errorf("Sheds(%v)[100] = %d; IdealSheds %v", counts, s[100], med)
		}
		r := float64(s[198]) / float64(s[100])
		t.Logf("%v: median %d, p99 %d (%.2f×)", counts, s[100], s[198], r)
		return r
	}
	small, large := spread([]int{145, 126, 129, 0, 0, 0}), spread([]int{1000, 1000, 1000, 0, 0, 0})
	if small <= large || large < 1 {
		t.Errorf("p99/median %.2f with 400 connections, %.2f with 3000; want the smaller fleet to scatter more", small, large)
	}
	if Sheds(nil, 0.2, 3, 1) != nil || Sheds([]int{1}, 0.2, 0, 1) != nil {
		t.Error("Sheds of no counts or no runs is not nil")
	}
}
