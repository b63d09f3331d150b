package rebalance

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// memberLoad is a member with its last load report, judged by the rule of
// the cluster average.
type memberLoad struct {
	cluster.Member
	// Load is the member's gossiped, smoothed load, in the unit of the
	// metric; 0 unless Counts.
	Load float64
	// Counts is true when the report counts toward the cluster average
	// now (Params.standing): the member is alive, the tag was seen to
	// change within freshness, and it holds a valid load in this node's
	// metric. This node's own report counts once it has gossiped one
	// within freshness.
	Counts bool
}

// nodeLoads reads the loads the rebalance node on a cluster member keeps:
// where lb_policy cluster_load reads them. It finds the node by the
// member's key at every call, so the policy needs no reference to the
// rebalance app (which would make the HTTP app provision it) and follows
// the node across reloads.
type nodeLoads struct{ cluster *cluster.App }

// node returns the rebalance node on the member, or nil when none runs.
func (l nodeLoads) node() *node {
	if l.cluster == nil {
		return nil
	}
	key := l.cluster.Key()
	var found *node
	nodes.Range(func(k, v any) bool {
		if k == key {
			found, _ = v.(*node)
			return false
		}
		return true
	})
	return found
}

// errNotStarted is returned by memberLoads while no rebalance app runs on
// the cluster member.
var errNotStarted = errors.New("no rebalance app runs on this node's cluster member")

// memberLoads returns every member serf knows, with its load as the
// node's decision loop last saw it (the tag and when it last changed, in
// node.seen) judged at now by the node's freshness and metric. It reads
// serf's member list and locks the node briefly: callers on a request path
// must cache what they build from it.
func (l nodeLoads) memberLoads(now time.Time) ([]memberLoad, error) {
	n := l.node()
	if n == nil {
		return nil, errNotStarted
	}
	s := n.driver()
	if s == nil {
		return nil, errNotStarted
	}
	ms, err := s.cluster.Members()
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]memberLoad, 0, len(ms))
	for _, m := range ms {
		seen := n.seen[m.Name]
		r := shed.Report{Name: m.Name, Status: m.Status, At: seen.at}
		r.Metric, r.Load, _ = shed.ParseLoadTag(seen.raw)
		if m.Self {
			// The value this node gossips, as of its last step.
			r.Metric, r.Load, r.At = s.metric, n.local, n.lastAt
		}
		st := s.params.Standing(r, now)
		if st != shed.Counted {
			r.Load = 0 // not a load to use, and maybe NaN
		}
		out = append(out, memberLoad{Member: m, Load: r.Load, Counts: st == shed.Counted})
	}
	return out, nil
}

// stepClock returns the coarse clock of the node (node.steps), or nil when
// none runs.
func (l nodeLoads) stepClock() *atomic.Int64 {
	if n := l.node(); n != nil {
		return &n.steps
	}
	return nil
}

// interval returns the node's interval, or 0 when none runs.
func (l nodeLoads) interval() time.Duration {
	if n := l.node(); n != nil {
		if s := n.driver(); s != nil {
			return s.interval
		}
	}
	return 0
}
