package shed

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func defaultParams() Params {
	return Params{Threshold: 0.2, ShedRate: 0.005, MinConnections: 50, Freshness: 5 * time.Second}
}

func alive(name string, load float64) Report {
	return Report{Name: name, Status: cluster.StatusAlive, Load: load, At: t0}
}

func TestDecideTable(t *testing.T) {
	p := defaultParams()
	// Two peers at 500 and this node: average with Local x is (1000+x)/3.
	peers := []Report{alive("b", 500), alive("c", 500)}
	tests := []struct {
		name     string
		p        Params
		in       Input
		shed     int
		shedding bool
		reason   string
	}{
		{
			name: "alone never sheds",
			p:    p, in: Input{Self: "a", Local: 1000, Held: 1000, Now: t0},
			reason: "too few fresh members (1 of 2",
		},
		{
			name: "self entry in members is replaced by Local",
			p:    p, in: Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: []Report{alive("a", 0)}},
			reason: "too few fresh members (1 of 2",
		},
		{
			name: "two members suffice",
			p:    p, in: Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: []Report{alive("b", 0)}},
			shed: 5, shedding: true, reason: "shed_rate",
		},
		{
			name:   "min_members 3 with two fresh members",
			p:      Params{Threshold: 0.2, ShedRate: 0.005, Freshness: time.Second, MinMembers: 3},
			in:     Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: []Report{alive("b", 0)}},
			reason: "too few fresh members (2 of 3",
		},
		{
			// average (1000+600)/3 = 533.3; start line 640: 600 is below.
			name: "just below the start line",
			p:    p, in: Input{Self: "a", Local: 600, Held: 600, Now: t0, Members: peers},
			reason: "within the threshold",
		},
		{
			// Local 670: average 556.67, start line 668: above; stop line
			// 612.33, so 58 needed, rate ceil(3.35) = 4.
			name: "just above the start line",
			p:    p, in: Input{Self: "a", Local: 670, Held: 670, Now: t0, Members: peers},
			shed: 4, shedding: true, reason: "shed_rate",
		},
		{
			// Exactly on the start line is not above it: peers 600 and
			// 660, Local 840: average 700, start line 840.
			name: "exactly on the start line does not start",
			p:    p, in: Input{Self: "a", Local: 840, Held: 840, Now: t0, Members: []Report{alive("b", 600), alive("c", 660)}},
			reason: "within the threshold",
		},
		{
			// Shedding, Local 610: average 536.67, stop line 590.33: keep
			// shedding; needed ceil(610-590.33) = 20, rate ceil(3.05) = 4.
			name: "inside the band while shedding keeps shedding",
			p:    p, in: Input{Self: "a", Local: 610, Held: 610, Now: t0, Members: peers, Shedding: true},
			shed: 4, shedding: true, reason: "shed_rate",
		},
		{
			name: "inside the band while not shedding does not start",
			p:    p, in: Input{Self: "a", Local: 610, Held: 610, Now: t0, Members: peers},
			reason: "within the threshold",
		},
		{
			// Shedding, Local 580: average 526.67, stop line 579.33: still
			// above by 0.67 -> needed 1.
			name: "never more than needed to reach the stop band",
			p:    p, in: Input{Self: "a", Local: 580, Held: 580, Now: t0, Members: peers, Shedding: true},
			shed: 1, shedding: true, reason: "down to the stop band",
		},
		{
			// Stop line for Local 578: average 526, stop 578.6: below.
			name: "below the stop line stops",
			p:    p, in: Input{Self: "a", Local: 578, Held: 578, Now: t0, Members: peers, Shedding: true},
			reason: "reached the stop band",
		},
		{
			// Smoothed Local still high, Current already at the stop line.
			name: "sizing uses the current load, not the lagging smoothed one",
			p:    p, in: Input{Self: "a", Local: 1000, Current: 500, Held: 500, Now: t0, Members: []Report{alive("b", 100), alive("c", 100)}, Shedding: true},
			// average 400, stop 440, Held 500 * (1 - 440/500) = 60 -> rate 3
			shed: 3, shedding: true, reason: "shed_rate",
		},
		{
			// average 733.3, stop line 806.7: Local is above, Current
			// below; the lowest, 600, is above the low line 586.7.
			name: "current below the stop line sheds nothing but stays shedding",
			p:    p, in: Input{Self: "a", Local: 1000, Current: 700, Held: 700, Now: t0, Members: []Report{alive("b", 600), alive("c", 600)}, Shedding: true},
			shedding: true, reason: "current load already at the stop band",
		},
		{
			name: "never below min_connections",
			p:    Params{Threshold: 0.2, ShedRate: 0.5, MinConnections: 50, Freshness: time.Second},
			in:   Input{Self: "a", Local: 60, Held: 60, Now: t0, Members: []Report{alive("b", 0), alive("c", 0)}},
			shed: 10, shedding: true, reason: "min_connections",
		},
		{
			name: "at min_connections sheds nothing",
			p:    p, in: Input{Self: "a", Local: 50, Held: 50, Now: t0, Members: []Report{alive("b", 0), alive("c", 0)}},
			shedding: true, reason: "at or below min_connections",
		},
		{
			name: "a small rate still sheds one connection",
			p:    Params{Threshold: 0.2, ShedRate: 0.001, Freshness: time.Second},
			in:   Input{Self: "a", Local: 100, Held: 100, Now: t0, Members: []Report{alive("b", 0)}},
			shed: 1, shedding: true, reason: "shed_rate",
		},
		{
			name: "empty cluster",
			p:    p, in: Input{Self: "a", Local: 0, Held: 0, Now: t0, Members: []Report{alive("b", 0)}},
			reason: "no load in the cluster",
		},
		{
			name: "explicit stop band",
			p:    Params{Threshold: 0.2, StopBand: 0.05, ShedRate: 1, Freshness: time.Second},
			// average 360, stop line 378: needed 122; the lowest, 290, is
			// above the low line 288.
			in:   Input{Self: "a", Local: 500, Held: 500, Now: t0, Members: []Report{alive("b", 290), alive("c", 290)}},
			shed: 122, shedding: true, reason: "down to the stop band",
		},
		{
			name: "throughput metric: sized as a share of the connections",
			p:    Params{Threshold: 0.2, ShedRate: 1, Freshness: time.Second, Metric: "throughput"},
			// bytes/s: average 3.667e6, stop line 4.033e6; 200 connections
			// carry 5e6: shed 200 × (1 − 4.033/5) = 38.7 -> 39.
			in: Input{Self: "a", Local: 5e6, Held: 200, Now: t0, Members: []Report{
				{Name: "b", Status: cluster.StatusAlive, Load: 3e6, At: t0, Metric: "throughput"},
				{Name: "c", Status: cluster.StatusAlive, Load: 3e6, At: t0, Metric: "throughput"},
			}},
			shed: 39, shedding: true, reason: "down to the stop band",
		},
		{
			name: "cpu metric",
			p:    Params{Threshold: 0.2, ShedRate: 1, Freshness: time.Second, Metric: "cpu"},
			// percent: average 66.7, stop line 73.3; 100 connections at
			// 90%: shed 100 × (1 − 73.3/90) = 18.5 -> 19.
			in: Input{Self: "a", Local: 90, Held: 100, Now: t0, Members: []Report{
				{Name: "b", Status: cluster.StatusAlive, Load: 55, At: t0, Metric: "cpu"},
				{Name: "c", Status: cluster.StatusAlive, Load: 55, At: t0, Metric: "cpu"},
			}},
			shed: 19, shedding: true, reason: "down to the stop band",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := Decide(tt.p, tt.in)
			if d.Shed != tt.shed || d.Shedding != tt.shedding || !strings.Contains(d.Reason, tt.reason) {
				t.Errorf("got shed %d shedding %v reason %q (avg %.2f); want shed %d shedding %v reason ~%q",
					d.Shed, d.Shedding, d.Reason, d.Average, tt.shed, tt.shedding, tt.reason)
			}
		})
	}
}

// TestDecideExcludes checks that failed, left, leaving, silent,
// never-reporting and other-metric members are left out of the average,
// and counted by reason.
func TestDecideExcludes(t *testing.T) {
	p := defaultParams()
	p.Metric = "connections"
	members := []Report{
		alive("b", 1000),
		{Name: "failed", Status: cluster.StatusFailed, Load: 0, At: t0},
		{Name: "left", Status: cluster.StatusLeft, Load: 0, At: t0},
		{Name: "leaving", Status: cluster.StatusLeaving, Load: 0, At: t0},
		{Name: "silent", Status: cluster.StatusAlive, Load: 0, At: t0.Add(-6 * time.Second)},
		{Name: "never", Status: cluster.StatusAlive},
		{Name: "cpu", Status: cluster.StatusAlive, Load: 3, At: t0, Metric: "cpu"},
		{Name: "edge", Status: cluster.StatusAlive, Load: 1000, At: t0.Add(-5 * time.Second)}, // exactly Freshness old: counts
	}
	d := Decide(p, Input{Self: "a", Local: 1000, Held: 1000, Members: members, Now: t0})
	if d.Counted != 3 || d.NotAlive != 3 || d.Stale != 2 || d.OtherMetric != 1 {
		t.Errorf("counted %d, not alive %d, stale %d, other metric %d; want 3, 3, 2, 1", d.Counted, d.NotAlive, d.Stale, d.OtherMetric)
	}
	if d.Average != 1000 || d.Shed != 0 || d.Shedding {
		t.Errorf("average %v shed %d shedding %v; want 1000, 0, false", d.Average, d.Shed, d.Shedding)
	}
}

func TestWindow(t *testing.T) {
	w := NewWindow(3)
	if w.Mean() != 0 || w.Len() != 0 {
		t.Fatal("empty window is not 0")
	}
	for i, tc := range []struct{ add, mean float64 }{
		{3, 3}, {6, 4.5}, {9, 6}, {12, 9}, {0, 7}, {0, 4}, {0, 0},
	} {
		if got := w.Add(tc.add); got != tc.mean {
			t.Fatalf("step %d: Add(%v) = %v; want %v", i, tc.add, got, tc.mean)
		}
		if got, want := w.Sum(), tc.mean*float64(w.Len()); got != want {
			t.Fatalf("step %d: Sum() = %v; want %v", i, got, want)
		}
	}
	// Fading: the newest counts whole, the oldest by 1/size; a sample
	// that left the window not at all.
	w = NewWindow(4)
	for i, tc := range []struct{ add, fading float64 }{
		{8, 8}, {0, 6}, {4, 4 + 4}, {0, 3 + 2}, {0, 2}, {0, 1}, {0, 0},
	} {
		w.Add(tc.add)
		if got := w.Fading(); math.Abs(got-tc.fading) > 1e-12 {
			t.Fatalf("fading step %d: %v; want %v", i, got, tc.fading)
		}
	}
	// Resize keeps the most recent samples.
	w = NewWindow(4)
	for _, v := range []float64{1, 2, 3, 4, 5} {
		w.Add(v)
	}
	w.Resize(2) // keeps 4, 5
	if w.Mean() != 4.5 || w.Len() != 2 || w.Size() != 2 {
		t.Fatalf("after Resize(2): mean %v len %d size %d; want 4.5 2 2", w.Mean(), w.Len(), w.Size())
	}
	w.Resize(5)
	if w.Add(9) != 6 {
		t.Fatalf("after Resize(5) and Add(9): mean %v; want 6", w.Mean())
	}
	if NewWindow(0).Size() != 1 {
		t.Fatal("NewWindow(0) should hold one sample")
	}
	// No float drift over many rounds.
	w = NewWindow(7)
	for i := range 100000 {
		w.Add(float64(i%13) * 0.1)
	}
	for range 7 {
		w.Add(1)
	}
	if w.Mean() != 1 {
		t.Fatalf("mean after many samples then seven 1s: %v; want exactly 1", w.Mean())
	}
}

// TestDecideLift covers the lift rule: a member below the low line
// (average × (1 − threshold)) makes the nodes above the average shed
// toward the average, inside the high rule's band too, until the lowest
// member reaches average × (1 − stop band).
func TestDecideLift(t *testing.T) {
	p := defaultParams()
	// Ten nodes at 1000 (this one included) and one new at 0: average
	// 909.1, so this node is at 1.1×, inside the threshold; the new one is
	// below the low line 727.3.
	addOne := []Report{alive("new", 0)}
	for i := range 9 {
		addOne = append(addOne, alive(fmt.Sprintf("old%d", i), 1000))
	}
	tests := []struct {
		name     string
		p        Params
		in       Input
		shed     int
		lifting  bool
		shedding bool
		reason   string
	}{
		{
			// needed 1000 × (1 − 909.1/1000) = 90.9 -> 91; rate 5.
			name: "10 to 11 nodes: the old ones lift the new one",
			p:    p, in: Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: addOne},
			shed: 5, lifting: true, reason: "shed_rate to lift new",
		},
		{
			name: "sized down to the average, not the stop band",
			p:    Params{Threshold: 0.2, ShedRate: 1, Freshness: time.Second},
			in:   Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: addOne},
			shed: 91, lifting: true, reason: "down to the average to lift new",
		},
		{
			name: "a node at the average does not lift",
			p:    p, in: Input{Self: "a", Local: 500, Held: 500, Now: t0, Members: []Report{alive("b", 1000), alive("c", 0)}},
			reason: "within the threshold",
		},
		{
			// average 300: low line 240, lift stop line 270.
			name: "lowest between the two lines does not start lifting",
			p:    p, in: Input{Self: "a", Local: 310, Held: 310, Now: t0, Members: []Report{alive("b", 340), alive("c", 250)}},
			reason: "within the threshold",
		},
		{
			name: "lowest between the two lines keeps lifting",
			p:    p, in: Input{Self: "a", Local: 310, Held: 310, Now: t0, Members: []Report{alive("b", 340), alive("c", 250)},
				Lift: LiftState{Lifting: true, Member: "c", Low: 240, Since: t0}},
			shed: 2, lifting: true, reason: "shed_rate to lift c",
		},
		{
			name: "lowest at the lift stop line stops",
			p:    p, in: Input{Self: "a", Local: 290, Held: 290, Now: t0, Members: []Report{alive("b", 340), alive("c", 270)},
				Lift: LiftState{Lifting: true, Member: "c", Low: 240, Since: t0}},
			reason: "within the threshold",
		},
		{
			name: "current already at the average",
			p:    p, in: Input{Self: "a", Local: 1000, Current: 900, Held: 900, Now: t0, Members: addOne},
			lifting: true, reason: "current load already at the average",
		},
		{
			name: "high rule and lift together: down to the average",
			p:    Params{Threshold: 0.2, ShedRate: 1, Freshness: time.Second},
			// average 400: above the start line 480; lowest 0.
			in:   Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: []Report{alive("b", 200), alive("c", 0)}},
			shed: 600, lifting: true, shedding: true, reason: "down to the average to lift c",
		},
		{
			name: "min_connections holds while lifting",
			p:    p, in: Input{Self: "a", Local: 50, Held: 50, Now: t0, Members: []Report{alive("b", 40), alive("c", 0)}},
			lifting: true, shedding: true, reason: "at or below min_connections",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := Decide(tt.p, tt.in)
			if d.Shed != tt.shed || d.Lift.Lifting != tt.lifting || d.Shedding != tt.shedding || !strings.Contains(d.Reason, tt.reason) {
				t.Errorf("got shed %d lifting %v shedding %v reason %q (avg %.2f, lowest %s %.1f); want shed %d lifting %v shedding %v reason ~%q",
					d.Shed, d.Lift.Lifting, d.Shedding, d.Reason, d.Average, d.LowestName, d.Lowest, tt.shed, tt.lifting, tt.shedding, tt.reason)
			}
			if d.Active() != (tt.lifting || tt.shedding) {
				t.Errorf("Active() = %v", d.Active())
			}
		})
	}
}

// TestDecideLiftPatience walks the lift rule's state through decisions:
// patience starts over while the lowest member gains; when it gains
// nothing for LiftPatience, lifting stops and the member is left out of
// the average for 10 × LiftPatience, then counts again.
func TestDecideLiftPatience(t *testing.T) {
	p := defaultParams() // patience 2 × 5 s
	// Nine peers and this node at 1000: inside the threshold (1.1× the
	// average of 909 with the stuck member, 1× without), so only the lift
	// rule sheds.
	members := func(low float64) []Report {
		ms := []Report{alive("stuck", low)}
		for i := range 9 {
			ms = append(ms, alive(fmt.Sprintf("old%d", i), 1000))
		}
		return ms
	}
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	step := func(in Input, sec int, low float64) Decision {
		in.Now = at(sec)
		in.Members = members(low)
		for i := range in.Members {
			in.Members[i].At = in.Now
		}
		return Decide(p, in)
	}
	in := Input{Self: "a", Local: 1000, Held: 1000}
	d := step(in, 0, 0)
	if !d.Lift.Lifting || d.Lift.Member != "stuck" || !d.Lift.Since.Equal(at(0)) {
		t.Fatalf("start: %+v", d.Lift)
	}
	in.Lift = d.Lift
	d = step(in, 8, 10) // gained: patience starts over
	if !d.Lift.Lifting || !d.Lift.Since.Equal(at(8)) || d.Lift.Low != 10 {
		t.Fatalf("after a gain: %+v", d.Lift)
	}
	in.Lift = d.Lift
	d = step(in, 18, 10) // 10 s without a gain: exactly the patience, still lifting
	if !d.Lift.Lifting || !d.Lift.Since.Equal(at(8)) {
		t.Fatalf("at the patience: %+v", d.Lift)
	}
	in.Lift = d.Lift
	d = step(in, 19, 9) // past it: give up, leave it out
	if d.Lift.Lifting || d.Shed != 0 || d.Lift.Ignored != "stuck" || !d.Lift.IgnoredUntil.Equal(at(119)) {
		t.Fatalf("past the patience: shed %d %+v (%s)", d.Shed, d.Lift, d.Reason)
	}
	if !strings.Contains(d.Reason, "stuck gained no connections") {
		t.Errorf("reason %q", d.Reason)
	}
	in.Lift = d.Lift
	d = step(in, 50, 0) // left out: the average is 1000, nothing to do
	if d.Ignored != 1 || d.Counted != 10 || d.Average != 1000 || d.Shed != 0 || d.Active() {
		t.Fatalf("while left out: ignored %d counted %d average %v shed %d %+v", d.Ignored, d.Counted, d.Average, d.Shed, d.Lift)
	}
	in.Lift = d.Lift
	d = step(in, 119, 0) // counts again: lifting starts again
	if d.Ignored != 0 || !d.Lift.Lifting || d.Shed == 0 {
		t.Fatalf("after the pause: ignored %d shed %d %+v", d.Ignored, d.Shed, d.Lift)
	}
}

// TestDecideJoinSettle: no node sheds for join_settle after a member
// joins, a burst of joins holds it for at most maxJoinHolds settles, and
// join_settle off turns the wait off.
func TestDecideJoinSettle(t *testing.T) {
	p := defaultParams() // settle: freshness, 5s
	peers := []Report{alive("b", 0), alive("c", 0)}
	joined := func(ago ...time.Duration) JoinBurst {
		var b JoinBurst
		for _, a := range ago {
			b = b.Joined(t0.Add(-a), p)
		}
		return b
	}
	off := p
	off.JoinSettle = -1
	short := p
	short.JoinSettle = time.Second
	for _, tc := range []struct {
		name   string
		p      Params
		joins  JoinBurst
		shed   bool
		reason string
	}{
		{"no join", p, JoinBurst{}, true, "shed_rate"},
		{"joined 1s ago", p, joined(time.Second), false, "a member joined 1s ago: waiting join_settle (5s) for more"},
		{"joined 5s ago", p, joined(5 * time.Second), true, "shed_rate"},
		{"join_settle 1s, joined 2s ago", short, joined(2 * time.Second), true, "shed_rate"},
		{"join_settle off", off, joined(time.Second), true, "shed_rate"},
		// Joins 4 s apart from 19 s ago: one burst, still holding.
		{"a burst under 4 settles", p, joined(19*time.Second, 15*time.Second, 11*time.Second, 7*time.Second, 3*time.Second), false, "waiting join_settle"},
		// From 23 s ago: the burst is past 4 × 5 s; shedding goes on.
		{"a burst past 4 settles", p, joined(23*time.Second, 19*time.Second, 15*time.Second, 11*time.Second, 7*time.Second, 3*time.Second), true, "shed_rate"},
		// A 6 s gap starts a new burst.
		{"a new burst after a gap", p, joined(30*time.Second, 26*time.Second, 22*time.Second, 18*time.Second, 12*time.Second, 2*time.Second), false, "waiting join_settle"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(tc.p, Input{Self: "a", Local: 1000, Held: 1000, Now: t0, Members: peers, Joins: tc.joins})
			if (d.Shed > 0) != tc.shed || !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("shed %d, reason %q; want shedding %v, reason with %q", d.Shed, d.Reason, tc.shed, tc.reason)
			}
			if !d.Shedding {
				t.Error("not in a shedding phase: the hold must keep the hysteresis state")
			}
		})
	}

	// Lifting: the hold keeps the lift on and restarts its patience, since
	// the lowest member cannot rise while nobody sheds.
	addOne := []Report{alive("new", 0)}
	for i := range 9 {
		addOne = append(addOne, alive(fmt.Sprintf("old%d", i), 1000))
	}
	now := t0
	d := Decide(p, Input{Self: "a", Local: 1000, Held: 1000, Now: now, Members: addOne,
		Lift: LiftState{Lifting: true, Member: "new", Low: 0, Since: now.Add(-8 * time.Second)}, Joins: JoinBurst{}.Joined(now.Add(-time.Second), p)})
	if d.Shed != 0 || !d.Lift.Lifting || !d.Lift.Since.Equal(now) {
		t.Errorf("held lift: shed %d, lift %+v; want 0, lifting since %v", d.Shed, d.Lift, now)
	}
}

// TestDecidePhaseAverage: within a shedding phase the lines come from the
// phase's average when the current one sank below it (the node's own
// sheds counted before its peers' gains), so the node stops at the stop
// band of the phase's average; outside a phase, or when the current
// average is higher, the current one decides.
func TestDecidePhaseAverage(t *testing.T) {
	p := defaultParams() // stop band 10%
	p.ShedRate = 1
	// Peers b and c whose reports still say 170 and 175 while this node,
	// which began shedding at an average of 200, is at 240: the current
	// average is 195 and its stop line 214.5. (Both peers are above the
	// lift line, 80% of 200, so only the high rule sheds.)
	peers := []Report{alive("b", 170), alive("c", 175)}
	in := Input{Self: "a", Local: 240, Held: 240, Now: t0, Members: peers, Shedding: true, PhaseAverage: 200, PhaseCounted: 3}
	d := Decide(p, in)
	// From the phase's average: stop line 220, so 240 × (1 − 220/240) = 20.
	if d.Shed != 20 || !d.Shedding || d.PhaseAverage != 200 {
		t.Errorf("in a phase begun at 200: shed %d, shedding %v, phase average %v; want 20, true, 200 (%s)", d.Shed, d.Shedding, d.PhaseAverage, d.Reason)
	}
	// At 215 the current stop line (186.7 × 1.1 = 205.3) would keep it
	// shedding; the phase's (220) stops it, and the phase ends.
	in.Local, in.Held = 215, 215
	if d := Decide(p, in); d.Shed != 0 || d.Shedding || d.PhaseAverage != 0 {
		t.Errorf("at 215, below the phase's stop line 220: shed %d, shedding %v, phase average %v; want 0, false, 0 (%s)", d.Shed, d.Shedding, d.PhaseAverage, d.Reason)
	}
	// Without the phase's average the node sheds to the current stop
	// line: the overshoot the rule prevents.
	in.Local, in.Held, in.PhaseAverage = 240, 240, 0
	if d := Decide(p, in); d.Shed != 26 || d.PhaseAverage != d.Average {
		t.Errorf("without a phase average: shed %d; want 26 (down to 214.5) (%s)", d.Shed, d.Reason)
	}
	// Nor when a member joined or left since the phase began (a
	// scale-out lowers the true average): the phase starts over from the
	// current one.
	in.PhaseAverage, in.PhaseCounted = 200, 2
	if d := Decide(p, in); d.Shed != 26 || d.PhaseAverage != d.Average || d.PhaseCounted != 3 {
		t.Errorf("after a join: shed %d, phase average %v of %d; want 26, the current %.1f of 3 (%s)", d.Shed, d.PhaseAverage, d.PhaseCounted, d.Average, d.Reason)
	}
	// A phase's average is not used outside a phase: a node that is not
	// shedding starts from the current average (start line 234).
	in.Shedding, in.PhaseAverage = false, 400
	if d := Decide(p, in); !d.Shedding || d.PhaseAverage != d.Average || d.Shed != 26 {
		t.Errorf("a new phase: shedding %v, phase average %v, shed %d; want true, the current average %.1f, 26 (%s)", d.Shedding, d.PhaseAverage, d.Shed, d.Average, d.Reason)
	}
	// When the current average rose above the phase's, it decides: 290
	// is below the current stop line 293.3 (average 266.7).
	in = Input{Self: "a", Local: 290, Held: 290, Now: t0, Members: []Report{alive("b", 250), alive("c", 260)}, Shedding: true, PhaseAverage: 200, PhaseCounted: 3}
	if d := Decide(p, in); d.Shedding || d.Shed != 0 {
		t.Errorf("current average above the phase's: shedding %v, shed %d; want false, 0 (%s)", d.Shedding, d.Shed, d.Reason)
	}
}
