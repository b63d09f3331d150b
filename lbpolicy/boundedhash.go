package lbpolicy

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func init() {
	caddy.RegisterModule(new(ConsistentHashSelection))
}

// ConsistentHashSelection is the consistent_hash selection policy:
// consistent hashing with bounded loads. A request's key (any placeholder
// expression) is hashed onto a ring on which every upstream has many
// points, and the request goes to the owner of the first point clockwise
// from the key's, so the same key keeps going to the same upstream and a
// change of the pool moves only the keys of the upstreams that changed.
//
// Unlike Caddy's hash policies, the load of an upstream is bounded: an
// upstream is full when its requests in flight reach
//
//	ceil(balance_factor × (requests in flight on usable upstreams + 1) × weight / usable weight)
//
// and a full or unavailable upstream is passed over: the walk goes on
// clockwise to the next point whose upstream is available and not full.
// Because each upstream's points are scattered over the ring, the keys of
// a lost or full upstream land on many different successors instead of
// all on one neighbour.
//
// When fewer than panic_threshold percent of the upstreams are available,
// health is ignored: the walk takes any upstream that is not full by its
// max_requests. A request whose key is empty goes to the least loaded
// usable upstream (requests in flight per weight). When no upstream is
// usable, the policy selects none, and reverse_proxy answers 502 as it
// does for Caddy's own policies.
type ConsistentHashSelection struct {
	// The key a request is hashed by: any placeholder expression,
	// replaced per request, such as `{http.request.uri}`,
	// `{http.request.header.X-User}`, `{http.request.cookie.session}` or
	// `{http.vars.client_ip}`. Default: `{http.request.uri}`, what Caddy's
	// uri_hash hashes.
	Key string `json:"key,omitempty"`

	// How far above the average an upstream's requests in flight may go,
	// as a factor: an upstream takes new requests while it has fewer than
	// balance_factor times its weighted share of the requests in flight
	// (plus the new one). Closer to 1 spreads load more evenly and moves
	// more keys off their owner when load is uneven; larger keeps more
	// keys at home. Above 1 and at most 10. Default: 1.25.
	BalanceFactor float64 `json:"balance_factor,omitempty"`

	// The weights of the upstreams, in the order they are configured; each at
	// least 1. An upstream of weight 2 has twice the points on the ring,
	// so about twice the keys, and twice the bound on requests in flight.
	// With static upstreams there must be one weight per upstream, and
	// a weight stays with its upstream's address when a wrapping policy
	// hands over part of the pool; with dynamic upstreams weights go by
	// position, and upstreams beyond the list have weight 1. Default: all 1.
	Weights []int `json:"weights,omitempty"`

	// Percentage of upstreams that must be available for health to be
	// respected; below it, the pool is in panic mode. 0 disables panic
	// mode. Default: 50.
	PanicThreshold *float64 `json:"panic_threshold,omitempty"`

	// Ejection of outliers, judged on live traffic; off when absent. An
	// ejected upstream is passed over on the ring like an unavailable
	// one, so only its keys move, to the next owners clockwise, and it
	// counts as unavailable for panic_threshold.
	Outlier *Outlier `json:"outlier,omitempty"`

	// Slow start: an upstream that joins a pool already serving, comes
	// back healthy after Caddy's health checks marked it unhealthy, or
	// comes back from an outlier ejection takes back its keys over the
	// window instead of all at once. Each key is kept by a ramping owner
	// while a number drawn from the key (the same for every request of
	// the key) is below the owner's ramp factor, and else passes on
	// clockwise, so the owner's share of keys follows the ramp and a key,
	// once back, stays. Off when absent; not applied in panic mode.
	SlowStart *SlowStart `json:"slow_start,omitempty"`

	key   hashKey
	views views
	panic panicMode
	// weightOf is the weight of each static upstream by dial address;
	// nil without weights or static upstreams, when weights go by
	// position in the pool.
	weightOf map[string]int
	// trackTried: the handler can retry, so each request records what it
	// tried and a retry avoids it (see tried.go)
	trackTried bool
	// table holds the upstreams' ejections and ramps; nil without
	// outlier ejection and slow start.
	table    *hoststate.Table
	observer *observingTransport
	logger   *zap.Logger
}

// Defaults and bounds of the balance factor. The factor trades balance
// for affinity: the busiest upstream is held within the factor of its
// share, but the closer the factor is to 1 the more keys leave their owner
// whenever load is uneven (the paper's analysis has the moves per change
// grow like 1/ε² for a factor of 1+ε). 1.25 holds the busiest upstream
// within a quarter of its share while moving few keys; it is brpc's
// default for the same algorithm (HAProxy's hash-balance-factor and
// Envoy's hash_balance_factor are off unless set). A factor of 1 or below
// leaves no room above the average, so every key whose owner is a request
// above it would move; above 10 the bound no longer bounds anything a pool
// would notice.
const (
	defaultBalanceFactor = 1.25
	maxBalanceFactor     = 10.0
	defaultHashKey       = "{http.request.uri}"
)

// Ring size. Each upstream of weight 1 gets pointsPerWeight points: with
// 1000, the share of keys an upstream owns is within a few percent of its
// weighted share (the spread falls as one over the square root of the
// points), so that when one leaves, the keys that move are close to the
// minimum, its fair share. A ring is built once per pool, and its lookup is
// a binary search (about 13 steps for 8 upstreams). Larger pools and
// weights are scaled down together so that a ring never exceeds
// maxRingPoints (1.5 MB): 1000 upstreams still get 131 points each.
const (
	pointsPerWeight = 1000
	maxRingPoints   = 1 << 17
)

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *ConsistentHashSelection) UnmarshalJSON(b []byte) error {
	type plain ConsistentHashSelection
	return jsonfield.Decode(b, (*plain)(x))
}

// CaddyModule returns the Caddy module information.
func (*ConsistentHashSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.consistent_hash",
		New: func() caddy.Module { return new(ConsistentHashSelection) },
	}
}

// Provision writes the defaults into the configuration and parses the
// key.
func (s *ConsistentHashSelection) Provision(ctx caddy.Context) error {
	if s.Key == "" {
		s.Key = defaultHashKey
	}
	if s.BalanceFactor == 0 {
		s.BalanceFactor = defaultBalanceFactor
	}
	s.logger = ctx.Logger()
	emitter := events.New(ctx)
	if s.SlowStart != nil {
		s.SlowStart.provision()
	}
	if s.Outlier != nil {
		s.Outlier.provision(s.logger, emitter)
	}
	// checked before anything is built from the values
	if err := s.Validate(); err != nil {
		return err
	}
	s.key = parseHashKey(s.Key)
	for _, name := range s.key.unknownPlaceholders() {
		ctx.Logger().Warn("consistent_hash: the key's placeholder is none Caddy provides, so it is empty for every request; in JSON write a placeholder's full name (e.g. {http.request.uri}, not the Caddyfile's {uri})",
			zap.String("placeholder", "{"+name+"}"))
	}
	s.trackTried = TracksTried(ctx)
	s.panic = newPanicMode(s.PanicThreshold, "consistent_hash", ctx.Logger(), emitter)
	if h := parentProxy(ctx); h != nil && len(s.Weights) > 0 && h.DynamicUpstreamsRaw == nil && len(h.Upstreams) > 0 {
		if err := checkWeightCount("consistent_hash", s.Weights, h); err != nil {
			return err
		}
		// by address: a wrapping policy (panic with outlier ejection, a
		// retry) hands over part of the pool, where positions shift
		s.weightOf = make(map[string]int, len(h.Upstreams))
		for i, u := range h.Upstreams {
			s.weightOf[u.Dial] = s.Weights[i]
		}
	}
	if err := s.observe(ctx); err != nil {
		return err
	}
	s.views.rel = newReleaser(s.table, parentProxy(ctx), s.linger())
	if err := registerMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	s.views.startReleasing(ctx.Done(), ctx.Logger())
	registerPool(s)
	return nil
}

// observe sets up the state outlier ejection and slow start need: a
// table of the upstreams' state, fed by the handler's traffic (which
// ejection judges, and which tells an upstream new to a serving pool from
// one that served before a reload).
func (s *ConsistentHashSelection) observe(ctx caddy.Context) error {
	if !s.observes() {
		return nil
	}
	s.table = hoststate.NewTable(hoststate.Config{})
	var err error
	_, s.observer, err = observeTraffic(ctx, s.table, s.Outlier, nil,
		"consistent_hash policy is not inside a reverse_proxy handler; outlier ejection and slow start have no traffic to observe")
	if err != nil {
		return fmt.Errorf("consistent_hash: %v", err)
	}
	return nil
}

// linger is how long the policy keeps the view of a pool no longer
// offered, and the state of its addresses (see lingerFor).
func (s *ConsistentHashSelection) linger() time.Duration {
	return lingerOf(s.Outlier, s.SlowStart)
}

// Cleanup unregisters the policy's pools from the admin API and releases
// shared upstream state.
func (s *ConsistentHashSelection) Cleanup() error {
	unregisterPool(s)
	if s.table != nil {
		s.table.Release()
	}
	if s.observer != nil {
		return s.observer.Cleanup()
	}
	return nil
}

// SkipsEjected reports whether Select passes over ejected upstreams
// itself (with outlier ejection or slow start, when it keeps their
// state), so that a handler that builds the pool (partition) hands it
// every upstream, for the panic threshold to count them.
func (s *ConsistentHashSelection) SkipsEjected() bool { return s.observes() }

// observes reports whether the policy observes its handler's traffic:
// it has outlier ejection or slow start.
func (s *ConsistentHashSelection) observes() bool { return s.Outlier != nil || s.SlowStart != nil }

// Validate checks the configuration.
func (s *ConsistentHashSelection) Validate() error {
	if s.BalanceFactor != 0 {
		if err := checkBalanceFactor(s.BalanceFactor); err != nil {
			return fmt.Errorf("consistent_hash: %v", err)
		}
	}
	for i, w := range s.Weights {
		if err := checkWeight(w); err != nil {
			return fmt.Errorf("consistent_hash: weights[%d]: %v", i, err)
		}
	}
	if s.PanicThreshold != nil {
		if err := bounds.Percent("panic_threshold", *s.PanicThreshold); err != nil {
			return fmt.Errorf("consistent_hash: %v", err)
		}
	}
	if s.SlowStart != nil {
		if err := s.SlowStart.validate(); err != nil {
			return fmt.Errorf("consistent_hash: %v", err)
		}
	}
	if s.Outlier != nil {
		if err := s.Outlier.validate(); err != nil {
			return fmt.Errorf("consistent_hash: %v", err)
		}
	}
	return nil
}

// checkBalanceFactor checks a balance factor: above 1, at most
// maxBalanceFactor.
func checkBalanceFactor(c float64) error {
	if err := bounds.Float("balance_factor", c, 1, maxBalanceFactor); err != nil {
		return err
	}
	if c == 1 {
		return fmt.Errorf("balance_factor must be above 1")
	}
	return nil
}

// Select returns the upstream of the request's key, bounded by load. A
// retry passes over the upstreams its request already tried, as long as
// another is usable: its key's next owner clockwise takes it.
func (s *ConsistentHashSelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	if len(pool) == 0 {
		return nil
	}
	if !s.trackTried {
		return s.choose(pool, r, nil)
	}
	attempt, tried := LoadTried(r)
	picked := s.choose(pool, r, tried)
	if picked == nil && tried != nil {
		// every usable upstream was tried: choose among them again
		picked = s.choose(pool, r, nil)
	}
	RecordTried(attempt, tried, picked)
	return picked
}

// choose is Select, given what the request already tried (nil on a
// first attempt).
func (s *ConsistentHashSelection) choose(pool reverseproxy.UpstreamPool, r *http.Request, tried *Tried) *reverseproxy.Upstream {
	v := s.views.get(pool, s.buildView)
	now := monoclock.Now()
	if s.SlowStart != nil && s.panic.threshold <= 0 {
		// the count is also what notices upstreams coming back from
		// Caddy-unhealthy; panic mode does it otherwise
		v.availability(pool, now)
	}
	cp := caddyPool{pool: pool, panic: s.panic.check(v, pool, now), tried: tried, now: now}
	if !cp.panic {
		// in panic mode health is ignored, ejection and ramps with it:
		// too few upstreams look available to hold any back
		cp.members, cp.ramp = v.members, s.SlowStart
	}
	ring := v.ring
	h, ok := s.key.hash(r)
	if !ok {
		h = rand.Uint64()
	}
	cp.drain, cp.key = v.drainMask(), h
	if ok {
		cp.admit = keyDraw(h)
	} else {
		cp.admit = rand.Float64()
	}
	i := s.pick(ring, cp, ok, now)
	if i < 0 && cp.ramp != nil {
		// only ramping upstreams that passed this key on are usable: a
		// ramp shapes shares, it never refuses a request
		cp.ramp = nil
		i = s.pick(ring, cp, ok, now)
	}
	if i < 0 && cp.drain != nil && tried == nil {
		i = s.pickWithoutDrains(ring, cp, ok, now)
	}
	if i < 0 {
		return nil
	}
	return pool[i]
}

// keyDraw maps a key's hash to a number in [0, 1), the key's slow-start
// draw: the same for every request of the key, so that a key a ramping
// upstream has taken back stays with it as the ramp rises (its cache
// stays useful), and independent of the key's place on the ring (the
// hash is mixed again, with SplitMix64's finalizer), so that which keys
// an upstream takes back does not depend on which of its points they
// fall on.
func keyDraw(h uint64) float64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return float64(h>>11) / (1 << 53)
}

// avoidsTried implements triedAvoider.
func (*ConsistentHashSelection) avoidsTried() {}

// triedAvoider is a policy other than least_time that records and avoids
// what a request tried itself (see tried.go), so that a wrapping policy
// hands it the whole pool on a retry rather than the untried part.
type triedAvoider interface{ avoidsTried() }

// buildView builds the view of a pool the policy has not served yet, with
// its ring.
func (s *ConsistentHashSelection) buildView(pool reverseproxy.UpstreamPool) *poolView {
	v := newView(pool)
	dials := make([]string, len(pool))
	weights := make([]int, len(pool))
	for i, u := range pool {
		dials[i], weights[i] = u.Dial, 1
		switch w, ok := s.weightOf[u.Dial]; {
		case ok:
			weights[i] = w
		case s.weightOf == nil && i < len(s.Weights):
			weights[i] = s.Weights[i]
		}
	}
	v.ring = newHashRing(dials, weights)
	if s.table != nil {
		v.members = make([]member, len(pool))
		for i, u := range pool {
			v.members[i].stats, v.members[i].invWeight = s.table.Stats(u.Dial), 1
		}
		if s.SlowStart != nil {
			s.SlowStart.watch(v, s.logger)
		}
	}
	return v
}

// hashRing is the ring of one pool: sorted points, the pool index that owns
// each, and the members' weights.
type hashRing struct {
	points  []uint64
	owner   []int32
	weights []float64
	totals  ringTotals
}

// newHashRing places each member at points proportional to its weight.
// A point's position hashes the member's dial address and the point's
// number, so every lbx node with the same pool builds the same ring.
func newHashRing(dials []string, weights []int) *hashRing {
	total := 0.0
	for _, w := range weights {
		total += float64(w)
	}
	per := float64(pointsPerWeight)
	if total*per > maxRingPoints {
		per = maxRingPoints / total
	}
	ring := &hashRing{weights: make([]float64, len(weights))}
	type point struct {
		at    uint64
		owner int32
	}
	var pts []point
	buf := make([]byte, 0, 64)
	for i, dial := range dials {
		ring.weights[i] = float64(weights[i])
		n := max(1, int(math.Round(per*float64(weights[i]))))
		for k := range n {
			buf = append(append(append(buf[:0], dial...), '#'), strconv.Itoa(k)...)
			pts = append(pts, point{at: xxhash.Sum64(buf), owner: int32(i)})
		}
	}
	slices.SortFunc(pts, func(a, b point) int {
		switch {
		case a.at < b.at:
			return -1
		case a.at > b.at:
			return 1
		}
		return int(a.owner - b.owner) // equal positions: a fixed order
	})
	ring.points = make([]uint64, len(pts))
	ring.owner = make([]int32, len(pts))
	for j, p := range pts {
		ring.points[j], ring.owner[j] = p.at, p.owner
	}
	return ring
}

// hashPool is what the ring needs to know of the members of a pool: its
// requests in flight, and whether it may take one more. It is a type
// parameter, not an interface value, so that selection does not allocate.
type hashPool interface {
	load(i int) int
	usable(i int) bool
	// admits reports whether usable member i takes this key: a
	// ramping member passes some keys on (see ConsistentHashSelection's
	// slow_start). Totals are over usable members, admitted or not.
	admits(i int) bool
	// shared reports whether usable is the same for every request of the
	// pool (not a retry's, which leaves out what it tried), so that
	// totals over it may be cached for the pool.
	shared() bool
}

// caddyPool is a Caddy upstream pool as a hashPool. In panic mode health
// is ignored: only a member full by its max_requests is left out. The
// members a retry already tried (tried, nil on a first attempt) are left
// out too, and, with members set (outlier ejection or slow start, outside
// panic mode), the ejected ones.
type caddyPool struct {
	pool    reverseproxy.UpstreamPool
	panic   bool
	tried   *Tried
	members []member
	now     int64
	// ramp, when set, is the slow start, and admit the key's draw: a
	// ramping member admits the key when admit is below its factor
	ramp  *SlowStart
	admit float64
	// drain is the operator's drains and reweights of the pool, nil when
	// none; key is the request's hash, which decides for a reweighted
	// member (see drainMask.admitsKey).
	drain *drainMask
	key   uint64
}

func (p caddyPool) load(i int) int { return p.pool[i].NumRequests() }

func (p caddyPool) shared() bool { return p.tried == nil && (p.drain == nil || !p.drain.weighted) }

func (p caddyPool) usable(i int) bool {
	if p.tried != nil && p.tried.Has(p.pool[i].Dial) {
		return false
	}
	if p.drain != nil && !p.drain.admitsKey(i, p.key) {
		return false
	}
	if p.panic {
		return !p.pool[i].Full()
	}
	if p.members != nil && p.members[i].stats.Ejected(p.now) {
		return false
	}
	return p.pool[i].Available()
}

func (p caddyPool) admits(i int) bool {
	if p.ramp == nil {
		return true
	}
	start := p.members[i].stats.RampStart(p.now)
	return !p.ramp.ramping(start, p.now) || p.admit < p.ramp.factor(start, p.now)
}

// Walking the ring. The bounds add up to more than the load, and with
// equal weights fewer than 1/balance_factor of the upstreams can be full,
// so a walk of maxWalk points that finds none below its bound means the
// loads moved under it: it stops there and takes the least loaded, rather
// than visiting the whole ring.
const maxWalk = 4096

// Totals of large pools. Up to exactTotals upstreams the bound's totals
// are summed on every selection (two atomic loads per upstream, under
// 100 ns); above, they are summed at most once per totalsEvery (ns), so
// that selection stays a binary search on pools of hundreds of upstreams.
// A total that lags by a millisecond bounds with the load of a
// millisecond ago.
const (
	exactTotals = 64
	totalsEvery = int64(time.Millisecond)
)

// ringTotals caches a large pool's totals over its usable members. The
// three values may come from different refreshes; each is a valid reading.
type ringTotals struct {
	at     atomic.Int64 // monoclock ns of the last refresh; 0: none
	panic  atomic.Bool  // the refresh counted in panic mode
	load   atomic.Int64
	weight atomic.Uint64 // float64 bits
}

// totals returns the requests in flight and the weight of the usable
// members of p at now (monoclock ns).
func totals[P hashPool](r *hashRing, p P, panicking bool, now int64) (int, float64) {
	n := len(r.weights)
	cached := n > exactTotals && p.shared()
	if cached {
		t := &r.totals
		if at := t.at.Load(); at != 0 && now-at < totalsEvery && t.panic.Load() == panicking {
			return int(t.load.Load()), math.Float64frombits(t.weight.Load())
		}
	}
	load, weight := 0, 0.0
	for i := range n {
		if p.usable(i) {
			load += p.load(i)
			weight += r.weights[i]
		}
	}
	if cached {
		t := &r.totals
		t.load.Store(int64(load))
		t.weight.Store(math.Float64bits(weight))
		t.panic.Store(panicking)
		t.at.Store(max(now, 1))
	}
	return load, weight
}

// pickBounded returns the pool index of the first usable member, clockwise
// from h, that is below its bound, or -1 when no member is usable. Totals
// of load and weight are over the usable members, so that an unavailable
// member's share is spread over the others' bounds. panicking and now are
// for the totals' cache (see totals).
func pickBounded[P hashPool](r *hashRing, h uint64, c float64, p P, panicking bool, now int64) int {
	load, weight := totals(r, p, panicking, now)
	if weight == 0 {
		return -1
	}
	// the bound per unit of weight
	per := c * float64(load+1) / weight
	start, _ := slices.BinarySearch(r.points, h)
	for k := range min(len(r.points), maxWalk) {
		j := start + k
		if j >= len(r.points) {
			j -= len(r.points)
		}
		i := int(r.owner[j])
		if p.usable(i) && float64(p.load(i)) < math.Ceil(per*r.weights[i]) && p.admits(i) {
			return i
		}
	}
	return leastLoaded(r, p, int(h%uint64(len(r.weights))))
}

// leastLoaded returns the usable member with the fewest requests in flight
// per weight, or -1 when none is usable. Ties go to the first from start,
// so a caller spreads them by varying it.
func leastLoaded[P hashPool](r *hashRing, p P, start int) int {
	n := len(r.weights)
	best, bestCost := -1, math.Inf(1)
	for k := range n {
		i := (start + k) % n
		if !p.usable(i) || !p.admits(i) {
			continue
		}
		if cost := float64(p.load(i)+1) / r.weights[i]; cost < bestCost {
			best, bestCost = i, cost
		}
	}
	return best
}

// hashKey is a key expression parsed once: literal text and placeholders.
// Hashing it streams each part's value into the hash, so the key's text is
// never built.
type hashKey struct {
	parts []keyPart
	// literal is the length of the key's literal text; holders, whether
	// it has placeholders (see empty).
	literal int
	holders bool
}

// keyPart is literal text, or a placeholder (name set) with how to read
// it: from the request directly for the common ones (no allocation),
// otherwise from the request's replacer.
type keyPart struct {
	text   string // literal text, or the placeholder's name
	holder bool
	read   keyReader
	header string // canonical header name, for readHeader
}

type keyReader uint8

const (
	readReplacer keyReader = iota
	readURI
	readPath
	readHeader
)

// parseHashKey splits a key expression into its literal text and its
// placeholders; a brace without its match is literal text, and `\{` and
// `\}` are literal braces, as in Caddy's replacer.
func parseHashKey(key string) hashKey {
	var k hashKey
	var lit strings.Builder
	flush := func() {
		if lit.Len() > 0 {
			k.parts = append(k.parts, keyPart{text: lit.String()})
			lit.Reset()
		}
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if c == '\\' && i+1 < len(key) && (key[i+1] == '{' || key[i+1] == '}') {
			lit.WriteByte(key[i+1])
			i++
			continue
		}
		if c == '{' {
			if end := strings.IndexByte(key[i+1:], '}'); end > 0 {
				flush()
				k.parts = append(k.parts, placeholderPart(key[i+1:i+1+end]))
				i += end + 1
				continue
			}
		}
		lit.WriteByte(c)
	}
	flush()
	for _, p := range k.parts {
		if p.holder {
			k.holders = true
		} else {
			k.literal += len(p.text)
		}
	}
	return k
}

// placeholderRoots are the namespaces of the placeholders Caddy provides
// to an HTTP handler: its HTTP server's, and the global ones.
var placeholderRoots = []string{"http.", "env.", "system.", "time.", "file."}

// unknownPlaceholders returns the names of the key's placeholders that are
// in none of placeholderRoots: a Caddyfile shorthand written in JSON
// ({uri}), or a typo, which Caddy replaces with nothing.
func (k *hashKey) unknownPlaceholders() []string {
	var unknown []string
	for _, p := range k.parts {
		if p.holder && !slices.ContainsFunc(placeholderRoots, func(root string) bool { return strings.HasPrefix(p.text, root) }) {
			unknown = append(unknown, p.text)
		}
	}
	return unknown
}

// placeholderPart is the part for the placeholder name.
func placeholderPart(name string) keyPart {
	p := keyPart{text: name, holder: true}
	switch {
	case name == "http.request.uri":
		p.read = readURI
	case name == "http.request.uri.path":
		p.read = readPath
	case strings.HasPrefix(name, "http.request.header.") && len(name) > len("http.request.header."):
		p.read = readHeader
		p.header = textproto.CanonicalMIMEHeaderKey(name[len("http.request.header."):])
	}
	return p
}

// hash returns the hash of the key's value for r, and false when the value
// is empty (or there is no request).
func (k *hashKey) hash(r *http.Request) (uint64, bool) {
	if r == nil {
		return 0, false
	}
	var d xxhash.Digest
	d.Reset()
	n := 0
	var repl *caddy.Replacer
	for i := range k.parts {
		p := &k.parts[i]
		if !p.holder {
			m, _ := d.WriteString(p.text)
			n += m
			continue
		}
		switch p.read {
		case readURI:
			m, _ := d.WriteString(r.RequestURI)
			n += m
		case readPath:
			if r.URL != nil {
				m, _ := d.WriteString(r.URL.Path)
				n += m
			}
		case readHeader:
			// joined with commas, as the placeholder's value is
			for j, val := range r.Header[p.header] {
				if j > 0 {
					_, _ = d.WriteString(",")
				}
				m, _ := d.WriteString(val)
				n += m
			}
		default:
			if repl == nil {
				repl, _ = r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
				if repl == nil {
					continue
				}
			}
			if val, ok := repl.Get(p.text); ok {
				var s string
				if str, isStr := val.(string); isStr {
					s = str
				} else {
					s = caddy.ToString(val)
				}
				m, _ := d.WriteString(s)
				n += m
			}
		}
	}
	// a key whose placeholders are all empty is empty, literal text
	// or not: else every request without the cookie would share one
	// upstream
	if n == 0 || (k.holders && n == k.literal) {
		return 0, false
	}
	return d.Sum64(), true
}

// poolStatuses implements poolStatusSource.
func (s *ConsistentHashSelection) poolStatuses() []poolStatus {
	var pools []poolStatus
	for _, v := range s.views.all() {
		status := poolStatus{
			Policy:         "consistent_hash",
			Available:      v.availableNow(),
			PanicThreshold: s.panic.percent(),
			Panic:          v.panic.on.Load(),
			PanicEntered:   v.panic.entered.Load(),
		}
		now := monoclock.Now()
		if s.SlowStart != nil {
			status.SlowStart = time.Duration(s.SlowStart.Window).String()
		}
		for i, u := range v.ups {
			m := poolMember{Dial: u.Dial, Weight: v.ring.weights[i], Healthy: u.Healthy(), Available: u.Available()}
			if v.members != nil {
				m.Available = m.Available && !v.members[i].stats.Ejected(now)
				if s.SlowStart != nil {
					m.SlowStartPercent = s.SlowStart.percent(v.members[i].stats, now)
				}
			}
			status.Upstreams = append(status.Upstreams, m)
		}
		pools = append(pools, status)
	}
	return pools
}

// Interface guards
var (
	_ reverseproxy.Selector = (*ConsistentHashSelection)(nil)
	_ caddy.Provisioner     = (*ConsistentHashSelection)(nil)
	_ caddy.Validator       = (*ConsistentHashSelection)(nil)
	_ caddy.CleanerUpper    = (*ConsistentHashSelection)(nil)
	_ poolStatusSource      = (*ConsistentHashSelection)(nil)
	_ triedAvoider          = (*ConsistentHashSelection)(nil)
)
