package lbpolicy

import (
	"slices"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// firstN keeps the n values that come first, by before, of those offered
// to it, in a heap whose root is the last of them: choosing a page of a
// list of hundreds of thousands, or its worst few, costs O(list × log n)
// and n slots, where sorting the list would cost O(list × log list) and a
// copy of it.
type firstN[T any] struct {
	n      int
	before func(a, b T) bool // a comes before b
	h      []T
}

func newFirstN[T any](n int, before func(a, b T) bool) *firstN[T] {
	return &firstN[T]{n: n, before: before, h: make([]T, 0, min(n, 1024))}
}

// byDial and statsByDial order upstreams by dial address, for firstN.
func byDial(a, b string) bool { return a < b }

func statsByDial(a, b *hoststate.Stats) bool { return a.Dial() < b.Dial() }

// offer adds x if it is among the first n so far.
func (l *firstN[T]) offer(x T) {
	if l.n <= 0 {
		return
	}
	if len(l.h) < l.n {
		l.h = append(l.h, x)
		for i := len(l.h) - 1; i > 0; {
			p := (i - 1) / 2
			if !l.before(l.h[p], l.h[i]) {
				break
			}
			l.h[p], l.h[i] = l.h[i], l.h[p]
			i = p
		}
		return
	}
	if !l.before(x, l.h[0]) {
		return
	}
	l.h[0] = x
	for i := 0; ; {
		c := 2*i + 1
		if c >= len(l.h) {
			break
		}
		if c+1 < len(l.h) && l.before(l.h[c], l.h[c+1]) {
			c++
		}
		if !l.before(l.h[i], l.h[c]) {
			break
		}
		l.h[i], l.h[c] = l.h[c], l.h[i]
		i = c
	}
}

// sorted returns the values kept, first first. It reorders l.
func (l *firstN[T]) sorted() []T {
	slices.SortFunc(l.h, func(a, b T) int {
		switch {
		case l.before(a, b):
			return -1
		case l.before(b, a):
			return 1
		}
		return 0
	})
	return l.h
}
