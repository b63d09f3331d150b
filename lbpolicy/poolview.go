package lbpolicy

import (
	"math"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// countEvery is how long (ns) a count of available upstreams is reused
// before the pool is counted again. Counting is O(pool); reusing it for a
// few milliseconds keeps selection O(1) while panic mode still reacts
// within a blink of a health change.
const countEvery = int64(5e6)

// poolView is what a policy derived from one upstream pool: per-member
// state and weights in pool order, a cached availability count and the
// pool's panic mode. A policy keeps its views in a views cache.
type poolView struct {
	// first and ups identify the pool: the address of its first element
	// and a copy of its members.
	first **reverseproxy.Upstream
	ups   []*reverseproxy.Upstream

	members  []member                 // least_time: per-member state, in pool order
	shadows  []*reverseproxy.Upstream // panic: health-blind twins
	shadowOf map[*reverseproxy.Upstream]int
	ring     *hashRing                 // consistent_hash: the pool's ring
	drains   atomic.Pointer[drainMask] // see drainMask

	countedAt atomic.Int64
	// shareRef caches hoststate.ShareReference over the members (float64
	// bits) as of shareAt; see shareReference.
	shareRef  atomic.Uint64
	shareAt   atomic.Int64
	available atomic.Int64
	epoch     atomic.Uint64 // hoststate.EjectionEpoch at the last count
	panic     panicState
	usedAt    atomic.Int64 // hoststate clock; see views
	// static: every member is one of the handler's static upstreams, so
	// the view is the config's own and is never released.
	static bool
	// gone: released (see views.release); get builds a new view instead.
	gone atomic.Bool

	// returned, when set, is called by a count for member i that Caddy
	// deems healthy again after an earlier count saw it unhealthy.
	returned func(v *poolView, i int, now int64)

	// unejected is the pool without its ejected members as of the last
	// count, for wrapped policies that cannot skip ejected upstreams
	// themselves; nil when none is ejected. Kept only when keepUnejected.
	unejected     atomic.Pointer[[]*reverseproxy.Upstream]
	keepUnejected bool
}

// member is what the least_time policy keeps per pool member, together so that
// costing a candidate touches one slot.
type member struct {
	stats     *hoststate.Stats
	invWeight float64     // 1 / weight
	down      atomic.Bool // unhealthy at the last count
}

// shareEvery is how long (ns) a computed share reference is reused. The
// rates it compares decay over seconds, and computing it visits the pool,
// so it is computed at most ten times a second, and only while a failing
// member is being costed.
const shareEvery = int64(100e6)

// shareReference returns hoststate.ShareReference over the view's
// members at about now.
func (v *poolView) shareReference(now int64) float64 {
	if at := v.shareAt.Load(); at != 0 && now-at < shareEvery {
		return math.Float64frombits(v.shareRef.Load())
	}
	ref := hoststate.ShareReference(now, len(v.members), func(i int) (*hoststate.Stats, float64) {
		return v.members[i].stats, v.members[i].invWeight
	})
	// concurrent refreshes compute the same thing; the last store wins
	v.shareRef.Store(math.Float64bits(ref))
	v.shareAt.Store(now)
	return ref
}

// matches reports whether v was built from pool. It checks identity and
// both ends rather than every member, to stay O(1).
func (v *poolView) matches(pool reverseproxy.UpstreamPool) bool {
	n := len(pool)
	if v == nil || n != len(v.ups) {
		return false
	}
	if n == 0 {
		return true
	}
	return v.first == &pool[0] && v.ups[0] == pool[0] && v.ups[n-1] == pool[n-1]
}

func newView(pool reverseproxy.UpstreamPool) *poolView {
	v := &poolView{ups: append([]*reverseproxy.Upstream(nil), pool...)}
	if len(pool) > 0 {
		v.first = &pool[0]
	}
	v.countedAt.Store(-countEvery)
	return v
}

// availability returns how many members of pool are available, counting
// again when the last count is older than countEvery or an upstream was
// ejected or returned early since (anywhere: the epoch is process-wide, and
// ejections are rare), so an ejection takes effect on the next request.
func (v *poolView) availability(pool reverseproxy.UpstreamPool, now int64) int {
	epoch := hoststate.EjectionEpoch()
	if now-v.countedAt.Load() < countEvery && v.epoch.Load() == epoch {
		return int(v.available.Load())
	}
	n := v.countAvailable(pool, now)
	v.available.Store(int64(n))
	v.epoch.Store(epoch)
	v.countedAt.Store(now)
	return n
}

// availableNow counts the available members afresh, for reports: the
// cached count is only kept up to date while panic mode is enabled.
func (v *poolView) availableNow() int { return v.countAvailable(v.ups, monoclock.Now()) }

// countAvailable counts the members Caddy deems available and, where the
// view tracks member state, that are not ejected. When the view watches
// for returns, it also notes members that became healthy again.
func (v *poolView) countAvailable(pool reverseproxy.UpstreamPool, now int64) int {
	n, ejected := 0, 0
	for i, u := range pool {
		if v.returned != nil {
			v.noteHealth(i, u.Healthy(), now)
		}
		if v.members != nil && v.members[i].stats.Ejected(now) {
			ejected++
			continue
		}
		if u.Available() {
			n++
		}
	}
	if v.keepUnejected {
		v.filterEjected(pool, ejected, now)
	}
	return n
}

// withoutEjected returns the members of pool that are not ejected at now.
func (v *poolView) withoutEjected(pool reverseproxy.UpstreamPool, now int64) []*reverseproxy.Upstream {
	kept := make([]*reverseproxy.Upstream, 0, len(pool))
	for i, u := range pool {
		if !v.members[i].stats.Ejected(now) {
			kept = append(kept, u)
		}
	}
	return kept
}

// filterEjected updates v.unejected, given how many members are ejected.
func (v *poolView) filterEjected(pool reverseproxy.UpstreamPool, ejected int, now int64) {
	if ejected == 0 {
		if v.unejected.Load() != nil {
			v.unejected.Store(nil)
		}
		return
	}
	kept := v.withoutEjected(pool, now)
	v.unejected.Store(&kept)
}

// noteHealth records member i's health as Caddy sees it and reports a
// return from unhealthy to v.returned, once.
func (v *poolView) noteHealth(i int, healthy bool, now int64) {
	m := &v.members[i]
	if !healthy {
		if !m.down.Load() {
			m.down.Store(true)
		}
		return
	}
	if m.down.Load() && m.down.CompareAndSwap(true, false) {
		v.returned(v, i, now)
	}
}
