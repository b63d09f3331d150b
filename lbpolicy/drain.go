package lbpolicy

import (
	"math/rand/v2"
	"net/http"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/drain"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/pickrate"
)

// Drains and reweights in selection. The operator's store (package drain,
// written through POST /lbx/drain, /lbx/undrain and /lbx/weight, and by
// the cluster's members) is read here by least_time, consistent_hash and
// the panic wrapper:
//
//   - a drained upstream is treated like an ejected one: no new requests,
//     while those in flight finish; but when every upstream of the pool
//     that could otherwise take the request is drained, the drains are
//     ignored for that request (and logged once per pool and change), so
//     that a drain never turns into an outage;
//   - an upstream at weight percent p is offered each request with
//     probability p/100 (in consistent_hash, a fixed p% of its keys), so
//     its share is scaled by about p/100, and under the panic wrapper it
//     is also held to p/100 of the others' recent picks (see heldBack);
//     when it alone could take a request, it takes it.
//
// Without drains the cost is one atomic load per selection.

func init() {
	// An undrained upstream comes back on a slow start ramp where its
	// policy has one (least_time's slow_start, panic's), as if it had
	// just returned from being unhealthy.
	drain.Shared().Subscribe(func(c drain.Change) {
		if c.Was.Drained && !c.Drained {
			rampUndrained(c.Addr)
		}
	})
}

// rampUndrained starts the slow start ramp of every state record of addr.
// A record whose policy has no slow start ignores its ramp. A record that
// never served ramps too: a drain reaches every node, so the backend is
// cold for all of them, and a node that joined while it was drained (and
// built its pool with it then) would otherwise hand it a full share at
// once (TestFleetDrain's late node).
func rampUndrained(addr string) {
	now := monoclock.Now()
	hoststate.Each(func(s *hoststate.Stats) bool {
		if s.Dial() == addr {
			s.StartRamp(now)
		}
		return true
	})
}

// drainMask is what the drain store says of the members of one pool, by
// index, as of one store epoch.
type drainMask struct {
	epoch   uint64
	drained []bool  // nil when no member is drained
	percent []uint8 // nil when no member is reweighted; else 100 for the others
	// salt is a hash of each reweighted member's dial address, which
	// admitsKey mixes into the key's hash: the verdict on a key is then
	// the same on every node, whatever the order of its pool.
	salt     []uint64
	weighted bool
	// drainsOnly is the mask without the reweights, nil when nothing is
	// drained; set when weighted.
	drainsOnly *drainMask
	// ignoredLogged: the drains were ignored for a request and that was
	// logged, once for this mask.
	ignoredLogged atomic.Bool
	// reweighted maps the dial address of each member below 100% to its
	// index; picks counts their recent picks and total the pool's, for
	// the panic wrapper, which holds a reweighted member to its percent
	// of the others' picks (see heldBack).
	reweighted map[string]int
	picks      []pickrate.Counter
	total      pickrate.Counter
}

// drainMask returns the mask of v's pool, or nil when no drain or
// reweight touches it: the common case costs an atomic load.
func (v *poolView) drainMask() *drainMask {
	st := drain.Shared()
	epoch := st.Epoch()
	if epoch == 0 {
		return nil
	}
	m := v.drains.Load()
	if m == nil || m.epoch != epoch {
		m = buildDrainMask(st, epoch, v.ups)
		v.drains.Store(m)
	}
	if m.drained == nil && m.percent == nil {
		return nil
	}
	return m
}

func buildDrainMask(st *drain.Store, epoch uint64, ups []*reverseproxy.Upstream) *drainMask {
	m := &drainMask{epoch: epoch}
	if !st.Any() {
		return m
	}
	for i, u := range ups {
		s, ok := st.Lookup(u.Dial)
		if !ok {
			continue
		}
		if s.Drained {
			if m.drained == nil {
				m.drained = make([]bool, len(ups))
			}
			m.drained[i] = true
		} else {
			if m.percent == nil {
				m.percent = make([]uint8, len(ups))
				for j := range m.percent {
					m.percent[j] = 100
				}
				m.salt = make([]uint64, len(ups))
			}
			m.percent[i] = s.WeightPercent
			m.salt[i] = xxhash.Sum64String(u.Dial)
			m.weighted = true
			if s.WeightPercent < 100 {
				if m.reweighted == nil {
					m.reweighted = make(map[string]int)
					m.picks = make([]pickrate.Counter, len(ups))
				}
				m.reweighted[u.Dial] = i
			}
		}
	}
	if m.weighted && m.drained != nil {
		m.drainsOnly = &drainMask{epoch: epoch, drained: m.drained}
	}
	return m
}

// admits reports whether member i may take the request whose weight draw
// is draw (0 ≤ draw < 1; 0 admits every reweighted member).
func (m *drainMask) admits(i int, draw float64) bool {
	if m.drained != nil && m.drained[i] {
		return false
	}
	return m.percent == nil || draw*100 < float64(m.percent[i])
}

// admitsKey is admits for consistent_hash: the draw is the key's hash
// mixed with the member's address, so a key keeps its verdict, on every
// node.
func (m *drainMask) admitsKey(i int, h uint64) bool {
	if m.drained != nil && m.drained[i] {
		return false
	}
	if m.percent == nil || m.percent[i] >= 100 {
		return true
	}
	x := (h ^ m.salt[i]) * 0xbf58476d1ce4e5b9
	return (x>>32)%100 < uint64(m.percent[i])
}

// noteIgnored logs, once per mask, that a request of the pool found only
// drained upstreams usable and was sent to one of them.
func (m *drainMask) noteIgnored(pm *panicMode, total int) {
	if m.ignoredLogged.Load() || !m.ignoredLogged.CompareAndSwap(false, true) {
		return
	}
	if ce := pm.logger.Check(zap.WarnLevel, "every usable upstream of the pool is drained; ignoring the drains for it rather than refusing requests"); ce != nil {
		ce.Write(zap.String("policy", pm.policy), zap.Int("upstreams", total))
	}
}

// selectDrained is the panic wrapper's selection with drains: the wrapped
// policy chooses among ups without the drained ones, and a pick of a
// reweighted upstream is kept with probability percent/100, else the
// wrapped policy is asked again without it. ups are members of v's pool,
// possibly a part of it or their health-blind twins, so they are looked up
// by address.
func (p *PanicSelection) selectDrained(v *poolView, ups []*reverseproxy.Upstream, r *http.Request, w http.ResponseWriter, tried *Tried, now int64) *reverseproxy.Upstream {
	m := v.drainMask()
	if m == nil || p.innerDrains() {
		return p.selectUntried(ups, r, w, tried, now)
	}
	st := drain.Shared()
	var picked *reverseproxy.Upstream
	if m.drained != nil {
		kept := make([]*reverseproxy.Upstream, 0, len(ups))
		for _, u := range ups {
			if s, ok := st.Lookup(u.Dial); !ok || !s.Drained {
				kept = append(kept, u)
			}
		}
		if len(kept) > 0 {
			picked = p.selectUntried(kept, r, w, tried, now)
		}
		if picked == nil {
			m.noteIgnored(&p.panic, len(v.ups))
			return p.selectUntried(ups, r, w, tried, now)
		}
		ups = kept
	} else {
		picked = p.selectUntried(ups, r, w, tried, now)
	}
	if picked == nil || m.reweighted == nil {
		return picked
	}
	t := now
	if t == 0 { // panic mode passes no time (no ramps); weights still apply
		t = monoclock.Now()
	}
	if m.heldBack(picked.Dial, len(v.ups), t) {
		rest := make([]*reverseproxy.Upstream, 0, len(ups))
		for _, u := range ups {
			if u != picked {
				rest = append(rest, u)
			}
		}
		if other := p.selectUntried(rest, r, w, tried, now); other != nil {
			picked = other
		}
	}
	m.countPick(picked.Dial, t)
	return picked
}

// heldBack decides whether the panic wrapper passes over dial, a choice of
// the wrapped policy in a pool of n, at now, for its weight percent p:
// a draw passes over it with probability 1 − p/100, which holds a policy
// blind to load; and it is held to p/100 times the others' recent picks,
// on average, which holds one that seeks the least loaded (least_conn
// offers an upstream that gets fewer requests at nearly every choice, and
// the draw alone would let it take p% of all picks). As slow start's cap
// in the same wrapper (PanicSelection.passOver).
func (m *drainMask) heldBack(dial string, n int, now int64) bool {
	i, ok := m.reweighted[dial]
	if !ok {
		return false
	}
	f := float64(m.percent[i]) / 100
	if rand.Float64() >= f {
		return true
	}
	if n < 2 {
		return false
	}
	mine := m.picks[i].Recent(now)
	return pickrate.HeldTo(f, mine, (m.total.Recent(now)-mine)/float64(n-1))
}

// countPick counts the panic wrapper's pick of dial at now.
func (m *drainMask) countPick(dial string, now int64) {
	m.total.Count(now)
	if i, ok := m.reweighted[dial]; ok {
		m.picks[i].Count(now)
	}
}

// innerDrains reports whether the wrapped policy honours drains itself
// (least_time, consistent_hash): it is then handed the pool whole, so that
// it keeps one view (one ring) of it rather than one per drained subset.
func (p *PanicSelection) innerDrains() bool {
	switch p.inner.(type) {
	case leastTimer, *ConsistentHashSelection:
		return true
	}
	return false
}

// drainView is what the admin view shows of an upstream's drain: drained,
// or the weight percent it keeps (0: not reweighted).
func drainView(dial string) (drained bool, percent int) {
	s, ok := drain.Shared().Lookup(dial)
	if !ok {
		return false, 0
	}
	if s.Drained {
		return true, 0
	}
	return false, int(s.WeightPercent)
}

// markDrains sets the drain fields of the members of each pool.
func markDrains(pools []poolStatus) {
	if !drain.Shared().Any() {
		return
	}
	for i := range pools {
		for j := range pools[i].Upstreams {
			u := &pools[i].Upstreams[j]
			u.Drained, u.WeightPercent = drainView(u.Dial)
		}
	}
}

// withoutDrains is least_time's choice when drains left nothing: first
// with every reweighted member admitted (a weight shapes shares, it never
// refuses a request), then, when only drained members are left, with the
// drains ignored.
func (c leastTimeCandidates) withoutDrains(pm *panicMode, k int) int {
	if c.wdraw > 0 {
		c.wdraw = 0
		if i := c.choose(k); i >= 0 {
			return i
		}
	}
	if c.drain.drained == nil {
		return -1
	}
	c.drain.noteIgnored(pm, len(c.pool))
	c.drain = nil
	return c.choose(k)
}

// pick is consistent_hash's choice on ring for the request whose hash is
// cp.key: bounded from its place on the ring when it has a key (keyed),
// else the least loaded.
func (s *ConsistentHashSelection) pick(ring *hashRing, cp caddyPool, keyed bool, now int64) int {
	if keyed {
		return pickBounded(ring, cp.key, s.BalanceFactor, cp, cp.panic, now)
	}
	return leastLoaded(ring, cp, int(cp.key%uint64(len(cp.pool))))
}

// pickWithoutDrains is consistent_hash's choice when drains left nothing:
// as least_time's withoutDrains.
func (s *ConsistentHashSelection) pickWithoutDrains(ring *hashRing, cp caddyPool, keyed bool, now int64) int {
	m := cp.drain
	if m.weighted {
		cp.drain = m.drainsOnly
		if i := s.pick(ring, cp, keyed, now); i >= 0 {
			return i
		}
	}
	if m.drained == nil {
		return -1
	}
	m.noteIgnored(&s.panic, len(cp.pool))
	cp.drain = nil
	return s.pick(ring, cp, keyed, now)
}

// drainCollector exposes the drain store: one series per address the
// operator drained, undrained or reweighted (at most drain.MaxEntries).
type drainCollector struct{}

var (
	descDrained = prometheus.NewDesc("caddy_lbx_upstream_drained",
		"1 while the operator drains the upstream (POST /lbx/drain), 0 once undrained; only upstreams drained, undrained or reweighted since the process started.", []string{"upstream"}, nil)
	descWeightPercent = prometheus.NewDesc("caddy_lbx_upstream_weight_percent",
		"The percent of its configured weight the operator left the upstream (POST /lbx/weight), 100 when not reweighted; only upstreams drained, undrained or reweighted since the process started.", []string{"upstream"}, nil)
	descDrainRefused = prometheus.NewDesc("caddy_lbx_drain_entries_refused_total",
		"Drain and weight entries from other cluster members refused: a bad signature (another or no ops_key), out of bounds, or no room.", nil, nil)
)

// Describe implements prometheus.Collector.
func (drainCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descDrained
	ch <- descWeightPercent
	ch <- descDrainRefused
}

// Collect implements prometheus.Collector.
func (drainCollector) Collect(ch chan<- prometheus.Metric) {
	st := drain.Shared()
	for _, e := range st.Entries() {
		d := 0.0
		if e.Drained {
			d = 1
		}
		ch <- prometheus.MustNewConstMetric(descDrained, prometheus.GaugeValue, d, e.Addr)
		ch <- prometheus.MustNewConstMetric(descWeightPercent, prometheus.GaugeValue, float64(e.WeightPercent), e.Addr)
	}
	ch <- prometheus.MustNewConstMetric(descDrainRefused, prometheus.CounterValue, float64(st.Dropped()))
}
