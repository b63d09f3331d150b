package lbpolicy

import (
	"slices"
	"strings"
)

// lowest keeps the n values with the smallest keys of those offered to
// it, in a max-heap on the key: a page of a list of hundreds of thousands
// costs O(list × log n) and n slots, where sorting the list would cost
// O(list × log list) and a copy of it.
type lowest[T any] struct {
	n   int
	key func(T) string
	h   []T
}

func newLowest[T any](n int, key func(T) string) *lowest[T] {
	return &lowest[T]{n: n, key: key, h: make([]T, 0, min(n, 1024))}
}

// offer adds x if it is among the n smallest so far.
func (l *lowest[T]) offer(x T) {
	if l.n <= 0 {
		return
	}
	if len(l.h) < l.n {
		l.h = append(l.h, x)
		for i := len(l.h) - 1; i > 0; {
			p := (i - 1) / 2
			if l.key(l.h[p]) >= l.key(l.h[i]) {
				break
			}
			l.h[p], l.h[i] = l.h[i], l.h[p]
			i = p
		}
		return
	}
	if l.key(x) >= l.key(l.h[0]) {
		return
	}
	l.h[0] = x
	for i := 0; ; {
		c := 2*i + 1
		if c >= len(l.h) {
			break
		}
		if c+1 < len(l.h) && l.key(l.h[c+1]) > l.key(l.h[c]) {
			c++
		}
		if l.key(l.h[i]) >= l.key(l.h[c]) {
			break
		}
		l.h[i], l.h[c] = l.h[c], l.h[i]
		i = c
	}
}

// sorted returns the values kept, smallest key first. It reorders l.
func (l *lowest[T]) sorted() []T {
	slices.SortFunc(l.h, func(a, b T) int { return strings.Compare(l.key(a), l.key(b)) })
	return l.h
}
