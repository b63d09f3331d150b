package lbpolicy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

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
type views struct {
	last atomic.Pointer[poolView]

	mu    sync.RWMutex
	byKey map[uint64][]*poolView // by dialsKey
	n     int

	// pruner, when set, is run after a view is built: a new pool is
	// when the addresses may have churned.
	pruner *pruner
}

// pruner releases a policy's references on addresses that left its pools.
// The table takes one for every address a pool ever had (a partition's
// replicas come from a naming file that may churn); without it the table
// would grow until the config is unloaded.
type pruner struct {
	table  *hoststate.Table
	static map[string]bool // the handler's static upstreams: never dropped
	lastNs atomic.Int64
}

// How often a policy looks for addresses to release, and how long an
// address must have had no attempt to be released (long enough that its
// estimate has decayed to the baseline several times over).
const (
	pruneEvery = int64(time.Minute)
	pruneIdle  = 10 * time.Minute
)

// newPruner returns the pruner of table, for a policy of handler h.
func newPruner(table *hoststate.Table, h *reverseproxy.Handler) *pruner {
	p := &pruner{table: table, static: make(map[string]bool, len(h.Upstreams))}
	for _, u := range h.Upstreams {
		if u != nil {
			p.static[u.Dial] = true
		}
	}
	return p
}

// prune drops the table's addresses that no view has and no attempt used
// for pruneIdle, at most once every pruneEvery.
func (c *views) prune(now int64) {
	p := c.pruner
	if p == nil || p.table == nil {
		return
	}
	last := p.lastNs.Load()
	if now-last < pruneEvery || !p.lastNs.CompareAndSwap(last, now) {
		return
	}
	live := c.dials()
	p.table.DropIdle(now, pruneIdle, func(dial string) bool { return live[dial] || p.static[dial] })
}

// dials returns the addresses of every view kept.
func (c *views) dials() map[string]bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := make(map[string]bool)
	for _, vs := range c.byKey {
		for _, v := range vs {
			for _, u := range v.ups {
				out[u.Dial] = true
			}
		}
	}
	return out
}

// maxViews bounds how many views a policy keeps; a source whose pools keep
// changing makes the policy start over rather than grow without end.
const maxViews = 64

// recentViews is how long a view found by its dial addresses stays in the
// reports after it was last used.
const recentViews = int64(5 * 60 * 1e9)

// get returns the view of pool, building it with build the first time.
func (c *views) get(pool reverseproxy.UpstreamPool, build func(reverseproxy.UpstreamPool) *poolView) *poolView {
	if v := c.last.Load(); v.matches(pool) {
		return v
	}
	key := dialsKey(pool)
	c.mu.RLock()
	v := c.find(key, pool)
	c.mu.RUnlock()
	if v == nil {
		built := false
		c.mu.Lock()
		if v = c.find(key, pool); v == nil {
			v = build(pool)
			if c.n >= maxViews || c.byKey == nil {
				c.byKey, c.n = map[uint64][]*poolView{}, 0
			}
			c.byKey[key] = append(c.byKey[key], v)
			c.n++
			built = true
		}
		c.mu.Unlock()
		if built {
			c.prune(monoclock.Now())
		}
	}
	v.usedAt.Store(monoclock.Latest())
	if v.matches(pool) {
		c.last.Store(v)
	}
	return v
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
			if v == last || now-v.usedAt.Load() < recentViews {
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
