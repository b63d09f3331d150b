package cluster

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestNameConflictIsLoud: a node that joins with a node_name the cluster
// already has loses serf's vote, and its serf member shuts down. Caddy
// keeps running, but the member says so: its status and the admin view's
// name_conflict, no stale member list, the name_conflict metric, and
// Members and Publish return the conflict.
func TestNameConflictIsLoud(t *testing.T) {
	first := testCluster(t, "dup", nil)
	testCluster(t, "dup-witness", func(a *App) { a.Join = []string{first.gossipAddr()} })
	lbxtest.WaitFor(t, 15*time.Second, "the first dup sees the witness", func() (bool, string) {
		ms, _ := first.Members()
		return len(ms) == 2, fmt.Sprintf("%d members", len(ms))
	})
	// Another bind address, so that the pool does not hand back the
	// first one's member.
	second := testCluster(t, "dup", func(a *App) {
		a.Bind = "127.0.0.1:" + strconv.Itoa(freePort(t))
		a.Join = []string{first.gossipAddr()}
	})
	msg := ""
	lbxtest.WaitFor(t, 20*time.Second, "the second dup reports the conflict", func() (bool, string) {
		st, _ := second.Status()
		msg = st.Conflict
		return msg != "", "no conflict yet"
	})
	t.Logf("conflict: %s", msg)
	if !strings.Contains(msg, `node_name "dup" is also used by the member at `+first.gossipAddr()) {
		t.Errorf("conflict %q; want it to name the other member %s", msg, first.gossipAddr())
	}
	if _, err := second.Members(); err == nil || err.Error() != msg {
		t.Errorf("Members: %v; want the conflict", err)
	}
	if err := second.Publish("lbx_x", "1"); err == nil || err.Error() != msg {
		t.Errorf("Publish: %v; want the conflict", err)
	}
	var view *nodeView
	for _, v := range buildClusterView().Nodes {
		if v.Bind == second.Key() {
			view = &v
		}
	}
	if view == nil || view.NameConflict != msg || len(view.Members) != 0 {
		t.Errorf("admin view %+v; want the conflict and no members", view)
	}
	if got := conflictSeries(t); len(got) != 1 || got[0] != "dup" {
		t.Errorf("name_conflict is 1 for %v; want for one node, dup (the second)", got)
	}
	// The first keeps its place and its view of the cluster.
	if ms, err := first.Members(); err != nil || len(ms) < 2 {
		t.Errorf("the first dup: %d members, %v", len(ms), err)
	}
}

// conflictSeries returns the nodes whose name_conflict series is 1, from
// one collection of the metrics collector (the two nodes named alike in
// TestNameConflictIsLoud make a registry refuse the gathering).
func conflictSeries(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, s := range collect(t, descNameConflict) {
		if s.value == 1 {
			out = append(out, s.labels["node"])
		}
	}
	return out
}

// sample is one series of a metric: its labels and value.
type sample struct {
	labels map[string]string
	value  float64
}

// collect returns the series of desc from one collection of the metrics
// collector (not a registry's gathering: see conflictSeries).
func collect(t *testing.T, desc *prometheus.Desc) []sample {
	t.Helper()
	ch := make(chan prometheus.Metric, 1000)
	collector{}.Collect(ch)
	close(ch)
	var out []sample
	for m := range ch {
		if m.Desc() != desc {
			continue
		}
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		s := sample{labels: map[string]string{}, value: pb.GetCounter().GetValue() + pb.GetGauge().GetValue()}
		for _, l := range pb.GetLabel() {
			s.labels[l.GetName()] = l.GetValue()
		}
		out = append(out, s)
	}
	return out
}

// TestGossipLogRateLimit: a burst of one kind of error from the gossip
// library writes gossipLogBurst lines per period; the rest are counted,
// and the first line of the next period says how many were suppressed.
// Each kind has its own budget.
func TestGossipLogRateLimit(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	w := &serfLog{logger: zap.New(core)}
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
	a := testCluster(t, "garbage-target", nil)
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
	lbxtest.WaitFor(t, 10*time.Second, "memberlist reports most of the packets", func() (bool, string) {
		d := gossipLogs.lines.Load() - lines0
		return d >= packets/2, fmt.Sprintf("%d lines", d)
	})
	lines, suppressed := gossipLogs.lines.Load()-lines0, gossipLogs.suppressed.Load()-suppressed0
	t.Logf("%d garbage packets: %d error lines, %d suppressed", packets, lines, suppressed)
	if written := lines - suppressed; written > 4*gossipLogBurst {
		t.Errorf("%d lines written for %d garbage packets; want at most %d", written, packets, 4*gossipLogBurst)
	}
}

// TestConflictLines: the member learns of serf's vote on its name from
// serf's log lines, and publishes no load while the vote runs (serf
// reads the member's node unlocked then, and SetTags writes it).
func TestConflictLines(t *testing.T) {
	n := &member{}
	w := &serfLog{logger: zap.NewNop(), conflict: n.sawConflict, conflictOver: n.conflictOver}
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
