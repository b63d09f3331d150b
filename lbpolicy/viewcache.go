package lbpolicy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// views holds a policy's views of the pools it serves. Usually there is
// one: a config's static upstreams, passed as the same slice every time.
// One policy can serve several pools, though — each partition of a
// `partition` handler is a pool of its own, and its sub-requests hand the
// policy fresh Upstream values every time — and a view's state (member
// state, the availability count, panic mode) belongs to its pool, not to
// the policy: shared, a healthy partition and one in panic would flip the
// mode on every request. A view is found by identity first (free), then by
// its members' dial addresses, in order.
//
// Pools that churn (dynamic upstreams whose members come and go, a naming
// file that changes) leave views and upstream state behind; the releaser
// forgets them (see release).
type views struct {
	last atomic.Pointer[poolView]

	mu    sync.RWMutex
	byKey map[uint64][]*poolView // by dialsKey
	n     int

	// rel, when set, is what release needs: the table whose addresses
	// it drops, the static upstreams it keeps, how long it waits.
	rel *releaser
}

// releaser is how a policy lets go of the views and the upstream state of
// addresses that left its pools: without it, a pool whose members churn
// (a member of `dynamic serf` changing its port 150 times) would keep every
// address it ever had, in /lbx/upstreams and in the metrics, until the
// config is unloaded.
type releaser struct {
	table  *hoststate.Table // nil for a policy that keeps no upstream state
	static map[string]bool  // the handler's static upstreams: never dropped
	linger int64            // ns; see lingerFor
}

// minLinger is the least time an address stays after the last pool that
// had it was used; see lingerFor.
const minLinger = time.Minute

// lingerFor returns how long a policy keeps an address no pool offers any
// more, given the windows of state the policy keeps per upstream (decay,
// slow start, outlier interval): twice the longest, and at least
// minLinger. An address that returns within it finds its state; one that
// returns later starts afresh, which after twice the decay is what its
// estimate would have decayed to anyway.
func lingerFor(windows ...time.Duration) time.Duration {
	l := minLinger
	for _, w := range windows {
		l = max(l, 2*w)
	}
	return l
}

// lingerOf is lingerFor over the windows of outlier ejection and slow
// start (each when set) and the policy's own windows.
func lingerOf(outlier *Outlier, slowStart *SlowStart, own ...time.Duration) time.Duration {
	if outlier != nil {
		own = append(own, time.Duration(outlier.Interval))
	}
	if slowStart != nil {
		own = append(own, time.Duration(slowStart.Window))
	}
	return lingerFor(own...)
}

// releaseEvery returns how often a policy with linger l looks for views and
// addresses to release: a quarter of l, between 15 s and a minute. An
// address goes at most l plus this after the last pool offered it.
func releaseEvery(l time.Duration) time.Duration {
	return min(max(l/4, 15*time.Second), time.Minute)
}

// newReleaser returns the releaser of a policy with linger l, whose state
// is in table (nil: none), for a policy of handler h (nil: not inside a
// reverse_proxy).
func newReleaser(table *hoststate.Table, h *reverseproxy.Handler, l time.Duration) *releaser {
	r := &releaser{table: table, static: map[string]bool{}, linger: int64(l)}
	if h != nil {
		for _, u := range h.Upstreams {
			if u != nil {
				r.static[u.Dial] = true
			}
		}
	}
	return r
}

// startReleasing runs release every releaseEvery in a goroutine of its
// own, until done closes. Each round reads the clock with monoclock.Now,
// which also keeps monoclock.Latest, read for the views' last-use stamps,
// within a round of real time when there is no traffic: a stamp lags the
// last use by at most a round plus touchEvery (a quarter of linger plus a
// second), so a view used in the last three quarters of linger, less a
// second, is never released. The addresses' own clocks (their last
// attempt) are exact readings.
func (c *views) startReleasing(done <-chan struct{}, logger *zap.Logger) {
	if c.rel == nil || done == nil {
		return
	}
	every := releaseEvery(time.Duration(c.rel.linger))
	go tickUntil(done, every, func(now int64) { c.safeRelease(now, logger) })
}

// safeRelease is release with a panic logged rather than taking down the
// process; the next round tries again.
func (c *views) safeRelease(now int64, logger *zap.Logger) {
	defer func() {
		if r := recover(); r != nil {
			logger.Error("releasing upstream state panicked", zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	if v, a := c.release(now); v+a > 0 {
		if ce := logger.Check(zap.DebugLevel, "released the state of pools and upstreams no longer offered"); ce != nil {
			ce.Write(zap.Int("views", v), zap.Int("upstreams", a))
		}
	}
}

// release forgets the views no request has used for linger, but those
// whose members are all static upstreams, and has the table drop the
// addresses no kept view holds that had no attempt for linger (see
// hoststate.Table.DropIdle: never one with a request in flight, nor one
// ejected in the last linger). It returns how many views and addresses
// it released. A request that holds a released view or state finishes
// with it; the next one builds a new view.
func (c *views) release(now int64) (released, dropped int) {
	rel := c.rel
	if rel == nil {
		return 0, 0
	}
	live := map[string]bool{}
	c.mu.Lock()
	for key, vs := range c.byKey {
		kept := vs[:0]
		for _, v := range vs {
			if v.static || now-v.usedAt.Load() < rel.linger {
				kept = append(kept, v)
				for _, u := range v.ups {
					live[u.Dial] = true
				}
				continue
			}
			c.forget(v)
			released++
		}
		if len(kept) == 0 {
			delete(c.byKey, key)
		} else {
			clear(vs[len(kept):])
			c.byKey[key] = kept
		}
	}
	c.n -= released
	c.mu.Unlock()
	if rel.table != nil {
		dropped = rel.table.DropIdle(now, time.Duration(rel.linger), func(dial string) bool { return live[dial] || rel.static[dial] })
	}
	return released, dropped
}

// forget marks v released: get no longer returns it, and it stops being
// the last view. Called with c.mu held.
func (c *views) forget(v *poolView) {
	v.gone.Store(true)
	c.last.CompareAndSwap(v, nil)
}

// maxViews bounds how many views a policy keeps; a source whose pools keep
// changing makes the policy start over rather than grow without end.
const maxViews = 64

// recentViews is how long a view found by its dial addresses stays in the
// reports after it was last used.
const recentViews = int64(5 * 60 * 1e9)

// get returns the view of pool, building it with build the first time.
func (c *views) get(pool reverseproxy.UpstreamPool, build func(reverseproxy.UpstreamPool) *poolView) *poolView {
	if v := c.last.Load(); v.matches(pool) && !v.gone.Load() {
		v.touch()
		return v
	}
	key := dialsKey(pool)
	c.mu.RLock()
	v := c.find(key, pool)
	c.mu.RUnlock()
	if v == nil {
		c.mu.Lock()
		if v = c.find(key, pool); v == nil {
			v = build(pool)
			v.static = c.rel != nil && allStatic(pool, c.rel.static)
			if c.n >= maxViews || c.byKey == nil {
				for _, vs := range c.byKey {
					for _, old := range vs {
						c.forget(old)
					}
				}
				c.byKey, c.n = map[uint64][]*poolView{}, 0
			}
			c.byKey[key] = append(c.byKey[key], v)
			c.n++
		}
		c.mu.Unlock()
	}
	v.touch()
	if v.matches(pool) {
		c.last.Store(v)
	}
	return v
}

// touchEvery is how stale a view's last-use stamp may get before a use
// writes it again: every Select writing one shared word would make the
// cores fight over its cache line, and release counts in minutes.
const touchEvery = int64(time.Second)

// touch stamps v as used now (monoclock.Latest).
func (v *poolView) touch() {
	if now := monoclock.Latest(); now-v.usedAt.Load() >= touchEvery {
		v.usedAt.Store(now)
	}
}

// allStatic reports whether every member of pool is a static upstream.
func allStatic(pool reverseproxy.UpstreamPool, static map[string]bool) bool {
	if len(static) == 0 {
		return false
	}
	for _, u := range pool {
		if !static[u.Dial] {
			return false
		}
	}
	return true
}

func (c *views) find(key uint64, pool reverseproxy.UpstreamPool) *poolView {
	for _, v := range c.byKey[key] {
		if v.sameDials(pool) {
			return v
		}
	}
	return nil
}

// all returns the views to report: the last one used, and the others used
// in the last recentViews.
func (c *views) all() []*poolView {
	last := c.last.Load()
	now := monoclock.Now()
	c.mu.RLock()
	defer c.mu.RUnlock()
	var out []*poolView
	for _, vs := range c.byKey {
		for _, v := range vs {
			if !v.gone.Load() && (v == last || now-v.usedAt.Load() < recentViews) {
				out = append(out, v)
			}
		}
	}
	return out
}

// dialsKey hashes the dial addresses of pool, in order (FNV-1a).
func dialsKey(pool reverseproxy.UpstreamPool) uint64 {
	h := uint64(14695981039346656037)
	for _, u := range pool {
		for i := 0; i < len(u.Dial); i++ {
			h = (h ^ uint64(u.Dial[i])) * 1099511628211
		}
		h = (h ^ 0xff) * 1099511628211 // separator
	}
	return h
}

// sameDials reports whether v was built from a pool with pool's dial
// addresses, in order.
func (v *poolView) sameDials(pool reverseproxy.UpstreamPool) bool {
	if len(pool) != len(v.ups) {
		return false
	}
	for i, u := range pool {
		if u.Dial != v.ups[i].Dial {
			return false
		}
	}
	return true
}
