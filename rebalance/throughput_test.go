package rebalance

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestRateMeter covers the sampling math: the first sample, deltas, zero
// and negative intervals, and a counter that went backwards.
func TestRateMeter(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var m rateMeter
	if r := m.sample(5_000, t0); r != 0 {
		t.Fatalf("first sample = %v; want 0 (no baseline)", r)
	}
	if r := m.sample(15_000, t0.Add(2*time.Second)); r != 5_000 {
		t.Fatalf("10000 bytes in 2s = %v; want 5000", r)
	}
	if r := m.sample(15_000, t0.Add(3*time.Second)); r != 0 {
		t.Fatalf("no bytes in 1s = %v; want 0", r)
	}
	if r := m.sample(16_000, t0.Add(3500*time.Millisecond)); r != 2_000 {
		t.Fatalf("1000 bytes in 0.5s = %v; want 2000", r)
	}
	// Zero interval: the previous rate, and the baseline stays, so the
	// next sample measures the whole time since 3.5s.
	if r := m.sample(99_000, t0.Add(3500*time.Millisecond)); r != 2_000 {
		t.Fatalf("zero interval = %v; want the previous rate 2000", r)
	}
	if r := m.sample(20_000, t0.Add(4500*time.Millisecond)); r != 4_000 {
		t.Fatalf("4000 bytes since the last real sample, 1s = %v; want 4000", r)
	}
	// A clock step back behaves like a zero interval.
	if r := m.sample(30_000, t0.Add(time.Second)); r != 4_000 {
		t.Fatalf("negative interval = %v; want the previous rate", r)
	}
	// A counter that went backwards restarts.
	if r := m.sample(10, t0.Add(5*time.Second)); r != 0 {
		t.Fatalf("counter reset = %v; want 0", r)
	}
	if r := m.sample(1_010, t0.Add(6*time.Second)); r != 1_000 {
		t.Fatalf("after the reset = %v; want 1000", r)
	}

	// A primed meter measures from the prime on.
	var p rateMeter
	p.prime(1_000, t0)
	if r := p.sample(4_000, t0.Add(time.Second)); r != 3_000 {
		t.Fatalf("after prime = %v; want 3000", r)
	}
}

// TestProcessSourceThroughput: the throughput sample is the bytes read
// and written per second since the previous sample, from the counters,
// with the held connections from the tracker.
func TestProcessSourceThroughput(t *testing.T) {
	bc := new(conntrack.ByteCounters)
	tr := conntrack.NewTracker()
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	tr.ConnState(a, http.StateNew)
	src := &processSource{tracker: tr, counters: bc}
	t0 := time.Now()
	src.bytes.prime(bc.Totals().Total(), t0)
	// 3 MB in and 9 MB out through a counted connection.
	server, client := lbxtest.TCPPair(t, func(l net.Listener) net.Listener { return bc.Listener(l, nil) })
	go func() {
		client.Write(make([]byte, 3_000_000))
		io.Copy(io.Discard, client)
	}()
	if _, err := io.ReadFull(server, make([]byte, 3_000_000)); err != nil {
		t.Fatal(err)
	}
	if _, err := server.Write(make([]byte, 9_000_000)); err != nil {
		t.Fatal(err)
	}
	if r := src.bytesPerSecond(bc.Totals().Total(), t0.Add(2*time.Second)); r != 6_000_000 {
		t.Fatalf("12 MB in 2 s = %v B/s; want 6e6", r)
	}
	if got := formatLoad(metricThroughput, 6_000_000); got != "6.0 MB/s" {
		t.Errorf("formatLoad = %q; want 6.0 MB/s", got)
	}
	if got := formatLoad(metricThroughput, -1); got != "0 B/s" {
		t.Errorf("formatLoad(-1) = %q", got)
	}
	if got := formatLoad(metricConnections, 1234); got != "1,234.0" {
		t.Errorf("formatLoad(connections) = %q", got)
	}
	load, held := src.Sample(metricThroughput)
	if held != 1 || load < 0 {
		t.Fatalf("Sample = %v, %d; want a rate and 1 connection held", load, held)
	}
}

// TestThroughputNeedsListenerWrapper: with metric throughput, a config
// in which no HTTP server has the rebalance listener wrapper does not
// load, and says how to fix it; one server with it is enough; a server
// that lists it twice (counting every byte twice) is rejected. When the
// rebalance app is provisioned from inside the HTTP app (a `dynamic serf`
// upstream asks for it, before every server is provisioned), the check
// waits for Start: it never fails a config that has the wrapper, and
// still refuses one that has none.
func TestThroughputNeedsListenerWrapper(t *testing.T) {
	const wrappers = `"listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "tls"}],`
	server := func(name, extra string) string {
		return fmt.Sprintf(`%q: {"listen": ["127.0.0.1:%d"], %s "routes": [{"handle": [{"handler": "static_response", "body": "ok"}]}]}`, name, freePort(t), extra)
	}
	serfServer := func(name, extra string) string {
		return fmt.Sprintf(`%q: {"listen": ["127.0.0.1:%d"], %s "routes": [{"handle": [{"handler": "reverse_proxy", "dynamic_upstreams": {"source": "serf", "port": "80"}}]}]}`, name, freePort(t), extra)
	}
	config := func(metric string, servers ...string) []byte {
		apps := `"cluster": {"node_name": "check", "bind": "127.0.0.1:0"}, "rebalance": {"metric": "` + metric + `"}`
		if len(servers) > 0 {
			apps = `"http": {"servers": {` + strings.Join(servers, ", ") + `}}, ` + apps
		}
		return []byte(`{"admin": {"disabled": true}, "apps": {` + apps + `}}`)
	}
	validate := func(cfg []byte) error {
		var c caddy.Config
		if err := json.Unmarshal(cfg, &c); err != nil {
			t.Fatal(err)
		}
		return caddy.Validate(&c)
	}
	const fix = "metric throughput needs the rebalance listener wrapper: add `listener_wrappers { rebalance tls }` to the servers global option"
	for _, tc := range []struct {
		name string
		cfg  []byte
		want string // "" for valid
	}{
		{"no wrapper", config("throughput", server("s", "")), fix + ` (JSON: "listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "tls"}] in a server); no HTTP server of this config has it`},
		{"no HTTP app", config("throughput"), fix},
		{"wrapper", config("throughput", server("s", wrappers)), ""},
		{"wrapper after tls is still a wrapper", config("throughput", server("s", `"listener_wrappers": [{"wrapper": "rebalance"}],`)), ""},
		{"one server of two", config("throughput", server("a", ""), server("b", wrappers)), ""},
		{"connections need no wrapper", config("connections", server("s", "")), ""},
		{"listed twice", config("connections", server("s", `"listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "rebalance"}, {"wrapper": "tls"}],`)), "listed twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := validate(tc.cfg)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("want a valid config, got %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v; want one containing %q", err, tc.want)
			}
		})
	}
	if c := loadedConns(); c != nil && c.servers.any() {
		t.Error("the registry still holds servers of configs that were only validated")
	}

	// Provisioned from inside the HTTP app: Caddy provisions apps and
	// servers in map order, so run both configs often enough to meet
	// every order.
	withWrapper := config("throughput", serfServer("a", ""), server("b", wrappers))
	withoutWrapper := config("throughput", serfServer("a", ""), server("b", ""))
	for range 12 {
		if err := validate(withWrapper); err != nil {
			t.Fatalf("a config with the wrapper on one server: %v", err)
		}
		err := caddy.Load(withoutWrapper, true)
		if err == nil || !strings.Contains(err.Error(), fix) {
			caddy.Stop()
			t.Fatalf("loading a config without the wrapper: %v; want %q", err, fix)
		}
	}
}

// simConn is a connection the tracker holds; closing it reports
// StateClosed, as net/http does when a socket closes.
type simConn struct {
	net.Conn
	tracker *conntrack.Tracker
	closed  atomic.Bool
}

func (c *simConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.tracker.ConnState(c, http.StateClosed)
	}
	return nil
}

// simTraffic is a node's traffic on the real pieces: a Tracker with idle
// connections and processSource's sampling and shedding. Before each
// sample every held connection adds perConn bytes per second since the
// previous sample to the byte total, so a connection shed stops carrying
// bytes, and the rate the node measures is exactly held × perConn,
// whatever the scheduling.
type simTraffic struct {
	*processSource
	perConn float64

	// landing are the nodes a shed client reconnects to, at random, as
	// through a random outer balancer (none: it goes away).
	landing []*simTraffic

	mu    sync.Mutex
	last  time.Time
	total uint64     // the bytes carried so far
	shed  ShedResult // what the tracker's sheds returned, added up
}

func newSimTraffic(conns int, perConn float64) *simTraffic {
	src := &processSource{tracker: conntrack.NewTracker()}
	src.bytes.prime(0, time.Now())
	s := &simTraffic{processSource: src, perConn: perConn}
	for range conns {
		s.connect()
	}
	return s
}

// connect adds an idle connection, as a client that made a request.
func (s *simTraffic) connect() {
	c := &simConn{tracker: s.tracker}
	s.tracker.ConnState(c, http.StateNew)
	s.tracker.ConnState(c, http.StateActive)
	s.tracker.ConnState(c, http.StateIdle)
}

// Sample returns, for metric throughput, the rate processSource measures
// from the simulated byte total, and the connections held.
func (s *simTraffic) Sample(metric string) (float64, int) {
	if metric != metricThroughput {
		return s.processSource.Sample(metric)
	}
	s.mu.Lock()
	now := time.Now()
	held := s.tracker.Counts().Held()
	if !s.last.IsZero() {
		s.total += uint64(float64(held) * s.perConn * now.Sub(s.last).Seconds())
	}
	s.last = now
	total := s.total
	s.mu.Unlock()
	return s.bytesPerSecond(total, now), held
}

// Shed sheds through the tracker and adds up what it shed.
func (s *simTraffic) Shed(n int) ShedResult {
	r := s.processSource.Shed(n)
	for range r.Total() {
		if len(s.landing) > 0 {
			s.landing[rand.IntN(len(s.landing))].connect()
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shed.Idle += r.Idle
	s.shed.Active += r.Active
	s.shed.Hijacked += r.Hijacked
	return r
}

// shedTotal returns what the tracker's sheds returned so far.
func (s *simTraffic) shedTotal() ShedResult {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shed
}

// TestThroughputClusterSheds runs two real rebalance nodes on loopback
// with metric throughput. Each connection carries 10 kB/s: node A holds
// 300 (3 MB/s), node B 100 (1 MB/s). A is busier by bytes per second
// than average × 1.2 and sheds, sized as connections × (1 − stop line /
// current); its clients reconnect to A or B at random, as through a
// random outer balancer, so the average stays 2 MB/s (200 connections)
// and A ends within the stop band (220) and not far below the average.
// B's shed clients reconnect the same way; B sheds little or nothing (a
// starved machine makes the readings lag, and B, which A's clients land
// on, shed 10 of its ~200 once in CI). Both gossip "throughput" and the admin view shows the
// loads as bytes per second.
func TestThroughputClusterSheds(t *testing.T) {
	const perConn = 10_000
	simA, simB := newSimTraffic(300, perConn), newSimTraffic(100, perConn)
	simA.landing = []*simTraffic{simA, simB}
	simB.landing = simA.landing
	throughput := func(c *cluster.App, x *App) { x.Metric = metricThroughput }
	a := testApp(t, "bytes-a", simA, throughput)
	b := testApp(t, "bytes-b", simB, func(c *cluster.App, x *App) { throughput(c, x); c.Join = []string{a.gossipAddr()} })
	lbxtest.WaitFor(t, 15*time.Second, "both nodes count two fresh members", func() (bool, string) {
		okA, whyA := seesLoads(a.node, 2)
		okB, whyB := seesLoads(b.node, 2)
		return okA && okB, whyA + "; " + whyB
	})
	lbxtest.WaitFor(t, 20*time.Second, "bytes-a sheds down to the stop band", func() (bool, string) {
		a.node.mu.Lock()
		d, shed := a.node.last, a.node.shed
		a.node.mu.Unlock()
		held := simA.tracker.Counts().Held()
		return shed.Total() > 0 && !d.Active() && held <= 220, fmt.Sprintf("held %d, shed %+v, last decision %+v", held, shed, d)
	})
	// The clients a shed moves reconnect right after it: between the
	// two the nodes hold fewer than 400.
	var heldA, heldB int
	lbxtest.WaitFor(t, 15*time.Second, "the two nodes hold 400 connections", func() (bool, string) {
		heldA, heldB = simA.tracker.Counts().Held(), simB.tracker.Counts().Held()
		return heldA+heldB == 400, fmt.Sprintf("%d + %d; shed by a %+v, by b %+v; a %+v, b %+v",
			heldA, heldB, simA.shedTotal(), simB.shedTotal(), simA.tracker.Counts(), simB.tracker.Counts())
	})
	// Sized by bytes: at most 5% below the average (an interval's lag
	// under the race detector on busy cores; see TestClusterGossipAndShed).
	if heldA < 190 {
		t.Errorf("bytes-a shed down to %d connections; the average is 200 (more than needed)", heldA)
	}
	if shed := simA.shedTotal(); shed.Total() < 300-heldA || shed.Idle != shed.Total() {
		t.Errorf("bytes-a's tracker shed %+v; want at least %d idle connections", shed, 300-heldA)
	}
	if shedB, shedA := simB.shedTotal(), simA.shedTotal(); shedB.Total() > shedA.Total()/10 {
		t.Errorf("bytes-b shed %+v, more than a tenth of what bytes-a shed (%+v)", shedB, shedA)
	}
	t.Logf("bytes-a: 300 → %d connections (%s), bytes-b: 100 → %d", heldA, formatLoad(metricThroughput, float64(heldA*perConn)), heldB)

	var nv *nodeView
	for _, v := range buildRebalanceView().Nodes {
		if v.Name == "bytes-b" {
			nv = &v
		}
	}
	if nv == nil {
		t.Fatal("no bytes-b in the admin view")
	}
	for _, m := range nv.Members {
		if m.Metric != metricThroughput || !strings.HasSuffix(m.LoadHuman, "B/s") || !m.Counted {
			t.Errorf("admin view of bytes-b: member %+v", m)
		}
	}
	// The last decision's average is of one interval's bytes, which the
	// shed's reconnects can leave below the settled 2 MB/s (CI saw 920
	// kB/s); what the view owes is the metric's unit (formatLoad's
	// scaling is TestProcessSourceThroughput's).
	if !strings.HasSuffix(nv.Decision.AverageHuman, "B/s") || nv.Decision.Average <= 0 {
		t.Errorf("admin view of bytes-b: average %q (%v); want a positive rate in B/s", nv.Decision.AverageHuman, nv.Decision.Average)
	}
}
