package selective

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/cespare/xxhash/v2"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/latdist"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/lbpolicy"
)

// group is a provisioned Group.
type group struct {
	name     string
	nameHash uint64 // xxhash of name, for the hash policy
	weight   float64
	sub      *caddyhttp.Subroute
	state    *groupState
	key      string // groupStates key

	// Where the group's capacity comes from (see capacity): its
	// reverse_proxy with static upstreams (and their shared state, for
	// lbx's outlier ejection), its reverse_proxy's dynamic upstream
	// source, or a nested handler that reports its own.
	static   []*reverseproxy.Upstream
	upStats  []*hoststate.Stats
	hosts    *hoststate.Table
	dynamic  *countingSource
	reporter capacityReporter

	metrics  groupMetrics
	released bool

	// The last count of usable static upstreams, reused for countEvery
	// unless an ejection happened since: counting is O(upstreams).
	countedAt, countEpoch atomic.Int64
	counted               atomic.Int64

	// The backup delay backup_request_auto last computed, and when.
	autoNs, autoAt atomic.Int64
}

// countEvery is how long (ns) a count of a group's usable upstreams is
// reused, as lb_policy least_time reuses its count of available upstreams:
// choosing stays O(groups), and a health change shows within a blink.
const countEvery = int64(5e6)

// groupStates holds each group's state, keyed by the group's name and
// routes, so a reload that keeps a group keeps its estimate and its count
// of attempts in flight (the old config's attempts finish on the same
// state).
var groupStates = caddy.NewUsagePool()

// groupState is what is known of a group across configs.
type groupState struct {
	// stats is the group's latency estimate and attempts awaiting
	// headers, kept by the estimator lb_policy least_time uses. It is not in
	// hoststate's registry of upstream addresses: a group is not one.
	stats *hoststate.Stats
	// inFlight counts attempts not finished (response body included).
	inFlight atomic.Int64

	// consecutive failed attempts, when the last one failed, and whether
	// the group is failing (see usableNow).
	consecutive   atomic.Int64
	lastFailureNs atomic.Int64
	failing       atomic.Bool

	// lat is the recent distribution of the group's answer latencies,
	// for backup_request_auto.
	lat *latdist.Dist

	attempts, failures, answers atomic.Uint64
	backupSent, backupWon       atomic.Uint64
}

// Destruct implements caddy.Destructor; a groupState holds no resources.
func (*groupState) Destruct() error { return nil }

// A group that failed failingStreak attempts in a row is not chosen for
// failingCooldown after its last failure (except when no other group is
// usable); then requests try it again, and one success clears it. The
// latency policy prices failures in its estimate as well.
const (
	failingStreak   = 5
	failingCooldown = time.Second
)

// capacityReporter is a handler that can say how much of it is usable, for
// the group that holds it: a nested selective.
type capacityReporter interface {
	// Capacity returns the usable and total capacity, in upstreams
	// times weights.
	Capacity() (usable, total float64)
}

// countingSource wraps a reverse_proxy's dynamic upstream source and
// remembers how many upstreams it last returned: the group's capacity.
type countingSource struct {
	inner reverseproxy.UpstreamSource
	n     atomic.Int64
	seen  atomic.Bool
}

// GetUpstreams implements reverseproxy.UpstreamSource.
func (s *countingSource) GetUpstreams(r *http.Request) ([]*reverseproxy.Upstream, error) {
	ups, err := s.inner.GetUpstreams(r)
	if err == nil {
		s.n.Store(int64(len(ups)))
		s.seen.Store(true)
	}
	return ups, err
}

// provisionGroup provisions g's routes and finds where its capacity comes
// from.
func provisionGroup(ctx caddy.Context, g *Group) (*group, error) {
	raw, err := json.Marshal(g.Routes)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(raw)
	// After the key: a default written here must not change the state a
	// reload finds the group's under.
	if err := lbpolicy.DefaultRoutesPolicy(g.Routes); err != nil {
		return nil, err
	}
	pg := &group{
		name:     g.Name,
		nameHash: xxhash.Sum64String(g.Name),
		weight:   float64(max(g.Weight, 1)),
		key:      g.Name + "/" + hex.EncodeToString(sum[:8]),
		sub:      &caddyhttp.Subroute{Routes: g.Routes},
	}
	if err := pg.sub.Provision(ctx); err != nil {
		return nil, err
	}
	v, _, _ := groupStates.LoadOrNew(pg.key, func() (caddy.Destructor, error) {
		return &groupState{stats: hoststate.NewStats(pg.key), lat: latdist.New(autoWindow)}, nil
	})
	pg.state = v.(*groupState)
	pg.metrics = newGroupMetrics(pg.name)
	pg.findCapacity(pg.sub.Routes)
	return pg, nil
}

// findCapacity looks through routes for the first handler that tells the
// group's capacity.
func (g *group) findCapacity(routes caddyhttp.RouteList) bool {
	for _, rt := range routes {
		for _, mh := range rt.Handlers {
			switch h := mh.(type) {
			case *reverseproxy.Handler:
				switch {
				case h.DynamicUpstreams != nil:
					g.dynamic = &countingSource{inner: h.DynamicUpstreams}
					h.DynamicUpstreams = g.dynamic
				case len(h.Upstreams) > 0:
					g.static = h.Upstreams
					g.hosts = hoststate.NewTable(hoststate.Config{})
					for _, u := range h.Upstreams {
						g.upStats = append(g.upStats, g.hosts.Stats(u.Dial))
					}
				}
				return true
			case *caddyhttp.Subroute:
				if g.findCapacity(h.Routes) {
					return true
				}
			case capacityReporter:
				g.reporter = h
				return true
			}
		}
	}
	return false
}

// capacity returns how many of the group's upstreams are usable now, and
// how many it has, unweighted. A group whose capacity cannot be known
// counts as one upstream, usable.
func (g *group) capacity(now int64) (usable, total float64) {
	switch {
	case g.static != nil:
		total = float64(len(g.static))
		epoch := int64(hoststate.EjectionEpoch())
		if at := g.countedAt.Load(); at != 0 && now-at < countEvery && g.countEpoch.Load() == epoch {
			return float64(g.counted.Load()), total
		}
		n := 0
		for i, u := range g.static {
			if g.usable(i, u, now) {
				n++
			}
		}
		g.counted.Store(int64(n))
		g.countEpoch.Store(epoch)
		g.countedAt.Store(now)
		return float64(n), total
	case g.dynamic != nil:
		if !g.dynamic.seen.Load() {
			return 1, 1
		}
		n := float64(g.dynamic.n.Load())
		return n, n
	case g.reporter != nil:
		return g.reporter.Capacity()
	}
	return 1, 1
}

// usable reports whether static upstream i (u) can be chosen at now:
// Caddy's availability, and not ejected.
func (g *group) usable(i int, u *reverseproxy.Upstream, now int64) bool {
	return u.Available() && !g.upStats[i].Ejected(now)
}

// spare reports whether the group can take a backup request without
// queueing it behind other work (Prequal's lesson: a hedge that waits in
// a busy replica's queue delays what is queued there and seldom wins),
// and returns the upstreams the backup must not go to. running is where
// the call's attempts on this group went: a backup never joins them.
//
// A group of static upstreams has spare capacity when one of them, not in
// running, is usable, has no request in flight as Caddy counts them
// (every handler's requests to that address), and is not expected to take
// longer than limit ns (base is the typical latency, for hosts not seen
// lately): a replica that froze, whose abandoned attempts left it looking
// idle, is still expected to be as slow as its stall (hoststate's Judge).
// avoid then lists every usable upstream that is not such a replica, so
// that the group's policy (when it tracks what a request tried, as least_time
// and panic do) chooses among the spare ones only.
//
// Any other group has spare capacity when it has fewer of this handler's
// attempts in flight than usable capacity, and avoid is running: a group
// of one dynamic upstream with the call's attempt on it has none.
func (g *group) spare(now int64, running []string, limit, base float64) (ok bool, avoid []string) {
	if g.static == nil {
		usable, _ := g.capacity(now)
		if float64(g.state.inFlight.Load()) >= usable {
			return false, nil
		}
		return true, running
	}
	for i, u := range g.static {
		if !g.usable(i, u, now) {
			continue
		}
		if !slices.Contains(running, u.Dial) && u.NumRequests() == 0 {
			if lat, _ := g.hosts.Judge(g.upStats[i], now, base); lat <= limit {
				ok = true
				continue
			}
		}
		avoid = append(avoid, u.Dial)
	}
	if !ok {
		return false, nil
	}
	return true, avoid
}

// failingNow reports whether the group is in its failure cooldown.
func (g *group) failingNow(now int64) bool {
	return g.state.failing.Load() && now-g.state.lastFailureNs.Load() < int64(failingCooldown)
}

// Capacity implements capacityReporter: the sum of the groups' capacities
// times their weights (brpc's rule for a selective channel).
func (h *Handler) Capacity() (usable, total float64) {
	now := monoclock.Now()
	for _, g := range h.groups {
		u, t := g.capacity(now)
		if g.failingNow(now) {
			u = 0
		}
		usable += u * g.weight
		total += t * g.weight
	}
	return usable, total
}

// release gives up the group's references on shared state.
func (g *group) release() {
	if g.hosts != nil {
		g.hosts.Release()
	}
	if g.state != nil && !g.released {
		// The state itself stays valid for attempts of this config
		// still running.
		_, _ = groupStates.Delete(g.key)
		g.released = true
	}
}

// String names the group for logs.
func (g *group) String() string { return fmt.Sprintf("group %s", g.name) }
