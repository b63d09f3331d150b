package rebalance

import (
	"context"
	"encoding/base64"
	"fmt"
	"math"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// poisonKey is the gossip key of the poisoning tests: the liar has it.
var poisonKey = base64.StdEncoding.EncodeToString([]byte("poison-key-0123456789abcdef-0123"))

// liar is a cluster member with the key that publishes a plausible load
// tag and takes part in the gossip averaging as flow updating does, but
// claims whatever estimate it is told to: each request carries the flow
// it holds with the peer (so that the peer adopts it) and the lie, so
// every exchange moves the peer halfway to the lie.
type liar struct {
	app   *cluster.App
	kind  byte
	inc   uint64
	mu    sync.Mutex
	lie   [2]float64 // the load estimate and the size indicator's
	seq   uint64
	pairs map[string]*liarPair
}

// liarPair is what the liar knows of its exchange with one peer.
type liarPair struct {
	inc, version uint64
	flow         [gossipavg.MaxDim]float64
}

// startLiar starts a plain cluster app named name, joined to join, with
// the poisoning key; it publishes a load tag of load connections, fresh
// every 100 ms, and sends requests to every alive member in the
// connections metric every 20 ms until the test ends.
func startLiar(t *testing.T, name, join string, load float64) *liar {
	t.Helper()
	c := &cluster.App{NodeName: name, Bind: "127.0.0.1:0", EncryptKey: poisonKey, Join: []string{join}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := c.Provision(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := c.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	l := &liar{app: c, kind: averageKinds[metricConnections], inc: 0x5eed, pairs: map[string]*liarPair{}}
	stopHandler, err := c.HandleDirect(l.kind, l.reply)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			if i%5 == 0 {
				_ = c.Publish(shed.LoadTag, shed.FormatLoadReport(metricConnections, load, uint64(i)))
			}
			l.requestAll()
		}
	}()
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
		stopHandler()
		c.Stop()
		cancel()
	})
	return l
}

// tell sets the lie: the estimate of the average load, and of the
// cluster's size.
func (l *liar) tell(load float64, size int) {
	l.mu.Lock()
	l.lie = [2]float64{load, 1 / float64(size)}
	l.mu.Unlock()
}

// requestAll sends one request to every other alive member.
func (l *liar) requestAll() {
	ms, err := l.app.Members()
	if err != nil {
		return
	}
	for _, m := range ms {
		if m.Self || m.Status != cluster.StatusAlive {
			continue
		}
		l.mu.Lock()
		p := l.pairs[m.Name]
		if p == nil {
			p = &liarPair{}
			l.pairs[m.Name] = p
		}
		l.seq++
		msg := gossipavg.Message{
			Kind: gossipavg.Request, From: l.app.NodeName, To: m.Name,
			FromIncarnation: l.inc, ToIncarnation: p.inc, Seq: l.seq, Version: p.version,
			Dim: 2, Flow: p.flow,
		}
		msg.Estimate[0], msg.Estimate[1] = l.lie[0], l.lie[1]
		l.mu.Unlock()
		if b, err := msg.AppendBinary(nil); err == nil {
			_ = l.app.SendDirect(m.Name, l.kind, b)
		}
	}
}

// reply takes a peer's answer: the flow it holds, which the liar holds
// the other way.
func (l *liar) reply(from string, payload []byte) {
	m, err := gossipavg.Decode(payload)
	if err != nil || m.Kind != gossipavg.Reply {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.pairs[from]
	if p == nil || m.Version < p.version {
		return
	}
	p.inc, p.version = m.FromIncarnation, m.Version
	for k := range m.Dim {
		p.flow[k] = -m.Flow[k]
	}
}

// sheds returns what the honest nodes shed and in how many intervals.
func sheds(srcs []*fakeSource, apps []*App) string {
	s := ""
	for i, x := range apps {
		_, shed := srcs[i].get()
		_, decisions := lastDecision(x.node)
		s += fmt.Sprintf("%s shed %d in %d intervals; ", x.cluster.NodeName, shed, decisions)
	}
	return s
}

// TestPoisonedAveragesShedNothing is the acceptance of "a member is
// trusted to join, not to decide": three real nodes holding 40
// connections each and a member with the key (the liar, its load tag a
// plausible 40) that claims averages of 0.001, -1, +1e18 and -1e18 with
// a plausible size. Before, 0.001 and -1 made the honest nodes shed
// about half their connections "from gossip" within seconds, and ±1e18
// took their average to absurd values (no shedding at all). Now the
// honest nodes refuse the lies (messages_refused grows), decide on the
// tags' average, 40, and shed nothing.
func TestPoisonedAveragesShedNothing(t *testing.T) {
	const load = 40
	srcs := []*fakeSource{{load: load}, {load: load}, {load: load}}
	keyed := func(c *cluster.App, x *App) { c.EncryptKey = poisonKey }
	a := testApp(t, "poison-1", srcs[0], keyed)
	join := func(c *cluster.App, x *App) { keyed(c, x); c.Join = []string{a.gossipAddr()} }
	b := testApp(t, "poison-2", srcs[1], join)
	c := testApp(t, "poison-3", srcs[2], join)
	honest := []*App{a, b, c}
	t.Cleanup(func() { stopTogether(honest...) })
	// Before any lie: the honest nodes decide on the gossip average.
	waitAverage(t, "three honest members", load, 3, a, b, c)

	l := startLiar(t, "poison-liar", a.gossipAddr(), load)
	l.tell(load, 4) // the truth, at first: it joins the averaging
	for _, x := range honest {
		lbxtest.WaitFor(t, 20*time.Second, x.cluster.NodeName+" counts the liar's tag", func() (bool, string) {
			return seesLoads(x.node, 4)
		})
	}

	for _, lie := range []float64{0.001, -1, 1e18, -1e18} {
		var before [3]int
		for i := range srcs {
			_, before[i] = srcs[i].get()
		}
		l.tell(lie, 4)
		refusedBefore := a.node.avg.refused.Load() + b.node.avg.refused.Load() + c.node.avg.refused.Load()
		// 30 intervals: before, 0.001 had the nodes shedding within 10.
		start := a.node.steps.Load()
		lbxtest.WaitFor(t, 15*time.Second, fmt.Sprintf("30 intervals of the lie %g", lie), func() (bool, string) {
			return a.node.steps.Load()-start >= int64(30*time.Duration(a.Interval)), sheds(srcs, honest)
		})
		for i, x := range honest {
			v, d := averageOf(x.node)
			if _, shed := srcs[i].get(); shed != before[i] || d.Active() {
				t.Errorf("lie %g: %s shed %d connections (last decision %+v, average from %s); want none", lie, x.cluster.NodeName, shed-before[i], d, v.Source())
			}
			if math.Abs(d.Average-load) > shed.MeanSlack(x.node.driver().params, load) {
				t.Errorf("lie %g: %s decided on an average of %v (from %s); want about %d", lie, x.cluster.NodeName, d.Average, v.Source(), load)
			}
		}
		refused := a.node.avg.refused.Load() + b.node.avg.refused.Load() + c.node.avg.refused.Load()
		if refused == refusedBefore {
			t.Errorf("lie %g: no averaging message refused", lie)
		}
		t.Logf("lie %g: %d messages refused; %s", lie, refused-refusedBefore, sheds(srcs, honest))
	}
}

// TestDuplicateNameShedsNothing: three real nodes holding 40 connections
// each, deciding on the gossip average; then a node started under
// dup-2's node_name on another port, holding nothing (what a restarted
// dup-2 would say). Before, its averaging messages read as dup-2's new
// incarnation, and the others shed to lift it before serf's name vote
// shut it down. Now its messages do not come from the address of the
// member named dup-2, and are dropped: nobody sheds, the newcomer
// included.
func TestDuplicateNameShedsNothing(t *testing.T) {
	const load = 40
	srcs := []*fakeSource{{load: load}, {load: load}, {load: load}}
	keyed := func(c *cluster.App, x *App) { c.EncryptKey = poisonKey }
	a := testApp(t, "dup-1", srcs[0], keyed)
	join := func(c *cluster.App, x *App) { keyed(c, x); c.Join = []string{a.gossipAddr()} }
	b := testApp(t, "dup-2", srcs[1], join)
	c := testApp(t, "dup-3", srcs[2], join)
	honest := []*App{a, b, c}
	t.Cleanup(func() { stopTogether(honest...) })
	waitAverage(t, "three honest members", load, 3, a, b, c)

	dup := testApp(t, "dup-2", &fakeSource{load: 0}, func(cc *cluster.App, x *App) {
		join(cc, x)
		cc.Bind = "127.0.0.1:" + strconv.Itoa(freePort(t))
	})
	t.Cleanup(func() { stopTogether(dup) })
	// Meanwhile, the honest nodes' gossip averages stay at 40: the
	// newcomer's messages are not counted (before, they fell to 14-20,
	// and only the size estimate, which they threw off too, kept that
	// average out of the decisions in this test).
	start, lowest, lowestAt := a.node.steps.Load(), math.Inf(1), ""
	lbxtest.WaitFor(t, 20*time.Second, "the duplicate loses the name vote, and 30 intervals pass", func() (bool, string) {
		for _, x := range honest {
			if v, _ := averageOf(x.node); !v.LastExchange.IsZero() && v.Average < lowest {
				lowest, lowestAt = v.Average, x.cluster.NodeName
			}
		}
		st, _ := dup.cluster.Status()
		return st.Conflict != "" && a.node.steps.Load()-start >= int64(30*time.Duration(a.Interval)), fmt.Sprintf("conflict %q; %s", st.Conflict, sheds(srcs, honest))
	})
	if lowest < load-shed.MeanSlack(a.node.driver().params, load) {
		t.Errorf("%s's gossip average fell to %v while the duplicate ran; want about %d", lowestAt, lowest, load)
	}
	for i, x := range honest {
		if _, shed := srcs[i].get(); shed != 0 {
			_, d := averageOf(x.node)
			t.Errorf("%s shed %d connections (last decision %+v); want none", x.cluster.NodeName, shed, d)
		}
	}
	if _, decisions := lastDecision(dup.node); decisions != 0 {
		t.Errorf("the duplicate shed in %d intervals; want none", decisions)
	}
	t.Logf("%s", sheds(srcs, honest))
}
