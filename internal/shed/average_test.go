package shed

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
)

// TestAverageUsable is the freshness rule of the gossip average.
func TestAverageUsable(t *testing.T) {
	now := time.Unix(1000, 0)
	const freshness = 5 * time.Second
	fresh := AverageView{Average: 10, Size: 10, Members: 10, LastExchange: now.Add(-time.Second)}
	for _, tc := range []struct {
		name string
		mut  func(*AverageView)
		ok   bool
		why  string
	}{
		{"fresh and complete", func(*AverageView) {}, true, ""},
		{"size 10% off", func(v *AverageView) { v.Size = 11 }, true, ""},
		{"size too large: a departure still spreading", func(v *AverageView) { v.Size = 11.01 }, false, "estimated size 11.0"},
		{"size too small: a join still spreading, or members that do not answer", func(v *AverageView) { v.Size = 8.9 }, false, "not within 10%"},
		{"no exchange yet (size +Inf)", func(v *AverageView) { v.LastExchange, v.Size = time.Time{}, math.Inf(1) }, false, "no exchange completed yet"},
		{"last exchange older than freshness: messages lost or blocked", func(v *AverageView) { v.LastExchange = now.Add(-freshness - time.Millisecond) }, false, "no exchange completed for 5.001s"},
		{"exchange exactly at freshness", func(v *AverageView) { v.LastExchange = now.Add(-freshness) }, true, ""},
		{"alone in its metric", func(v *AverageView) { v.Members, v.Size = 1, 1 }, false, "no other member"},
	} {
		v := fresh
		tc.mut(&v)
		ok, why := AverageUsable(v, freshness, now)
		if ok != tc.ok || !strings.Contains(why, tc.why) || ok && why != "" {
			t.Errorf("%s: got %v %q; want %v with %q", tc.name, ok, why, tc.ok, tc.why)
		}
	}
}

// TestLoadTagDue is the load tag's publication rule: the first report, a
// change of more than 5%, and a keep-alive every freshness/2 so that the
// tag of a member whose load does not move keeps changing within
// freshness.
func TestLoadTagDue(t *testing.T) {
	const interval, freshness = time.Second, 5 * time.Second
	for _, tc := range []struct {
		since            int
		published, local float64
		due              bool
	}{
		{0, 0, 0, true}, // never published
		{1, 100, 100, false},
		{1, 100, 104.9, false},
		{1, 100, 95.1, false},
		{1, 100, 105.3, true},
		{1, 100, 94.7, true},
		{1, 100, 0, true},
		{1, 0, 0, false},
		{2, 100, 100, true}, // keep-alive: freshness/2 is 2.5 intervals, so every 2
	} {
		if got := LoadTagDue(tc.since, tc.published, tc.local, interval, freshness); got != tc.due {
			t.Errorf("published %v, %d steps ago, now %v: due %v, want %v", tc.published, tc.since, tc.local, got, tc.due)
		}
	}
	// With freshness below two intervals, every step publishes.
	if !LoadTagDue(1, 100, 100, interval, 1500*time.Millisecond) {
		t.Error("freshness 1.5 intervals: the keep-alive is not every interval")
	}
}

// TestAveragedView maps a usable gossip average to the decision's View:
// the lowest member is the lowest entry other than this node (whose own
// entry is a step old) when it is below this node's load, never the
// member the lift rule leaves out; an unusable average gives the tags'
// View.
func TestAveragedView(t *testing.T) {
	now := time.Unix(1000, 0)
	p := Params{Freshness: 5 * time.Second}
	est := gossipavg.View{Values: [gossipavg.MaxDim]float64{40, 1.0 / 3}, Dim: 2, Peers: 2, LastExchange: now.Add(-time.Second)}
	lows := []gossipavg.Entry{{Name: "b", Load: 10}, {Name: "c", Load: 20}, {Name: "a", Load: 90}}
	tags := View{Average: 55, Counted: 2, NotAlive: 1, OtherMetric: 1, Invalid: 1, Stale: 1}
	in := Input{Self: "b", Local: 50, Now: now}
	v, ok := AveragedView(p, in, est, lows, 3, tags)
	want := View{Average: 40, Counted: 3, NotAlive: 1, OtherMetric: 1, Invalid: 1, Lowest: 20, LowestName: "c"}
	if !ok || v != want {
		t.Errorf("got %+v %v; want %+v", v, ok, want)
	}
	// c is left out by the lift rule: a is not below b, so b is lowest.
	in.Lift = LiftState{Ignored: "c", IgnoredUntil: now.Add(time.Second)}
	if v, _ := AveragedView(p, in, est, lows, 3, tags); v.LowestName != "b" || v.Lowest != 50 {
		t.Errorf("with c ignored: %+v", v)
	}
	// The same after c's time is up.
	in.Lift.IgnoredUntil = now
	if v, _ := AveragedView(p, in, est, lows, 3, tags); v.LowestName != "c" {
		t.Errorf("after c's time: %+v", v)
	}
	// A fourth member the averaging does not cover: the tags' View.
	if v, ok := AveragedView(p, in, est, lows, 4, tags); ok || v != tags {
		t.Errorf("size 3 of 4 members: %+v %v; want the tags' View", v, ok)
	}
}

// TestWithShedInFlight: connections shed within history count toward the
// load of the node that shed them, in the metric's unit.
func TestWithShedInFlight(t *testing.T) {
	for _, tc := range []struct {
		metric   string
		load     float64
		held     int
		inFlight float64
		want     float64
	}{
		{MetricConnections, 900, 900, 100, 1000},
		{MetricConnections, 900, 900, 0, 900},
		{MetricConnections, 0, 0, 40, 40},
		{MetricThroughput, 9e6, 900, 100, 1e7}, // 10 kB/s per connection
		{MetricCPU, 45, 900, 100, 50},
		{MetricCPU, 45, 0, 100, 45}, // nothing to scale by
	} {
		if got := WithShedInFlight(tc.metric, tc.load, tc.held, tc.inFlight); math.Abs(got-tc.want) > 1e-9*tc.want {
			t.Errorf("%s %v with %d held, %v in flight: %v, want %v", tc.metric, tc.load, tc.held, tc.inFlight, got, tc.want)
		}
	}
}

// TestTagRange: the tags' range and average count the alive members with
// a valid load in this node's metric, whatever their age, and this node's
// own load; with no other such member there is no evidence.
func TestTagRange(t *testing.T) {
	p := Params{Metric: MetricConnections}
	alive := cluster.StatusAlive
	in := Input{Self: "me", Local: 40, Members: []Report{
		{Name: "me", Status: alive, Load: 1000, Metric: MetricConnections}, // its Local counts instead
		{Name: "low", Status: alive, Load: 20, Metric: MetricConnections},  // no age: counts
		{Name: "high", Status: alive, Load: 60, Metric: MetricConnections, At: time.Unix(1, 0)},
		{Name: "gone", Status: cluster.StatusFailed, Load: 0, Metric: MetricConnections},
		{Name: "cpu", Status: alive, Load: 0, Metric: MetricCPU},
		{Name: "nan", Status: alive, Load: math.NaN()},
		{Name: "negative", Status: alive, Load: -1, Metric: MetricConnections},
	}}
	r := TagRangeOf(p, in)
	if want := (TagRange{OK: true, Min: 20, Max: 60, Mean: 40}); r != want {
		t.Errorf("got %+v; want %+v", r, want)
	}
	if lo, hi := r.Lo(), r.Hi(); lo != 20-2-0.5 || hi != 60+6+0.5 {
		t.Errorf("bounds %v to %v; want 17.5 to 66.5", lo, hi)
	}
	in.Members = in.Members[3:]
	if r := TagRangeOf(p, in); r.OK {
		t.Errorf("no other member's tag: %+v; want no evidence", r)
	}
}

// TestAverageUsableTags: a fresh, complete average is used only within
// the tags' range, otherwise the view says the tags refuse it; a used
// average is clamped to within meanSlack of the tags' average (20%
// threshold: 1/6 of 40, 6.67).
func TestAverageUsableTags(t *testing.T) {
	now := time.Unix(1000, 0)
	p := Params{Freshness: 5 * time.Second, Threshold: 0.2}
	tags := TagRange{OK: true, Min: 40, Max: 40, Mean: 40}
	est := func(avg float64) gossipavg.View {
		return gossipavg.View{Values: [gossipavg.MaxDim]float64{avg, 0.25}, Dim: 2, LastExchange: now.Add(-time.Second)}
	}
	wide := TagRange{OK: true, Min: 20, Max: 60, Mean: 40}
	for _, c := range []struct {
		avg     float64
		tags    TagRange
		used    bool
		refused bool
		decided float64 // the decision's average, when used
	}{
		{40, tags, true, false, 40},
		{44.4, tags, true, false, 44.4},
		{35.6, tags, true, false, 35.6},
		{0.001, tags, false, true, 0},
		{-1, tags, false, true, 0},
		{1e18, tags, false, true, 0},
		{-1e18, tags, false, true, 0},
		{math.NaN(), tags, false, true, 0},
		// Within the range, but off the average by more than 1/6:
		// clamped.
		{50, wide, true, false, 40 + 40.0/6},
		{20, wide, true, false, 40 - 40.0/6},
		// No tag to compare (the fleet simulation): as it is.
		{0.001, TagRange{}, true, false, 0.001},
	} {
		v := MakeAverageView(est(c.avg), nil, 4, p, c.tags, now)
		if v.Used != c.used || v.Refused != c.refused || v.Refused && !strings.Contains(v.Why, "load tags") {
			t.Errorf("average %v with tags %+v: used %v, refused %v (%q); want used %v, refused %v", c.avg, c.tags, v.Used, v.Refused, v.Why, c.used, c.refused)
		}
		if c.used {
			if got := v.DecisionView(Input{Local: 40, Now: now}, View{}).Average; math.Abs(got-c.decided) > 1e-9 || v.Clamped != (got != c.avg) {
				t.Errorf("average %v with tags %+v: the decision's average is %v (clamped %v); want %v", c.avg, c.tags, got, v.Clamped, c.decided)
			}
		}
	}
	// A size that is off says so first: not a refusal by the tags.
	v := MakeAverageView(gossipavg.View{Values: [gossipavg.MaxDim]float64{0.001, 0.5}, Dim: 2, LastExchange: now}, nil, 4, p, tags, now)
	if v.Used || v.Refused || !strings.Contains(v.Why, "estimated size") {
		t.Errorf("size 2 of 4: used %v, refused %v, %q", v.Used, v.Refused, v.Why)
	}
	// meanSlack: t/(1+t) of the average, at least tagSlackAbs.
	for _, c := range []struct{ threshold, mean, want float64 }{
		{0.2, 40, 40.0 / 6}, {3, 40, 30}, {0.2, 1, 0.5}, {0.01, 40, 0.5},
	} {
		if got := MeanSlack(Params{Threshold: c.threshold}, c.mean); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("MeanSlack(threshold %v, mean %v) = %v; want %v", c.threshold, c.mean, got, c.want)
		}
	}
}

// TestAveragedViewIgnoresLowsBelowTags: a lowest-load entry below every
// tag (a member's lie about another, or about itself) is not the lowest
// member of the decision; the next entry is.
func TestAveragedViewIgnoresLowsBelowTags(t *testing.T) {
	now := time.Unix(1000, 0)
	p := Params{Freshness: 5 * time.Second, Threshold: 0.2}
	alive := cluster.StatusAlive
	in := Input{Self: "a", Local: 40, Now: now, Members: []Report{
		{Name: "b", Status: alive, Load: 38}, {Name: "c", Status: alive, Load: 42},
	}}
	est := gossipavg.View{Values: [gossipavg.MaxDim]float64{40, 1.0 / 3}, Dim: 2, LastExchange: now.Add(-time.Second)}
	lows := []gossipavg.Entry{{Name: "c", Load: 0.001}, {Name: "b", Load: 38}}
	v, ok := AveragedView(p, in, est, lows, 3, View{})
	if !ok || v.LowestName != "b" || v.Lowest != 38 {
		t.Errorf("got %+v %v; want b at 38 the lowest", v, ok)
	}
}

// TestAverageConfigDefaults: at the default interval and freshness a node
// opens averagePeers pairs and waits half a tick for an answer.
func TestAverageConfigDefaults(t *testing.T) {
	if got := AverageConfig("a", time.Second, 5*time.Second); got.Peers != averagePeers || got.RetryTimeout != 50*time.Millisecond {
		t.Errorf("defaults: %+v", got)
	}
}
