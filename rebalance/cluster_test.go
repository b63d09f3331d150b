package rebalance

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// fakeSource is a load source with a settable load that records sheds.
// In a fakeFleet, what it sheds reconnects to a random source of the
// fleet; alone, shed connections are gone.
type fakeSource struct {
	mu    sync.Mutex
	load  float64
	shed  int
	fleet *fakeFleet
}

// fakeFleet is the outer balancer of a set of fake sources: every shed
// connection reconnects to one of them at random, possibly the one that
// shed it, as clients do through a random TCP balancer.
type fakeFleet struct {
	mu   sync.Mutex
	rng  *rand.Rand
	srcs []*fakeSource
}

// newFakeFleet returns one source per load, in a fleet.
func newFakeFleet(loads ...float64) []*fakeSource {
	f := &fakeFleet{rng: rand.New(rand.NewPCG(1, 2))}
	for _, l := range loads {
		f.srcs = append(f.srcs, &fakeSource{load: l, fleet: f})
	}
	return f.srcs
}

// land reconnects n clients.
func (f *fakeFleet) land(n int) {
	for range n {
		f.mu.Lock()
		dst := f.srcs[f.rng.IntN(len(f.srcs))]
		f.mu.Unlock()
		dst.mu.Lock()
		dst.load++
		dst.mu.Unlock()
	}
}

func (f *fakeSource) Sample(string) (float64, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.load, int(f.load)
}

func (f *fakeSource) Sweep(time.Duration, time.Duration) conntrack.SweepResult {
	return conntrack.SweepResult{}
}

func (f *fakeSource) Shed(n int) ShedResult {
	f.mu.Lock()
	f.shed += n
	f.load -= float64(n)
	f.mu.Unlock()
	if f.fleet != nil {
		f.fleet.land(n)
	}
	return ShedResult{Idle: n}
}

func (f *fakeSource) get() (load float64, shed int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.load, f.shed
}

// testApp provisions and starts a cluster app on 127.0.0.1 with a port
// chosen by the kernel and a rebalance app on it with the given source;
// mut may change either before they are provisioned. Both stop at the end
// of the test, unless the test stopped them.
func testApp(t *testing.T, name string, src loadSource, mut func(*cluster.App, *App)) *App {
	t.Helper()
	zero := 0
	c := &cluster.App{NodeName: name, Bind: "127.0.0.1:0"}
	a := &App{
		Interval:       caddy.Duration(100 * time.Millisecond),
		History:        caddy.Duration(100 * time.Millisecond),
		MinConnections: &zero,
		ShedRate:       10,
		source:         src,
		cluster:        c,
	}
	if mut != nil {
		mut(c, a)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	for _, step := range []struct {
		what string
		do   func() error
	}{
		{"provision cluster", func() error { return c.Provision(ctx) }},
		{"provision rebalance", func() error { return a.Provision(ctx) }},
		{"validate", a.Validate},
		{"start cluster", c.Start},
		{"start rebalance", a.Start},
	} {
		if err := step.do(); err != nil {
			cancel()
			t.Fatalf("%s %s: %v", step.what, name, err)
		}
	}
	t.Cleanup(func() {
		a.Stop()
		c.Stop()
		a.Cleanup()
		cancel() // runs Cleanup: idempotent
	})
	return a
}

// gossipAddr returns the gossip address the app's cluster member listens
// on.
func (a *App) gossipAddr() string {
	st, _ := a.cluster.Status()
	return st.Addr
}

// stopAll stops the rebalance app, then its cluster app, as Caddy stops
// a config.
func (a *App) stopAll() error {
	err := a.Stop()
	if e := a.cluster.Stop(); err == nil {
		err = e
	}
	return err
}

// memberOf returns the member named name as a's cluster member sees it.
func memberOf(a *App, name string) (cluster.Member, bool) {
	ms, _ := a.cluster.Members()
	for _, m := range ms {
		if m.Name == name {
			return m, true
		}
	}
	return cluster.Member{}, false
}

// aliveOthers counts the alive members a's cluster member sees, itself
// left out.
func aliveOthers(a *App) int {
	ms, _ := a.cluster.Members()
	n := 0
	for _, m := range ms {
		if !m.Self && m.Status == cluster.StatusAlive {
			n++
		}
	}
	return n
}

// seesLoads reports whether n's last decision counted want members, and
// its members' loads.
func seesLoads(n *node, want int) (bool, string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var b strings.Builder
	for _, r := range n.members {
		fmt.Fprintf(&b, "%s:%v:%.0f:%v ", r.Name, r.Status, r.Load, !r.At.IsZero())
	}
	return n.last.Counted == want, fmt.Sprintf("counted %d; members %s; reason %q", n.last.Counted, b.String(), n.last.Reason)
}

// TestClusterGossipAndShed starts three members on loopback that join one
// another, gossip their loads, and checks that each counts all three and
// that only the overloaded one sheds, down to the stop band.
func TestClusterGossipAndShed(t *testing.T) {
	fleet := newFakeFleet(400, 100, 100)
	srcA, srcB, srcC := fleet[0], fleet[1], fleet[2]
	a := testApp(t, "node-a", srcA, nil)
	join := func(c *cluster.App, x *App) { c.Join = []string{a.gossipAddr()} }
	b := testApp(t, "node-b", srcB, join)
	c := testApp(t, "node-c", srcC, join)

	for _, x := range []*App{a, b, c} {
		lbxtest.WaitFor(t, 15*time.Second, x.cluster.NodeName+" counts three fresh members", func() (bool, string) { return seesLoads(x.node, 3) })
	}
	// a: 400 against an average of 200 sheds, and its clients land on a
	// random member (a third of them back on a): a ends between the
	// average (lifting b and c goes no further) and the stop line, 110% of
	// it, and the others never shed.
	lbxtest.WaitFor(t, 20*time.Second, "node-a reaches the stop band", func() (bool, string) {
		load, shed := srcA.get()
		a.node.mu.Lock()
		d := a.node.last
		a.node.mu.Unlock()
		return shed > 0 && !d.Active(), fmt.Sprintf("load %.0f, shed %d, last decision %+v", load, shed, d)
	})
	loadA, shedA := srcA.get()
	loadB, _ := srcB.get()
	loadC, _ := srcC.get()
	if total := loadA + loadB + loadC; total != 600 {
		t.Fatalf("the fleet holds %.0f connections; want 600", total)
	}
	const avg = 200.0
	if loadA > avg*1.1+1 {
		t.Errorf("node-a stopped at %.0f, above the stop line %.1f", loadA, avg*1.1)
	}
	// Below the average by at most 5%: under the race detector on two busy
	// cores a decision may act on a count an interval old. (Before
	// Decision.PhaseAverage, node-a's view of the average sank to 157
	// while it shed, its peers' gains not yet gossiped, and CI saw it end
	// at 176.)
	if loadA < avg*0.95 {
		t.Errorf("node-a shed down to %.0f, below the average %.0f (more than needed)", loadA, avg)
	}
	if _, s := srcB.get(); s != 0 {
		t.Errorf("node-b shed %d", s)
	}
	if _, s := srcC.get(); s != 0 {
		t.Errorf("node-c shed %d", s)
	}
	t.Logf("node-a shed %d, ends at %.0f (average %.1f, stop line %.1f)", shedA, loadA, avg, avg*1.1)

	// The admin view shows the three members, counted, with their loads.
	// Counted is the load tags' rule, and a tag whose load does not move
	// changes only at its keep-alive (freshness/2): the fleet may converge
	// on the gossip average before node-b has seen every tag change, so
	// the view is read until it counts all three.
	var nv nodeView
	lbxtest.WaitFor(t, 10*time.Second, "node-b's admin view counts three alive members in metric connections", func() (bool, string) {
		rec := httptest.NewRecorder()
		if err := handleRebalance(rec, httptest.NewRequest("GET", "/lbx/rebalance", nil)); err != nil {
			t.Fatal(err)
		}
		var rep rebalanceView
		if err := json.Unmarshal(rec.Body.Bytes(), &rep); err != nil {
			t.Fatalf("admin body: %v\n%s", err, rec.Body.String())
		}
		for i := range rep.Nodes {
			if rep.Nodes[i].Name == "node-b" {
				nv = rep.Nodes[i]
			}
		}
		if len(nv.Members) != 3 {
			return false, rec.Body.String()
		}
		for _, m := range nv.Members {
			if !m.Counted || m.Status != "alive" || m.Metric != "connections" {
				return false, fmt.Sprintf("member %+v", m)
			}
		}
		return true, ""
	})
	if nv.Encrypted {
		t.Error("admin view: encrypted without a key")
	}
}

// TestClusterLeaveOnStopAndGhost stops a member: the others see it "left"
// (a graceful Leave, not a crash) and exclude it from the average.
func TestClusterLeaveOnStopAndGhost(t *testing.T) {
	a := testApp(t, "ghost-a", &fakeSource{load: 100}, nil)
	b := testApp(t, "ghost-b", &fakeSource{load: 100}, func(c *cluster.App, x *App) { c.Join = []string{a.gossipAddr()} })
	c := testApp(t, "ghost-c", &fakeSource{load: 0}, func(c *cluster.App, x *App) { c.Join = []string{a.gossipAddr()} })
	lbxtest.WaitFor(t, 15*time.Second, "ghost-a counts three", func() (bool, string) { return seesLoads(a.node, 3) })

	if err := c.stopAll(); err != nil {
		t.Fatal(err)
	}
	if _, running := c.cluster.Status(); running {
		t.Fatal("after the last Stop, the cluster member still runs")
	}
	lbxtest.WaitFor(t, 15*time.Second, "ghost-a sees ghost-c left and counts two", func() (bool, string) {
		ok, why := seesLoads(a.node, 2)
		if m, found := memberOf(a, "ghost-c"); found {
			return ok && m.Status == cluster.StatusLeft, fmt.Sprintf("ghost-c %v; %s", m.Status, why)
		}
		return false, "ghost-c not listed"
	})
	_ = b
}

// TestClusterReloadKeepsMember starts a config, then a second one with
// the same bind address (Caddy starts the new config before stopping the
// old): the member is reused, not bound twice; stopping the old config
// leaves it running with the new settings, and stopping the new one
// leaves the cluster.
func TestClusterReloadKeepsMember(t *testing.T) {
	peer := testApp(t, "reload-peer", &fakeSource{load: 10}, nil)
	// A fixed port, so that the two configs share the pool key.
	port := freePort(t)
	bind := "127.0.0.1:" + strconv.Itoa(port)
	old := testApp(t, "reload-x", &fakeSource{load: 10}, func(c *cluster.App, x *App) {
		c.Bind = bind
		c.Join = []string{peer.gossipAddr()}
		c.Tags = map[string]string{"zone": "a"}
	})
	lbxtest.WaitFor(t, 15*time.Second, "peer counts reload-x", func() (bool, string) { return seesLoads(peer.node, 2) })

	src2 := &fakeSource{load: 20}
	neu := testApp(t, "reload-x", src2, func(c *cluster.App, x *App) {
		c.Bind = bind
		c.Tags = map[string]string{"zone": "b"}
		// Not shedding, so that its load stays the new source's.
		many := 1000
		x.MinConnections = &many
	})
	if neu.node != old.node {
		t.Fatal("the new config created a second member instead of reusing the old one")
	}
	if err := old.stopAll(); err != nil {
		t.Fatal(err)
	}
	if _, running := neu.cluster.Status(); !running {
		t.Fatal("after stopping the old config, the cluster member no longer runs")
	}
	// The new settings drive: the peer sees the new tag and the new load.
	lbxtest.WaitFor(t, 15*time.Second, "peer sees zone b and load 20", func() (bool, string) {
		if m, found := memberOf(peer, "reload-x"); found {
			_, load, _ := shed.ParseLoadTag(m.Tags[shed.LoadTag])
			return m.Status == cluster.StatusAlive && m.Tags["zone"] == "b" && load == 20, fmt.Sprintf("%v %v", m.Status, m.Tags)
		}
		return false, "not listed"
	})
	if err := neu.stopAll(); err != nil {
		t.Fatal(err)
	}
	if _, running := neu.cluster.Status(); running {
		t.Fatal("after stopping the last config, the cluster member still runs")
	}
	// The port is free again.
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		t.Fatalf("bind address still in use after the last Stop: %v", err)
	}
	ln.Close()
}

// TestClusterWrongKeyCannotJoin: a member with another gossip key cannot
// join, and says why.
func TestClusterWrongKeyCannotJoin(t *testing.T) {
	key1 := base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))
	key2 := base64.StdEncoding.EncodeToString([]byte("fedcba9876543210fedcba9876543210"))
	a := testApp(t, "key-a", &fakeSource{}, func(c *cluster.App, x *App) { c.EncryptKey = key1 })
	good := testApp(t, "key-good", &fakeSource{}, func(c *cluster.App, x *App) { c.EncryptKey = key1; c.Join = []string{a.gossipAddr()} })
	bad := testApp(t, "key-bad", &fakeSource{}, func(c *cluster.App, x *App) { c.EncryptKey = key2; c.Join = []string{a.gossipAddr()} })
	lbxtest.WaitFor(t, 15*time.Second, "key-good joins", func() (bool, string) {
		return aliveOthers(good) == 1, fmt.Sprintf("%d others", aliveOthers(good))
	})
	joinErr := ""
	lbxtest.WaitFor(t, 15*time.Second, "key-bad reports a join error", func() (bool, string) {
		st, _ := bad.cluster.Status()
		joinErr = st.JoinError
		return joinErr != "", "no join error yet"
	})
	t.Logf("join error with the wrong key: %s", joinErr)
	if n := aliveOthers(bad); n != 0 {
		t.Errorf("key-bad sees %d other members", n)
	}
	if m, found := memberOf(a, "key-bad"); found {
		t.Errorf("key-a lists key-bad (%v)", m.Status)
	}
	if st, _ := a.cluster.Status(); !st.Encrypted {
		t.Error("encryption not enabled with a key")
	}
}

var freePort = lbxtest.FreePort

// TestAdminMethod: only GET.
func TestAdminMethod(t *testing.T) {
	err := handleRebalance(httptest.NewRecorder(), httptest.NewRequest("POST", "/rebalance/cluster", nil))
	if apiErr, ok := err.(caddy.APIError); !ok || apiErr.HTTPStatus != http.StatusMethodNotAllowed {
		t.Fatalf("POST: %v; want 405", err)
	}
}

// testContext returns a bare Caddy context cancelled at the end of the
// test.
// provisionApp provisions and validates a as Caddy does, and cleans it
// up (releasing the process's connections) when the test ends.
func provisionApp(t *testing.T, a *App) error {
	t.Cleanup(func() { a.Cleanup() })
	err := a.Provision(testContext(t))
	if err == nil {
		err = a.Validate()
	}
	return err
}

func testContext(t *testing.T) caddy.Context {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	return ctx
}
