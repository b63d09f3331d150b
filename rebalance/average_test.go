package rebalance

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
	"github.com/caddy-lbx/lbx/internal/testutil"
)

// TestAverageConfigValid: every interval and freshness the app accepts
// gives the averaging a valid configuration (the app validates its
// options, not gossipavg's), with a pair refresh the node can keep up
// with.
func TestAverageConfigValid(t *testing.T) {
	name := strings.Repeat("n", 128) // the longest node_name
	for _, interval := range []time.Duration{minInterval, 150 * time.Millisecond, time.Second, 7 * time.Second, maxInterval} {
		for _, freshness := range []time.Duration{interval, interval + 1, 2 * interval, max(5*interval, 3*time.Second), maxFreshness} {
			if freshness > maxFreshness {
				continue
			}
			cfg := AverageConfig(name, interval, freshness)
			if err := cfg.Validate(); err != nil {
				t.Errorf("interval %v, freshness %v: %v", interval, freshness, err)
				continue
			}
			// About two exchanges per tick: the pairs it opens must be
			// refreshed within freshness/2 (gossipavg.Config.Peers).
			ticks := int(freshness / 2 / (interval / AverageTicks))
			if cfg.Peers > max(1, ticks/2) {
				t.Errorf("interval %v, freshness %v: %d peers for %d ticks in freshness/2", interval, freshness, cfg.Peers, ticks)
			}
		}
	}
	if got := AverageConfig("a", time.Second, 5*time.Second); got.Peers != averagePeers || got.RetryTimeout != 50*time.Millisecond {
		t.Errorf("defaults: %+v", got)
	}
}

// TestAverageUsable is the freshness rule of the gossip average.
func TestAverageUsable(t *testing.T) {
	now := time.Unix(1000, 0)
	const freshness = 5 * time.Second
	fresh := averageView{Average: 10, Size: 10, Members: 10, LastExchange: now.Add(-time.Second)}
	for _, tc := range []struct {
		name string
		mut  func(*averageView)
		ok   bool
		why  string
	}{
		{"fresh and complete", func(*averageView) {}, true, ""},
		{"size 10% off", func(v *averageView) { v.Size = 11 }, true, ""},
		{"size too large: a departure still spreading", func(v *averageView) { v.Size = 11.01 }, false, "estimated size 11.0"},
		{"size too small: a join still spreading, or members that do not answer", func(v *averageView) { v.Size = 8.9 }, false, "not within 10%"},
		{"no exchange yet (size +Inf)", func(v *averageView) { v.LastExchange, v.Size = time.Time{}, math.Inf(1) }, false, "no exchange completed yet"},
		{"last exchange older than freshness: messages lost or blocked", func(v *averageView) { v.LastExchange = now.Add(-freshness - time.Millisecond) }, false, "no exchange completed for 5.001s"},
		{"exchange exactly at freshness", func(v *averageView) { v.LastExchange = now.Add(-freshness) }, true, ""},
		{"alone in its metric", func(v *averageView) { v.Members, v.Size = 1, 1 }, false, "no other member"},
	} {
		v := fresh
		tc.mut(&v)
		ok, why := averageUsable(v, freshness, now)
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

// averageOf returns n's gossip average and decision as of its last step.
func averageOf(n *node) (averageView, Decision) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.average, n.last
}

// waitAverage waits until every node's last decision used the gossip
// average, and that average is within 1% of want over size members.
func waitAverage(t *testing.T, what string, want float64, size int, apps ...*App) {
	t.Helper()
	for _, x := range apps {
		testutil.WaitFor(t, 20*time.Second, fmt.Sprintf("%s: %s decides on the gossip average %.0f of %d", what, x.cluster.NodeName, want, size), func() (bool, string) {
			v, d := averageOf(x.node)
			ok := v.Used && math.Abs(d.Average-want) <= want/100 && d.Counted == size
			return ok, fmt.Sprintf("average %.2f from %s, counted %d, size %.2f of %d members", d.Average, v.source(), d.Counted, v.Size, v.Members)
		})
	}
}

// TestGossipAverageInCluster runs the averaging between real members:
// every node decides on the gossip average; a member that leaves drops out
// of it; one that stops answering (its loads keep coming by tag) makes the
// others fall back to the tags' view, with the reason; a member restarted
// under its old name (a new incarnation, its tag's sequence reset)
// counts again.
func TestGossipAverageInCluster(t *testing.T) {
	never := func(c *cluster.App, x *App) { x.Threshold = 1000 } // no shedding: loads stay put
	a := testApp(t, "avg-a", &fakeSource{load: 100}, never)
	joinA := func(c *cluster.App, x *App) { never(c, x); c.Join = []string{a.gossipAddr()} }
	b := testApp(t, "avg-b", &fakeSource{load: 200}, joinA)
	c := testApp(t, "avg-c", &fakeSource{load: 600}, joinA)
	waitAverage(t, "three members", 300, 3, a, b, c)
	if v, d := averageOf(a.node); d.LowestName != "avg-a" || len(v.Lows) == 0 || v.Lows[0].Name != "avg-a" {
		t.Errorf("avg-a: lowest %q, lows %+v; want avg-a", d.LowestName, v.Lows)
	}
	if _, d := averageOf(c.node); d.LowestName != "avg-a" || d.Lowest != 100 {
		t.Errorf("avg-c: lowest %q at %v; want avg-a at 100", d.LowestName, d.Lowest)
	}

	// avg-c leaves: the others average over two.
	if err := c.stopAll(); err != nil {
		t.Fatal(err)
	}
	waitAverage(t, "avg-c left", 150, 2, a, b)

	// avg-c restarts under its name with another load.
	c = testApp(t, "avg-c", &fakeSource{load: 900}, joinA)
	waitAverage(t, "avg-c restarted", 400, 3, a, b, c)

	// A member that publishes load tags but takes no part in the
	// averaging (a node of an older version during a rolling upgrade, or
	// one whose direct messages do not get through): the size estimate
	// falls short of the four members serf lists, so the nodes decide on
	// the tags, and say why; when it leaves, they are back on the gossip
	// average.
	old := testutil.SerfMember(t, "avg-old", nil, a.gossipAddr())
	stopReports := reportLoad(t, old, nil, metricConnections, 800)
	for _, x := range []*App{a, b, c} {
		testutil.WaitFor(t, 20*time.Second, x.cluster.NodeName+" falls back to the tags", func() (bool, string) {
			v, d := averageOf(x.node)
			ok := !v.Used && strings.Contains(v.Why, "of the 4 members") && d.Counted == 4 && math.Abs(d.Average-500) < 1
			return ok, fmt.Sprintf("%s; average %.1f counted %d", v.source(), d.Average, d.Counted)
		})
	}
	rep := buildRebalanceView()
	seen := 0
	for _, nv := range rep.Nodes {
		if !strings.HasPrefix(nv.Name, "avg-") {
			continue
		}
		seen++
		if nv.Decision.AverageFrom != fromTags || nv.GossipAverage.Used || nv.GossipAverage.Why == "" || nv.GossipAverage.Members != 4 {
			t.Errorf("admin view of %s: %+v %+v", nv.Name, nv.Decision, nv.GossipAverage)
		}
	}
	if seen != 3 {
		t.Errorf("admin view lists %d avg- nodes, want 3", seen)
	}
	stopReports()
	if err := old.Leave(); err != nil {
		t.Fatal(err)
	}
	waitAverage(t, "avg-old left", 400, 3, a, b, c)
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
		{metricConnections, 900, 900, 100, 1000},
		{metricConnections, 900, 900, 0, 900},
		{metricConnections, 0, 0, 40, 40},
		{metricThroughput, 9e6, 900, 100, 1e7}, // 10 kB/s per connection
		{metricCPU, 45, 900, 100, 50},
		{metricCPU, 45, 0, 100, 45}, // nothing to scale by
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
	p := Params{Metric: metricConnections}
	alive := cluster.StatusAlive
	in := Input{Self: "me", Local: 40, Members: []memberReport{
		{Name: "me", Status: alive, Load: 1000, Metric: metricConnections}, // its Local counts instead
		{Name: "low", Status: alive, Load: 20, Metric: metricConnections},  // no age: counts
		{Name: "high", Status: alive, Load: 60, Metric: metricConnections, At: time.Unix(1, 0)},
		{Name: "gone", Status: cluster.StatusFailed, Load: 0, Metric: metricConnections},
		{Name: "cpu", Status: alive, Load: 0, Metric: metricCPU},
		{Name: "nan", Status: alive, Load: math.NaN()},
		{Name: "negative", Status: alive, Load: -1, Metric: metricConnections},
	}}
	r := tagRangeOf(p, in)
	if want := (tagRange{ok: true, min: 20, max: 60, mean: 40}); r != want {
		t.Errorf("got %+v; want %+v", r, want)
	}
	if lo, hi := r.lo(), r.hi(); lo != 20-2-0.5 || hi != 60+6+0.5 {
		t.Errorf("bounds %v to %v; want 17.5 to 66.5", lo, hi)
	}
	in.Members = in.Members[3:]
	if r := tagRangeOf(p, in); r.ok {
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
	tags := tagRange{ok: true, min: 40, max: 40, mean: 40}
	est := func(avg float64) gossipavg.View {
		return gossipavg.View{Values: [gossipavg.MaxDim]float64{avg, 0.25}, Dim: 2, LastExchange: now.Add(-time.Second)}
	}
	wide := tagRange{ok: true, min: 20, max: 60, mean: 40}
	for _, c := range []struct {
		avg     float64
		tags    tagRange
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
		{0.001, tagRange{}, true, false, 0.001},
	} {
		v := makeAverageView(est(c.avg), nil, 4, p, c.tags, now)
		if v.Used != c.used || v.Refused != c.refused || v.Refused && !strings.Contains(v.Why, "load tags") {
			t.Errorf("average %v with tags %+v: used %v, refused %v (%q); want used %v, refused %v", c.avg, c.tags, v.Used, v.Refused, v.Why, c.used, c.refused)
		}
		if c.used {
			if got := v.decisionView(Input{Local: 40, Now: now}, View{}).Average; math.Abs(got-c.decided) > 1e-9 || v.Clamped != (got != c.avg) {
				t.Errorf("average %v with tags %+v: the decision's average is %v (clamped %v); want %v", c.avg, c.tags, got, v.Clamped, c.decided)
			}
		}
	}
	// A size that is off says so first: not a refusal by the tags.
	v := makeAverageView(gossipavg.View{Values: [gossipavg.MaxDim]float64{0.001, 0.5}, Dim: 2, LastExchange: now}, nil, 4, p, tags, now)
	if v.Used || v.Refused || !strings.Contains(v.Why, "estimated size") {
		t.Errorf("size 2 of 4: used %v, refused %v, %q", v.Used, v.Refused, v.Why)
	}
	// meanSlack: t/(1+t) of the average, at least tagSlackAbs.
	for _, c := range []struct{ threshold, mean, want float64 }{
		{0.2, 40, 40.0 / 6}, {3, 40, 30}, {0.2, 1, 0.5}, {0.01, 40, 0.5},
	} {
		if got := meanSlack(Params{Threshold: c.threshold}, c.mean); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("meanSlack(threshold %v, mean %v) = %v; want %v", c.threshold, c.mean, got, c.want)
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
	in := Input{Self: "a", Local: 40, Now: now, Members: []memberReport{
		{Name: "b", Status: alive, Load: 38}, {Name: "c", Status: alive, Load: 42},
	}}
	est := gossipavg.View{Values: [gossipavg.MaxDim]float64{40, 1.0 / 3}, Dim: 2, LastExchange: now.Add(-time.Second)}
	lows := []gossipavg.Entry{{Name: "c", Load: 0.001}, {Name: "b", Load: 38}}
	v, ok := AveragedView(p, in, est, lows, 3, View{})
	if !ok || v.LowestName != "b" || v.Lowest != 38 {
		t.Errorf("got %+v %v; want b at 38 the lowest", v, ok)
	}
}
