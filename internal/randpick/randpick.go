// Package randpick draws random indices for the two-random-choices
// selection policies (lbpolicy's ewma and rebalance's cluster_load).
package randpick

// TwoDistinct maps a random word to two distinct indices in [0, n),
// n ≥ 2, in random order, using each half of the word with a
// multiply-shift (Lemire's reduction; its bias, below n/2³², is
// immaterial here). It does not allocate.
func TwoDistinct(r uint64, n int) (int, int) {
	i := int((r & 0xffffffff) * uint64(n) >> 32)
	j := int((r >> 32) * uint64(n-1) >> 32)
	if j >= i {
		j++
	}
	return i, j
}
