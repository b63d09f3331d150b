package liveset

import (
	"slices"
	"testing"
)

func TestSet(t *testing.T) {
	var s Set[*int]
	a, b, c := new(int), new(int), new(int)
	if got := s.All(); len(got) != 0 {
		t.Fatalf("empty set: %v", got)
	}
	s.Add(b)
	s.Add(a)
	s.Add(c)
	s.Add(b) // keeps its place
	if got := s.All(); !slices.Equal(got, []*int{b, a, c}) {
		t.Errorf("All: got %v, want b, a, c in the order added", got)
	}
	s.Remove(a)
	s.Remove(a)
	if got := s.All(); !slices.Equal(got, []*int{b, c}) {
		t.Errorf("after Remove(a): %v", got)
	}
}
