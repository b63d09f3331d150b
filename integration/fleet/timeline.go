package fleet

import (
	"slices"
	"strings"
	"sync"
	"time"
)

// Timeline is every node's held connections over time, sampled, with
// marks for what happened (nodes joined, a reload, a kill). It is safe for
// concurrent use.
type Timeline struct {
	mu      sync.Mutex
	start   time.Time
	samples []Sample
	marks   []Mark
	names   []string // every node sampled
}

// Sample is every live node's held connections at one moment.
type Sample struct {
	// T is the time since the timeline started.
	T time.Duration
	// Held maps a node's name to the connections it holds.
	Held map[string]int
}

// Mark is an event on the timeline.
type Mark struct {
	T     time.Duration
	Label string
}

// NewTimeline starts a timeline now.
func NewTimeline() *Timeline { return &Timeline{start: time.Now()} }

// Add records a sample taken now.
func (tl *Timeline) Add(held map[string]int) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for name := range held {
		known := false
		for _, n := range tl.names {
			known = known || n == name
		}
		if !known {
			tl.names = append(tl.names, name)
		}
	}
	tl.samples = append(tl.samples, Sample{T: time.Since(tl.start), Held: held})
}

// Mark records an event now.
func (tl *Timeline) Mark(label string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.marks = append(tl.marks, Mark{T: time.Since(tl.start), Label: label})
}

// Data returns copies of the samples, the marks and the node names, the
// names in natural order (n2 before n10).
func (tl *Timeline) Data() ([]Sample, []Mark, []string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	names := slices.Clone(tl.names)
	slices.SortFunc(names, func(a, b string) int {
		if len(a) != len(b) {
			return len(a) - len(b)
		}
		return strings.Compare(a, b)
	})
	return slices.Clone(tl.samples), slices.Clone(tl.marks), names
}
