package rebalance

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
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
			cfg := shed.AverageConfig(name, interval, freshness)
			if err := cfg.Validate(); err != nil {
				t.Errorf("interval %v, freshness %v: %v", interval, freshness, err)
				continue
			}
			// About two exchanges per tick: the pairs it opens must be
			// refreshed within freshness/2 (gossipavg.Config.Peers).
			ticks := int(freshness / 2 / (interval / shed.AverageTicks))
			if cfg.Peers > max(1, ticks/2) {
				t.Errorf("interval %v, freshness %v: %d peers for %d ticks in freshness/2", interval, freshness, cfg.Peers, ticks)
			}
		}
	}
}

// averageOf returns n's gossip average and decision as of its last step.
func averageOf(n *node) (shed.AverageView, shed.Decision) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.average, n.last
}

// waitAverage waits until every node's last decision used the gossip
// average, and that average is within 1% of want over size members.
func waitAverage(t *testing.T, what string, want float64, size int, apps ...*App) {
	t.Helper()
	for _, x := range apps {
		lbxtest.WaitFor(t, 20*time.Second, fmt.Sprintf("%s: %s decides on the gossip average %.0f of %d", what, x.cluster.NodeName, want, size), func() (bool, string) {
			v, d := averageOf(x.node)
			ok := v.Used && math.Abs(d.Average-want) <= want/100 && d.Counted == size
			return ok, fmt.Sprintf("average %.2f from %s, counted %d, size %.2f of %d members", d.Average, v.Source(), d.Counted, v.Size, v.Members)
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
	old := lbxtest.SerfMember(t, "avg-old", nil, a.gossipAddr())
	stopReports := reportLoad(t, old, nil, metricConnections, 800)
	for _, x := range []*App{a, b, c} {
		lbxtest.WaitFor(t, 20*time.Second, x.cluster.NodeName+" falls back to the tags", func() (bool, string) {
			v, d := averageOf(x.node)
			ok := !v.Used && strings.Contains(v.Why, "of the 4 members") && d.Counted == 4 && math.Abs(d.Average-500) < 1
			return ok, fmt.Sprintf("%s; average %.1f counted %d", v.Source(), d.Average, d.Counted)
		})
	}
	rep := buildRebalanceView()
	seen := 0
	for _, nv := range rep.Nodes {
		if !strings.HasPrefix(nv.Name, "avg-") {
			continue
		}
		seen++
		if nv.Decision.AverageFrom != shed.FromTags || nv.GossipAverage.Used || nv.GossipAverage.Why == "" || nv.GossipAverage.Members != 4 {
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
