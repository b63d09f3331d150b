// Package liveset keeps a module's provisioned instances for its admin
// view: an instance joins when provisioned and leaves in Cleanup, and the
// view lists them in the order they joined, the same on every request.
package liveset

import (
	"cmp"
	"slices"
	"sync"
)

// Set is a set of live instances, safe for concurrent use. The zero value
// is empty and ready.
type Set[T comparable] struct {
	mu  sync.Mutex
	m   map[T]uint64 // instance → when it joined
	seq uint64
}

// Add adds v; adding it again keeps its place.
func (s *Set[T]) Add(v T) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[T]uint64{}
	}
	if _, ok := s.m[v]; !ok {
		s.seq++
		s.m[v] = s.seq
	}
}

// Remove removes v, if present.
func (s *Set[T]) Remove(v T) {
	s.mu.Lock()
	delete(s.m, v)
	s.mu.Unlock()
}

// All returns the instances in the order they were added.
func (s *Set[T]) All() []T {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]T, 0, len(s.m))
	for v := range s.m {
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b T) int { return cmp.Compare(s.m[a], s.m[b]) })
	return out
}
