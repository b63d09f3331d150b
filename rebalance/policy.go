package rebalance

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/randpick"
	"github.com/caddy-lbx/lbx/lbpolicy"
)

func init() {
	caddy.RegisterModule(new(ClusterLoadSelection))
}

// ClusterLoadSelection is a selection policy for upstreams that are
// members of this node's cluster: it balances by the load each
// member gossips (its `lbx_load` tag: connections held or CPU, smoothed
// over the member's history), with power of two random choices.
//
// Each request draws two distinct available upstreams at random and goes
// to the one with the lower gossiped load; at equal loads, to the one
// with fewer requests in flight from this node; then to either, at
// random. Loads are gossiped every interval, so between two reports every
// balancer in the fleet sees the same, stale numbers: picking the single
// least-loaded upstream (as a cached "least loaded" policy does) would
// send it every request until its next report, a herd. With two random
// choices the least-loaded upstream of n receives about 2/n of the
// requests, the most loaded none (so with two upstreams, the less loaded
// gets every request until the next reports).
//
// A member's load counts under the rule the rebalance app uses for the
// cluster average: the member is alive, reports the same metric as this
// node, and its report changed within the app's freshness. An upstream
// without such a load (not a member, silent, failed, another metric) is
// given the mean of the fresh loads of the pool's other upstreams
// (computed at each reading, and again when the pool's size changes):
// neither starved nor stampeded. With no fresh load at all the policy is
// least-of-two by requests in flight.
//
// An upstream is the member whose dial address, built as `dynamic serf`
// builds it (the member's IP and the port in the tag `port_tag` names, else `port`),
// equals the upstream's dial address, so `dynamic serf` and this policy
// with the same port and port_tag pair up. With neither `port` nor
// `port_tag` set, an upstream is the member whose IP is the upstream's host, provided
// exactly one alive member has that IP. A dial address that two alive
// members share matches neither.
//
// The loads are read from the cluster at most every `refresh`, by the one
// request that finds them out of date while the others use the previous
// reading; a selection looks up the two upstreams drawn in that reading,
// reads no clock (the age of the reading is measured in the app's
// decision steps, which is when new reports arrive) and allocates
// nothing.
//
// It needs the rebalance app in the same config (the `rebalance` global
// option); without it the config does not load.
type ClusterLoadSelection struct {
	// The member tag that holds the port a member serves
	// at (e.g. "http_port"), as in `dynamic serf`; a member without it is
	// matched at `port`. Default: none.
	PortTag string `json:"port_tag,omitempty"`

	// The port a member serves at when it has no `port_tag` tag.
	// Default: none; with neither `port` nor `port_tag`, upstreams are
	// matched to members by IP alone.
	Port string `json:"port,omitempty"`

	// The time between two readings of the members' loads.
	// The app takes in the members' reports once per interval, and the
	// loads are read again at the first request after the app has taken
	// in reports `refresh` after those last read: a refresh shorter than
	// the interval has the effect of the interval. From 10ms to 1h.
	// Default: the rebalance app's interval (1s by default).
	Refresh caddy.Duration `json:"refresh,omitempty"`

	// refresh is Refresh, or the rebalance node's interval (as of the
	// last reading) when Refresh is not set; nanoseconds.
	refresh atomic.Int64
	logger  *zap.Logger
	// trackTried: the handler can retry, so a retry avoids the
	// upstreams its request tried (lbpolicy.Tried)
	trackTried bool
	// source is where the members and their loads are read: the app
	// (tests substitute their own).
	source loadReader

	mu      sync.Mutex // held by the request that refreshes
	lastErr string     // the last error logged (under mu)
	logged  loadState  // the last state logged (under mu)
	snap    atomic.Pointer[loadSnapshot]
}

// loadReader is where the policy reads the members' loads: the rebalance
// node on this node's cluster member (nodeLoads).
type loadReader interface {
	// memberLoads returns the members with their loads, judged at now.
	memberLoads(now time.Time) ([]memberLoad, error)
	// stepClock returns a clock (of monoclock readings) that advances
	// each time new reports are taken in, or nil when there is none.
	stepClock() *atomic.Int64
	// interval returns how often new reports are taken in; 0 when
	// unknown.
	interval() time.Duration
}

// loadSnapshot is one reading of the members' loads, never changed once
// stored.
type loadSnapshot struct {
	// at is when the reading was made: by clock, the source's step
	// clock, read per request instead of the system clock; or, when the
	// source has none (its node is not running), by monoclock.Now().
	at    int64
	clock *atomic.Int64
	// loads maps a dial address (or, matching by IP, a member's IP in
	// its canonical text form) to the fresh load of the one alive member
	// it designates.
	loads  map[string]float64
	byIP   bool
	mean   float64 // of the fresh loads of the pool's upstreams
	pool   int     // the size of the pool mean was computed over
	known  int     // how many of those upstreams have a fresh load
	others int     // alive members with a fresh load that match no upstream of the pool
	// hosts and compared hold, for the i-th upstream of the pool
	// measured, its Host and the load it is compared at. Caddy keeps one
	// Host per dial address, across requests and the fresh Upstream values
	// of dynamic sources, so while a pool keeps its order (static
	// upstreams; dynamic serf's sorted list) a selection finds an
	// upstream's load by its position, without hashing its address.
	// Other upstreams are looked up by dial address.
	hosts    []*reverseproxy.Host
	compared []float64
}

// loadState is what a refresh logs when it changes.
type loadState struct {
	pool, known int
}

// CaddyModule returns the Caddy module information.
func (*ClusterLoadSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.cluster_load",
		New: func() caddy.Module { return new(ClusterLoadSelection) },
	}
}

// Provision finds the cluster app of the config and sets the defaults.
// It does not read the members: the app's serf member starts after every
// module is provisioned.
func (p *ClusterLoadSelection) Provision(ctx caddy.Context) error {
	p.logger = ctx.Logger()
	if err := p.Validate(); err != nil {
		return err
	}
	// The cluster app, not the rebalance app: asking the config for the
	// rebalance app here would have the HTTP app provision it, and it
	// needs the HTTP app's servers. The loads are found through the
	// cluster member when they are read, and the cluster app refuses to
	// start without a rebalance app to publish them.
	clusterApp, err := cluster.Lookup(ctx, "lb_policy cluster_load")
	if err != nil {
		return err
	}
	clusterApp.Require(requireRebalance, "lb_policy cluster_load")
	p.source = nodeLoads{cluster: clusterApp}
	p.trackTried = lbpolicy.TracksTried(ctx)
	p.refresh.Store(int64(p.Refresh))
	if p.Refresh == 0 {
		p.refresh.Store(int64(DefaultInterval))
	}
	return nil
}

// UnmarshalJSON decodes the policy's JSON as Caddy does, naming the
// field of a value that does not decode.
func (p *ClusterLoadSelection) UnmarshalJSON(b []byte) error {
	type clusterLoadJSON ClusterLoadSelection
	return jsonfield.Decode(b, (*clusterLoadJSON)(p))
}

// Validate checks the configuration.
func (p *ClusterLoadSelection) Validate() error {
	if p.Port != "" {
		if _, err := cluster.ParsePort(p.Port); err != nil {
			return fmt.Errorf("lb_policy cluster_load: %v", err)
		}
	}
	if err := cluster.CheckRefresh(p.Refresh); err != nil {
		return fmt.Errorf("lb_policy cluster_load: %v", err)
	}
	return nil
}

// Select returns the less loaded of two distinct available upstreams
// drawn at random, the only available one, or nil when none is available.
// A retry leaves out the upstreams its request already tried, unless only
// those are available.
func (p *ClusterLoadSelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	var (
		attempt lbpolicy.Attempt
		tried   *lbpolicy.Tried
	)
	if p.trackTried {
		attempt, tried = lbpolicy.LoadTried(r)
	}
	c := poolLoads{pool: pool, snap: p.snapshot(pool), tried: tried}
	i := chooseLessLoaded(c)
	if i < 0 && tried != nil {
		c.tried = nil // only tried upstreams are available
		i = chooseLessLoaded(c)
	}
	if i < 0 {
		return nil
	}
	if p.trackTried {
		lbpolicy.RecordTried(attempt, tried, pool[i])
	}
	return pool[i]
}

// snapshot returns the current reading of the loads for pool. When it is
// Refresh old, or was made for a pool of another size (the mean is the
// pool's), one request refreshes it while the others use it as is.
func (p *ClusterLoadSelection) snapshot(pool reverseproxy.UpstreamPool) *loadSnapshot {
	s := p.snap.Load()
	if s != nil && s.pool == len(pool) && !s.expired(time.Duration(p.refresh.Load())) {
		return s
	}
	if s == nil {
		p.mu.Lock()
		s = p.refreshLocked(pool)
		p.mu.Unlock()
	} else if p.mu.TryLock() {
		s = p.refreshLocked(pool)
		p.mu.Unlock()
	}
	return s
}

// expired reports whether the snapshot is refresh old. By the step clock
// that is once the node has taken in reports refresh after the ones
// read, so the loads are re-read when they can have changed, at most
// every refresh, and a selection does not read the system clock.
func (s *loadSnapshot) expired(refresh time.Duration) bool {
	if s.clock != nil {
		return s.clock.Load()-s.at >= int64(refresh)
	}
	return monoclock.Now()-s.at >= int64(refresh)
}

// refreshLocked reads the loads (or, when only the pool's size changed,
// recomputes the mean) and stores a new snapshot; p.mu is held.
func (p *ClusterLoadSelection) refreshLocked(pool reverseproxy.UpstreamPool) *loadSnapshot {
	prev := p.snap.Load()
	current := prev != nil && !prev.expired(time.Duration(p.refresh.Load()))
	if current && prev.pool == len(pool) {
		return prev // another request refreshed it meanwhile
	}
	var s *loadSnapshot
	if current {
		s = &loadSnapshot{at: prev.at, clock: prev.clock, loads: prev.loads, byIP: prev.byIP}
	} else {
		s = p.read()
	}
	s.measure(pool)
	p.snap.Store(s)

	if st := (loadState{pool: s.pool, known: s.known}); st != p.logged {
		p.logged = st
		if c := p.logger.Check(zap.InfoLevel, "cluster loads of the upstreams changed"); c != nil {
			c.Write(zap.Int("upstreams", s.pool), zap.Int("with_fresh_load", s.known),
				zap.Float64("mean_load", s.mean), zap.Int("other_members_with_fresh_load", s.others))
		}
	}
	return s
}

// read builds a snapshot from the members' loads. When they cannot be
// read it is empty (every upstream neutral) and the error is logged once.
func (p *ClusterLoadSelection) read() *loadSnapshot {
	now := time.Now()
	clock := p.source.stepClock()
	at := monoclock.At(now)
	if clock != nil {
		at = clock.Load() // before the reports it stands for are read
	}
	if p.Refresh == 0 {
		if iv := p.source.interval(); iv > 0 {
			p.refresh.Store(int64(iv))
		}
	}
	members, err := p.source.memberLoads(now)
	if err != nil {
		if msg := err.Error(); msg != p.lastErr {
			p.logger.Warn("cannot read the cluster's loads; choosing by requests in flight", zap.Error(err))
			p.lastErr = msg
		}
		return &loadSnapshot{at: monoclock.At(now)}
	}
	if p.lastErr != "" {
		p.logger.Info("cluster loads readable again")
		p.lastErr = ""
	}
	s := buildLoads(members, p.Port, p.PortTag)
	s.at, s.clock = at, clock
	return s
}

// buildLoads maps each address that designates exactly one alive member
// to that member's load, when it counts: the dial address the member is
// reached at (its IP and the port in its tag portTag, else port), or, when
// neither port nor portTag is given, its IP.
func buildLoads(members []memberLoad, port, portTag string) *loadSnapshot {
	s := &loadSnapshot{loads: make(map[string]float64), byIP: port == "" && portTag == ""}
	alive := make(map[string]int)
	keys := make([]string, len(members))
	for i, m := range members {
		if m.Status != cluster.StatusAlive || m.Addr == nil {
			continue
		}
		key := m.Addr.String()
		if !s.byIP {
			addr, err := m.DialAddr(port, portTag)
			if err != nil {
				continue // not reachable as an upstream of this pool
			}
			key = addr
		}
		keys[i] = key
		alive[key]++
	}
	for i, m := range members {
		if keys[i] != "" && alive[keys[i]] == 1 && m.Counts {
			s.loads[keys[i]] = m.Load
		}
	}
	return s
}

// measure computes the mean of the fresh loads of pool's upstreams, which
// upstreams without one are given, and counts them.
func (s *loadSnapshot) measure(pool reverseproxy.UpstreamPool) {
	var sum float64
	s.pool, s.known, s.mean = len(pool), 0, 0
	for _, u := range pool {
		if v, ok := s.lookup(u.Dial); ok {
			sum += v
			s.known++
		}
	}
	if s.known > 0 {
		s.mean = sum / float64(s.known)
	}
	s.others = max(0, len(s.loads)-s.known)
	s.hosts = make([]*reverseproxy.Host, len(pool))
	s.compared = make([]float64, len(pool))
	for i, u := range pool {
		s.hosts[i], s.compared[i] = u.Host, s.loadAt(u.Dial)
	}
}

// lookup returns the fresh load of the member the dial address
// designates.
func (s *loadSnapshot) lookup(dial string) (float64, bool) {
	if s.byIP {
		dial = dialHost(dial)
	}
	v, ok := s.loads[dial]
	return v, ok
}

// load returns the load to compare for u, the i-th upstream of the pool:
// its member's fresh load, else the pool's mean.
func (s *loadSnapshot) load(i int, u *reverseproxy.Upstream) float64 {
	if i < len(s.hosts) && s.hosts[i] == u.Host && u.Host != nil {
		return s.compared[i]
	}
	return s.loadAt(u.Dial)
}

// loadAt returns the load to compare for the upstream at dial.
func (s *loadSnapshot) loadAt(dial string) float64 {
	if v, ok := s.lookup(dial); ok {
		return v
	}
	return s.mean
}

// dialHost returns the host of a dial address "host:port", "[v6]:port"
// or a bare host, without allocating.
func dialHost(dial string) string {
	if strings.HasPrefix(dial, "[") {
		if end := strings.IndexByte(dial, ']'); end > 0 {
			return dial[1:end]
		}
		return dial
	}
	if i := strings.IndexByte(dial, ':'); i >= 0 && strings.LastIndexByte(dial, ':') == i {
		return dial[:i]
	}
	return dial // a bare host, IPv4 or IPv6
}

// loadCandidates is what the choosing rule sees of a pool: its size,
// whether member i may be chosen, its gossiped load and the requests in
// flight to it. Keeping it abstract keeps the rule testable without
// Caddy.
type loadCandidates interface {
	Len() int
	Usable(i int) bool
	Load(i int) float64
	InFlight(i int) int
}

// pairTries bounds the random pair draws spent looking for two usable
// members before counting them in a scan.
const pairTries = 4

// chooseLessLoaded draws two distinct usable members at random and
// returns the index of the less loaded (see lessLoaded); the only usable
// member when there is one; -1 when there is none. It is O(1) while most
// of the pool is usable: pairs are drawn until both members are usable,
// which picks a uniformly random pair of usable members; after pairTries
// misses it scans, which is exact and happens only when much of the pool
// is unavailable.
func chooseLessLoaded[C loadCandidates](c C) int {
	n := c.Len()
	switch n {
	case 0:
		return -1
	case 1:
		if c.Usable(0) {
			return 0
		}
		return -1
	}
	for range pairTries {
		i, j := randpick.TwoDistinct(rand.Uint64(), n)
		if c.Usable(i) && c.Usable(j) {
			return lessLoaded(c, i, j)
		}
	}
	return chooseLessLoadedByScan(c)
}

// chooseLessLoadedByScan is chooseLessLoaded by a scan: it samples two
// distinct usable members uniformly in one pass (a reservoir of two) and
// returns the less loaded; the only usable one; or -1.
func chooseLessLoadedByScan[C loadCandidates](c C) int {
	a, b, seen := -1, -1, 0
	for i := range c.Len() {
		if !c.Usable(i) {
			continue
		}
		seen++
		switch seen {
		case 1:
			a = i
		case 2:
			b = i
		default:
			switch rand.IntN(seen) {
			case 0:
				a = i
			case 1:
				b = i
			}
		}
	}
	if b < 0 {
		return a
	}
	if rand.IntN(2) == 0 {
		a, b = b, a // the first of the two wins a full tie: make it random
	}
	return lessLoaded(c, a, b)
}

// loadTieBand is how far apart two gossiped loads may be and still count
// as equal (10%: half the rebalance app's default threshold). The loads
// are up to an interval and a history old; a strict comparison between
// two nearly equal members would send every request of a reporting
// interval to one of them (with two upstreams, all of them), then flip.
const loadTieBand = 0.1

// lessLoaded returns whichever of i and j has the lower load, loads
// within loadTieBand of each other counting as equal; at equal loads, the
// one with fewer requests in flight; at a full tie, i (callers pass i and
// j in random order).
func lessLoaded[C loadCandidates](c C, i, j int) int {
	li, lj := c.Load(i), c.Load(j)
	switch {
	case lj*(1+loadTieBand) < li:
		return j
	case li*(1+loadTieBand) < lj:
		return i
	case c.InFlight(j) < c.InFlight(i):
		return j
	}
	return i
}

// poolLoads presents a pool and a snapshot to the choosing rule.
type poolLoads struct {
	pool  reverseproxy.UpstreamPool
	snap  *loadSnapshot
	tried *lbpolicy.Tried // nil on a first attempt
}

func (c poolLoads) Len() int { return len(c.pool) }
func (c poolLoads) Usable(i int) bool {
	return c.pool[i].Available() && (c.tried == nil || !c.tried.Has(c.pool[i].Dial))
}
func (c poolLoads) Load(i int) float64 { return c.snap.load(i, c.pool[i]) }
func (c poolLoads) InFlight(i int) int { return c.pool[i].NumRequests() }

// Interface guards
var (
	_ reverseproxy.Selector = (*ClusterLoadSelection)(nil)
	_ caddy.Provisioner     = (*ClusterLoadSelection)(nil)
	_ caddy.Validator       = (*ClusterLoadSelection)(nil)
	_ caddyfile.Unmarshaler = (*ClusterLoadSelection)(nil)
	_ json.Unmarshaler      = (*ClusterLoadSelection)(nil)
)
