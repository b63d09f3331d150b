package lbpolicy

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestFirstN: for random lists and sizes, firstN keeps exactly the n
// first values of a full sort, in order, for an ascending and a
// descending order.
func TestFirstN(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		list := make([]int, r.IntN(300))
		for i := range list {
			list[i] = r.IntN(100)
		}
		n := r.IntN(40)
		for _, before := range []func(a, b int) bool{
			func(a, b int) bool { return a < b },
			func(a, b int) bool { return a > b },
		} {
			l := newFirstN(n, before)
			for _, x := range list {
				l.offer(x)
			}
			want := slices.Clone(list)
			slices.SortFunc(want, func(a, b int) int {
				if before(a, b) {
					return -1
				}
				if before(b, a) {
					return 1
				}
				return 0
			})
			want = want[:min(n, len(want))]
			if got := l.sorted(); !slices.Equal(got, want) {
				t.Fatalf("trial %d, n %d: kept %v; want %v", trial, n, got, want)
			}
		}
	}
}
