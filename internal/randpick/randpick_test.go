package randpick

import (
	"math/rand/v2"
	"testing"
)

func TestTwoDistinct(t *testing.T) {
	for _, n := range []int{2, 3, 7, 1000} {
		seen := make([]int, n)
		for range 20000 {
			i, j := TwoDistinct(rand.Uint64(), n)
			if i == j || i < 0 || j < 0 || i >= n || j >= n {
				t.Fatalf("n=%d: bad pair %d,%d", n, i, j)
			}
			seen[i]++
			seen[j]++
		}
		if n <= 7 {
			for k, c := range seen {
				if want := 40000 / n; c < want*8/10 || c > want*12/10 {
					t.Fatalf("n=%d: index %d drawn %d times, want ≈%d", n, k, c, want)
				}
			}
		}
	}
	// extremes of the random word stay in range
	for _, r := range []uint64{0, ^uint64(0), 0xffffffff, 0xffffffff00000000} {
		i, j := TwoDistinct(r, 3)
		if i == j || i > 2 || j > 2 {
			t.Fatalf("r=%x: bad pair %d,%d", r, i, j)
		}
	}
}
