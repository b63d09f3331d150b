package rebalance

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// badPeer starts a plain serf member, joined to join, whose load tag is
// tag(seq) with a sequence that grows every 100 ms, so that its reports
// are fresh: only their content can keep them out of the average. It
// stops publishing and shuts down, without leaving (as a crash would:
// quicker), at the end of the test.
func badPeer(t *testing.T, name, join string, tag func(seq int) string) {
	t.Helper()
	s := lbxtest.SerfMember(t, name, map[string]string{shed.LoadTag: tag(0)}, join)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for seq := 1; ; seq++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			s.SetTags(map[string]string{shed.LoadTag: tag(seq)})
		}
	}()
	// Runs before SerfMember's cleanup (last registered, first run),
	// which then finds it shut down.
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
		s.Shutdown()
	})
}

// stopTogether stops the apps concurrently and waits for them.
func stopTogether(apps ...*App) {
	var wg sync.WaitGroup
	for _, a := range apps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.stopAll()
		}()
	}
	wg.Wait()
}

// lastDecision returns a copy of n's last decision and how many intervals
// shed since it started.
func lastDecision(n *node) (shed.Decision, uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.last, n.shedDecisions
}

// TestBadPeerLoadsShedNothing: two real nodes at equal load and six
// plain serf members gossiping NaN, +Inf, -1, garbage and (two of them)
// 1.7e308, fresh every 100 ms. Before, each of those counted as load 0
// (or made the average +Inf), and both nodes shed to "lift" them. Now no
// bad report counts: nobody sheds over many intervals, the admin view
// encodes with HTTP 200 and marks them not counted, and cluster_load's
// reading does not count them either.
func TestBadPeerLoadsShedNothing(t *testing.T) {
	srcA, srcB := &fakeSource{load: 100}, &fakeSource{load: 100}
	a := testApp(t, "safe-a", srcA, nil)
	b := testApp(t, "safe-b", srcB, func(c *cluster.App, x *App) { c.Join = []string{a.gossipAddr()} })
	bad := map[string]func(int) string{
		"bad-nan":      func(s int) string { return fmt.Sprintf("connections NaN %d", s) },
		"bad-inf":      func(s int) string { return fmt.Sprintf("connections +Inf %d", s) },
		"bad-negative": func(s int) string { return fmt.Sprintf("connections -1 %d", s) },
		"bad-garbage":  func(s int) string { return fmt.Sprintf("\x00garbage%d\xff", s) },
		"bad-huge-1":   func(s int) string { return fmt.Sprintf("connections 1.7e308 %d", s) },
		"bad-huge-2":   func(s int) string { return fmt.Sprintf("connections 1.7e308 %d", s) },
	}
	for name, tag := range bad {
		badPeer(t, name, a.gossipAddr(), tag)
	}
	// Both nodes leave at once at the end (each leave takes seconds).
	t.Cleanup(func() { stopTogether(a, b) })

	// Every node has seen the six bad members change and judged them.
	for _, x := range []*App{a, b} {
		lbxtest.WaitFor(t, 20*time.Second, x.cluster.NodeName+" judges the six bad members invalid", func() (bool, string) {
			d, _ := lastDecision(x.node)
			return d.Invalid == len(bad) && d.Counted == 2, fmt.Sprintf("last decision %+v", d)
		})
	}
	// Ten more intervals: not one decision sheds.
	start := a.node.steps.Load()
	lbxtest.WaitFor(t, 10*time.Second, "ten more intervals", func() (bool, string) {
		return a.node.steps.Load()-start >= int64(10*time.Duration(a.Interval)), "not yet"
	})
	for _, x := range []struct {
		app *App
		src *fakeSource
	}{{a, srcA}, {b, srcB}} {
		d, decisions := lastDecision(x.app.node)
		if _, shed := x.src.get(); shed != 0 || decisions != 0 || d.Active() {
			t.Errorf("%s shed %d connections in %d intervals (last decision %+v); want none", x.app.cluster.NodeName, shed, decisions, d)
		}
		if d.Invalid != len(bad) || d.Counted != 2 || d.Average != 100 {
			t.Errorf("%s: last decision counted %d (invalid %d), average %v; want 2 (6), 100", x.app.cluster.NodeName, d.Counted, d.Invalid, d.Average)
		}
	}

	// The admin view encodes, and says why each bad member is out.
	rec := httptest.NewRecorder()
	if err := handleRebalance(rec, httptest.NewRequest("GET", "/rebalance/cluster", nil)); err != nil {
		t.Fatalf("admin view: %v", err)
	}
	if rec.Code != http.StatusOK || !json.Valid(rec.Body.Bytes()) {
		t.Fatalf("admin view: status %d, valid JSON %v:\n%s", rec.Code, json.Valid(rec.Body.Bytes()), rec.Body.String())
	}
	var rep rebalanceView
	if err := json.Unmarshal(rec.Body.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	var seen int
	for _, nv := range rep.Nodes {
		if nv.Name != "safe-a" {
			continue
		}
		if nv.Decision.Invalid != len(bad) {
			t.Errorf("admin view: members_invalid %d; want %d", nv.Decision.Invalid, len(bad))
		}
		for _, m := range nv.Members {
			if _, isBad := bad[m.Name]; !isBad {
				continue
			}
			seen++
			if m.Counted || !strings.Contains(m.Why, "invalid load report") || m.Load != 0 {
				t.Errorf("admin view of %s: counted %v, load %v, excluded because %q; want not counted, load 0, an invalid load report",
					m.Name, m.Counted, m.Load, m.Why)
			}
		}
	}
	if seen != len(bad) {
		t.Errorf("admin view of safe-a lists %d of the %d bad members:\n%s", seen, len(bad), rec.Body.String())
	}

	// cluster_load reads the loads under the same rule.
	loads, err := nodeLoads{a.cluster}.memberLoads(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range loads {
		if _, isBad := bad[l.Name]; isBad && (l.Counts || l.Load != 0) {
			t.Errorf("cluster_load reading of %s: counts %v, load %v; want not counted", l.Name, l.Counts, l.Load)
		}
	}
}

// infSource is a load source whose load is +Inf.
type infSource struct{ fakeSource }

func (*infSource) Sample(string) (float64, int) { return math.Inf(1), 100 }

// TestAdminViewEncodesNonFinite: a node whose own load is +Inf (and so
// its average, balance) still gets an admin view that encodes.
func TestAdminViewEncodesNonFinite(t *testing.T) {
	a := testApp(t, "inf-node", &infSource{}, nil)
	lbxtest.WaitFor(t, 5*time.Second, "a decision on an infinite load", func() (bool, string) {
		a.node.mu.Lock()
		defer a.node.mu.Unlock()
		return math.IsInf(a.node.local, 1), fmt.Sprintf("local %v", a.node.local)
	})
	body, err := json.Marshal(buildRebalanceView())
	if err != nil {
		t.Fatalf("the admin view does not encode: %v", err)
	}
	if !json.Valid(body) {
		t.Fatalf("invalid JSON: %s", body)
	}
}

// TestNameConflictIsLoud: a node that joins with a node_name the cluster
// already has loses serf's vote, and its serf member shuts down. Caddy
// keeps running, but the node says so: the admin view's name_conflict,
// no stale member list, and no more decisions (the cluster package's
// tests cover the metric).
func TestNameConflictIsLoud(t *testing.T) {
	first := testApp(t, "dup", &fakeSource{load: 10}, nil)
	witness := testApp(t, "dup-witness", &fakeSource{load: 10}, func(c *cluster.App, x *App) { c.Join = []string{first.gossipAddr()} })
	lbxtest.WaitFor(t, 15*time.Second, "the first dup counts the witness", func() (bool, string) { return seesLoads(first.node, 2) })

	// Another bind address, so that the pool does not hand back the
	// first one's member.
	second := testApp(t, "dup", &fakeSource{load: 10}, func(c *cluster.App, x *App) {
		c.Bind = "127.0.0.1:" + strconv.Itoa(freePort(t))
		c.Join = []string{first.gossipAddr()}
	})
	if second.node == first.node {
		t.Fatal("the second dup shares the first's member")
	}
	t.Cleanup(func() { stopTogether(first, witness, second) })
	n := second.node
	msg := ""
	lbxtest.WaitFor(t, 20*time.Second, "the second dup reports the conflict", func() (bool, string) {
		st, _ := second.cluster.Status()
		msg = st.Conflict
		return msg != "", "no conflict yet"
	})
	lbxtest.WaitFor(t, 5*time.Second, "the second dup's decision gives the conflict", func() (bool, string) {
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.last.Reason == msg, fmt.Sprintf("last reason %q", n.last.Reason)
	})
	t.Logf("conflict: %s", msg)
	if !strings.Contains(msg, `node_name "dup" is also used by the member at `+first.gossipAddr()) {
		t.Errorf("conflict %q; want it to name the other member %s", msg, first.gossipAddr())
	}

	v := n.view(time.Now(), connStats{})
	if v.NameConflict != msg || len(v.Members) != 0 {
		t.Errorf("admin view: name_conflict %q, %d members; want the conflict and no members", v.NameConflict, len(v.Members))
	}
	// The first keeps its place and its view of the cluster.
	if ok, why := seesLoads(first.node, 2); !ok {
		t.Errorf("the first dup: %s", why)
	}
	// The loser decides no more.
	steps := n.steps.Load()
	lbxtest.WaitFor(t, 5*time.Second, "the first dup takes five more steps", func() (bool, string) {
		return first.node.steps.Load()-steps >= int64(5*time.Duration(first.Interval)), "not yet"
	})
	if got := n.steps.Load(); got != steps {
		t.Errorf("the second dup still takes steps after its member shut down")
	}
}

// TestTagSizeMatchesSerf: the cluster's tag check, with the load tag,
// accepts exactly the tags that serf accepts
// with the longest load tag this node can publish, and refuses
// one byte more, which serf refuses too.
func TestTagSizeMatchesSerf(t *testing.T) {
	s := lbxtest.SerfMember(t, "tag-size", nil, "")
	tagsOf := func(n int) map[string]string {
		return map[string]string{"zone": "z", "blob": strings.Repeat("x", n)}
	}
	fits := -1
	for n := 300; n < 600; n++ {
		if fitsWithLoadTag(tagsOf(n), metricConnections) != nil {
			fits = n - 1
			break
		}
	}
	if fits < 0 {
		t.Fatal("checkTagSize accepted 600 bytes of tags")
	}
	withLoad := func(n int) map[string]string {
		tags := tagsOf(n)
		tags[shed.LoadTag] = longestLoadTag(metricConnections)
		return tags
	}
	if err := s.SetTags(withLoad(fits)); err != nil {
		t.Errorf("checkTagSize accepts a %d-byte tag that serf refuses: %v", fits, err)
	}
	if err := s.SetTags(withLoad(fits + 1)); err == nil {
		t.Errorf("checkTagSize refuses a %d-byte tag that serf accepts", fits+1)
	}
	err := fitsWithLoadTag(tagsOf(fits+1), metricConnections)
	if err == nil || !strings.Contains(err.Error(), "above serf's limit of 512") {
		t.Errorf("error %v; want one naming serf's limit", err)
	}
}

// fitsWithLoadTag is the check the app makes at Provision: the cluster's
// tags with the longest load tag of metric.
func fitsWithLoadTag(tags map[string]string, metric string) error {
	return (&cluster.App{Tags: tags}).CheckTagsFit(map[string]string{shed.LoadTag: longestLoadTag(metric)})
}
