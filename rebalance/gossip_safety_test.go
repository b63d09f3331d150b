package rebalance

import (
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/internal/testutil"
)

// badPeer starts a plain serf member, joined to join, whose load tag is
// tag(seq) with a sequence that grows every 100 ms, so that its reports
// are fresh: only their content can keep them out of the average. It
// stops publishing and shuts down, without leaving (as a crash would:
// quicker), at the end of the test.
func badPeer(t *testing.T, name, join string, tag func(seq int) string) {
	t.Helper()
	s := testutil.SerfMember(t, name, map[string]string{LoadTag: tag(0)}, join)
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
			s.SetTags(map[string]string{LoadTag: tag(seq)})
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
			a.Stop()
		}()
	}
	wg.Wait()
}

// lastDecision returns a copy of n's last decision and how many intervals
// shed since it started.
func lastDecision(n *node) (Decision, uint64) {
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
	b := testApp(t, "safe-b", srcB, func(x *App) { x.Join = []string{a.gossipAddr()} })
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
		testutil.WaitFor(t, 20*time.Second, x.NodeName+" judges the six bad members invalid", func() (bool, string) {
			d, _ := lastDecision(x.node)
			return d.Invalid == len(bad) && d.Counted == 2, fmt.Sprintf("last decision %+v", d)
		})
	}
	// Ten more intervals: not one decision sheds.
	start := a.node.steps.Load()
	testutil.WaitFor(t, 10*time.Second, "ten more intervals", func() (bool, string) {
		return a.node.steps.Load()-start >= int64(10*a.interval), "not yet"
	})
	for _, x := range []struct {
		app *App
		src *fakeSource
	}{{a, srcA}, {b, srcB}} {
		d, decisions := lastDecision(x.app.node)
		if _, shed := x.src.get(); shed != 0 || decisions != 0 || d.Active() {
			t.Errorf("%s shed %d connections in %d intervals (last decision %+v); want none", x.app.NodeName, shed, decisions, d)
		}
		if d.Invalid != len(bad) || d.Counted != 2 || d.Average != 100 {
			t.Errorf("%s: last decision counted %d (invalid %d), average %v; want 2 (6), 100", x.app.NodeName, d.Counted, d.Invalid, d.Average)
		}
	}

	// The admin view encodes, and says why each bad member is out.
	rec := httptest.NewRecorder()
	if err := handleCluster(rec, httptest.NewRequest("GET", "/rebalance/cluster", nil)); err != nil {
		t.Fatalf("admin view: %v", err)
	}
	if rec.Code != http.StatusOK || !json.Valid(rec.Body.Bytes()) {
		t.Fatalf("admin view: status %d, valid JSON %v:\n%s", rec.Code, json.Valid(rec.Body.Bytes()), rec.Body.String())
	}
	var rep ClusterReport
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
	loads, err := a.memberLoads(time.Now())
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
	testutil.WaitFor(t, 5*time.Second, "a decision on an infinite load", func() (bool, string) {
		a.node.mu.Lock()
		defer a.node.mu.Unlock()
		return math.IsInf(a.node.local, 1), fmt.Sprintf("local %v", a.node.local)
	})
	body, err := json.Marshal(BuildClusterReport())
	if err != nil {
		t.Fatalf("the admin view does not encode: %v", err)
	}
	if !json.Valid(body) {
		t.Fatalf("invalid JSON: %s", body)
	}
}

// TestTagSizeMatchesSerf: checkTagSize accepts exactly the tags that serf
// accepts with the longest load tag this node can publish, and refuses
// one byte more, which serf refuses too.
func TestTagSizeMatchesSerf(t *testing.T) {
	s := testutil.SerfMember(t, "tag-size", nil, "")
	tagsOf := func(n int) map[string]string {
		return map[string]string{"zone": "z", "blob": strings.Repeat("x", n)}
	}
	fits := -1
	for n := 300; n < 600; n++ {
		if checkTagSize(tagsOf(n), MetricConnections) != nil {
			fits = n - 1
			break
		}
	}
	if fits < 0 {
		t.Fatal("checkTagSize accepted 600 bytes of tags")
	}
	withLoad := func(n int) map[string]string {
		tags := tagsOf(n)
		tags[LoadTag] = longestLoadTag(MetricConnections)
		return tags
	}
	if err := s.SetTags(withLoad(fits)); err != nil {
		t.Errorf("checkTagSize accepts a %d-byte tag that serf refuses: %v", fits, err)
	}
	if err := s.SetTags(withLoad(fits + 1)); err == nil {
		t.Errorf("checkTagSize refuses a %d-byte tag that serf accepts", fits+1)
	}
	err := checkTagSize(tagsOf(fits+1), MetricConnections)
	if err == nil || !strings.Contains(err.Error(), "above serf's limit of 512") {
		t.Errorf("error %v; want one naming serf's limit", err)
	}
}

// TestNameConflictIsLoud: a node that joins with a node_name the cluster
// already has loses serf's vote, and its serf member shuts down. Caddy
// keeps running, but the node says so: the admin view's name_conflict,
// no stale member list, the name_conflict metric, and no more decisions.
func TestNameConflictIsLoud(t *testing.T) {
	first := testApp(t, "dup", &fakeSource{load: 10}, nil)
	witness := testApp(t, "dup-witness", &fakeSource{load: 10}, func(x *App) { x.Join = []string{first.gossipAddr()} })
	testutil.WaitFor(t, 15*time.Second, "the first dup counts the witness", func() (bool, string) { return seesLoads(first.node, 2) })

	// Another bind address, so that the pool does not hand back the
	// first one's member.
	second := testApp(t, "dup", &fakeSource{load: 10}, func(x *App) {
		x.Bind = "127.0.0.1:" + strconv.Itoa(freePort(t))
		x.Join = []string{first.gossipAddr()}
	})
	if second.node == first.node {
		t.Fatal("the second dup shares the first's member")
	}
	t.Cleanup(func() { stopTogether(first, witness, second) })
	n := second.node
	testutil.WaitFor(t, 20*time.Second, "the second dup reports the conflict", func() (bool, string) {
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.conflict != "", "no conflict yet"
	})
	n.mu.Lock()
	msg, reason := n.conflict, n.last.Reason
	n.mu.Unlock()
	t.Logf("conflict: %s", msg)
	if !strings.Contains(msg, `node_name "dup" is also used by the member at `+first.gossipAddr()) || reason != msg {
		t.Errorf("conflict %q, last reason %q; want them to name the other member %s", msg, reason, first.gossipAddr())
	}

	v := n.view(time.Now())
	if v.NameConflict != msg || len(v.Members) != 0 {
		t.Errorf("admin view: name_conflict %q, %d members; want the conflict and no members", v.NameConflict, len(v.Members))
	}
	if got := conflictSeries(t); len(got) != 1 || got[0] != "dup" {
		t.Errorf("name_conflict is 1 for %v; want for one node, dup (the second)", got)
	}
	// The first keeps its place and its view of the cluster.
	if ok, why := seesLoads(first.node, 2); !ok {
		t.Errorf("the first dup: %s", why)
	}
	// The loser decides no more.
	steps := n.steps.Load()
	testutil.WaitFor(t, 5*time.Second, "the first dup takes five more steps", func() (bool, string) {
		return first.node.steps.Load()-steps >= int64(5*first.interval), "not yet"
	})
	if got := n.steps.Load(); got != steps {
		t.Errorf("the second dup still takes steps after its member shut down")
	}
}

// conflictSeries returns the nodes whose name_conflict series is 1, from
// one collection of the metrics collector (the two nodes named alike in
// TestNameConflictIsLoud would make a registry refuse the gathering).
func conflictSeries(t *testing.T) []string {
	t.Helper()
	ch := make(chan prometheus.Metric, 1000)
	metricsCollector{tracker: new(ConnTracker)}.Collect(ch)
	close(ch)
	var out []string
	for m := range ch {
		if m.Desc() != descNameConflict {
			continue
		}
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		if pb.GetGauge().GetValue() == 1 {
			out = append(out, pb.GetLabel()[0].GetValue())
		}
	}
	return out
}

// TestGossipLogRateLimit: a burst of one kind of error from the gossip
// library writes gossipLogBurst lines per period; the rest are counted,
// and the first line of the next period says how many were suppressed.
// Each kind has its own budget.
func TestGossipLogRateLimit(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	w := &zapWriter{logger: zap.New(core)}
	lines0, suppressed0 := gossipLogs.lines.Load(), gossipLogs.suppressed.Load()
	for i := range 1000 {
		fmt.Fprintf(w, "[ERR] memberlist: Failed to decode ping: bad %d from=127.0.0.1:%d\n", i, 1000+i)
	}
	fmt.Fprintf(w, "[WARN] memberlist: Got ping for unexpected node from=127.0.0.1:1\n")
	if n := logs.FilterLevelExact(zapcore.ErrorLevel).Len(); n != gossipLogBurst {
		t.Errorf("%d error lines written of 1000; want %d", n, gossipLogBurst)
	}
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Errorf("%d warning lines of another kind; want 1", n)
	}
	if d := gossipLogs.lines.Load() - lines0; d != 1001 {
		t.Errorf("lines counted: %d; want 1001", d)
	}
	if d := gossipLogs.suppressed.Load() - suppressed0; d != 1000-gossipLogBurst {
		t.Errorf("lines suppressed: %d; want %d", d, 1000-gossipLogBurst)
	}
	// The next period.
	w.mu.Lock()
	for _, k := range w.kinds {
		k.start = k.start.Add(-gossipLogPeriod)
	}
	w.mu.Unlock()
	fmt.Fprintf(w, "[ERR] memberlist: Failed to decode ping: bad again from=127.0.0.1:9\n")
	all := logs.FilterLevelExact(zapcore.ErrorLevel).All()
	last := all[len(all)-1]
	if got := last.ContextMap()["suppressed_similar"]; got != int64(1000-gossipLogBurst) {
		t.Errorf("first line of the next period: suppressed_similar %v; want %d (%v)", got, 1000-gossipLogBurst, last.ContextMap())
	}
	// Packets that each quote something else do not each get a kind.
	for i := range 500 {
		fmt.Fprintf(w, "[ERR] memberlist: discarding packet with unacceptable label \"l%d\": from=127.0.0.1:1\n", i)
	}
	for i := range 200 {
		fmt.Fprintf(w, "[ERR] memberlist: error %c%d\n", 'a'+rune(i%26), i)
	}
	w.mu.Lock()
	kinds := len(w.kinds)
	w.mu.Unlock()
	if kinds > gossipLogKinds {
		t.Errorf("%d kinds tracked; want at most %d", kinds, gossipLogKinds)
	}
}

// TestGossipGarbagePackets sends garbage UDP packets to a real node's
// gossip port: memberlist logs an error for each, and the rate limit
// lets only a few through.
func TestGossipGarbagePackets(t *testing.T) {
	a := testApp(t, "garbage-target", &fakeSource{}, nil)
	conn, err := net.Dial("udp", a.gossipAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	lines0, suppressed0 := gossipLogs.lines.Load(), gossipLogs.suppressed.Load()
	const packets = 2000
	for i := range packets {
		// 255 is no memberlist message type.
		conn.Write([]byte{255, byte(i), byte(i >> 8), 'x'})
	}
	testutil.WaitFor(t, 10*time.Second, "memberlist reports most of the packets", func() (bool, string) {
		d := gossipLogs.lines.Load() - lines0
		return d >= packets/2, fmt.Sprintf("%d lines", d)
	})
	lines, suppressed := gossipLogs.lines.Load()-lines0, gossipLogs.suppressed.Load()-suppressed0
	t.Logf("%d garbage packets: %d error lines, %d suppressed", packets, lines, suppressed)
	if written := lines - suppressed; written > 4*gossipLogBurst {
		t.Errorf("%d lines written for %d garbage packets; want at most %d", written, packets, 4*gossipLogBurst)
	}
}

// TestConflictLines: the node learns of serf's vote on its name from
// serf's log lines, and publishes no load while the vote runs (serf
// reads the member's node unlocked then, and SetTags writes it).
func TestConflictLines(t *testing.T) {
	n := &node{}
	w := &zapWriter{logger: zap.NewNop(), conflict: n.sawConflict, conflictOver: n.conflictOver}
	now := time.Now()
	if n.resolvingConflict(now) {
		t.Fatal("resolving before any conflict")
	}
	fmt.Fprintf(w, "[ERR] serf: Node name conflicts with another node at 10.0.0.1:7946. Names must be unique! (Resolution enabled: true)\n")
	if with := n.conflictWith.Load(); with == nil || *with != "10.0.0.1:7946" {
		t.Fatalf("conflict with %v; want 10.0.0.1:7946", with)
	}
	if !n.resolvingConflict(time.Now()) {
		t.Fatal("not resolving after serf's conflict line")
	}
	if n.resolvingConflict(time.Now().Add(maxConflictVote)) {
		t.Error("still resolving after maxConflictVote")
	}
	fmt.Fprintf(w, "[INFO] serf: majority in name conflict resolution [2 / 3]\n")
	if n.resolvingConflict(time.Now()) {
		t.Error("still resolving after the vote kept the name")
	}
}
