package fleet

import "testing"

// TestShedSince: the sheds between two snapshots count each node's own
// process: a node absent from the later one (drained) adds nothing, one
// restarted in between (its count back below the earlier one) counts all
// it shed since, and one new in the later one counts whole.
func TestShedSince(t *testing.T) {
	a, b, c, d := &Node{Name: "a"}, &Node{Name: "b"}, &Node{Name: "c"}, &Node{Name: "d"}
	view := func(idle, active int) View {
		var v View
		v.ShedTotal.Idle, v.ShedTotal.Active = idle, active
		return v
	}
	from := Snapshot{Nodes: []*Node{a, b, c}, Views: []View{view(10, 5), view(100, 0), view(7, 0)}}
	to := Snapshot{Nodes: []*Node{a, b, d}, Views: []View{view(12, 6), view(4, 0), view(3, 0)}}
	// a: 18 - 15 = 3; b restarted: 4; c drained: 0; d new: 3.
	if got := shedSince(from, to); got != 10 {
		t.Errorf("shedSince = %d; want 10", got)
	}
	if got := heldBy(from, "x"); got != 0 {
		t.Errorf("heldBy of a node not in the snapshot = %d; want 0", got)
	}
}
