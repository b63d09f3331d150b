package rebalance

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/serf/serf"
)

// ErrNotRunning is returned by App.Members before the app's serf member
// has started (Caddy provisions every app before it starts any) or after
// it stopped.
var ErrNotRunning = errors.New("the rebalance app's serf member is not running")

// Member is a cluster member as this node's serf sees it, for discovery:
// the dynamic upstream source `serf` and partition's serf naming source
// read them.
type Member struct {
	// Name is the member's serf node name.
	Name string
	// Addr is the member's advertised address (its gossip address).
	Addr net.IP
	// Port is the member's gossip port.
	Port uint16
	// Status is serf's view of the member; only StatusAlive members are
	// reachable.
	Status MemberStatus
	// Tags are the member's serf tags (the app's `tags`, plus the lbx_
	// ones it publishes). Read-only: serf shares the map.
	Tags map[string]string
	// Self is true for this node.
	Self bool
}

// Members returns the cluster members this node's serf knows, sorted by
// name: alive ones and the failed and left ones serf still remembers (for
// a day by default). It returns ErrNotRunning before the app has started
// or after it stopped. It locks serf's member list briefly; callers that
// serve requests should cache what they build from it.
func (a *App) Members() ([]Member, error) {
	n := a.runningNode()
	if n == nil {
		return nil, ErrNotRunning
	}
	ms := n.serf.Members()
	out := make([]Member, 0, len(ms))
	for _, m := range ms {
		out = append(out, Member{
			Name:   m.Name,
			Addr:   m.Addr,
			Port:   m.Port,
			Status: memberStatus(m.Status),
			Tags:   m.Tags,
			Self:   m.Name == n.name,
		})
	}
	slices.SortFunc(out, func(x, y Member) int { return strings.Compare(x.Name, y.Name) })
	return out, nil
}

// runningNode returns the serf member the app uses, looked up in the pool
// by the app's pool key (set in Provision, never changed after), so it is
// safe to call from request goroutines while Caddy starts or stops the
// app; nil when there is none or it is shut down.
func (a *App) runningNode() *node {
	if a == nil || a.poolKey == "" {
		return nil
	}
	var found *node
	nodes.Range(func(k, v any) bool {
		if k == a.poolKey {
			found, _ = v.(*node)
			return false
		}
		return true
	})
	if found == nil || found.serf == nil || found.serf.State() == serf.SerfShutdown {
		return nil
	}
	return found
}

// HasTags reports whether the member carries every key of want with the
// same value. An empty want matches every member.
func (m Member) HasTags(want map[string]string) bool {
	for k, v := range want {
		got, ok := m.Tags[k]
		if !ok || got != v {
			return false
		}
	}
	return true
}

// DialAddr returns the address (host:port) at which the member serves:
// its advertised IP and the port in its tag portTag when that tag is set
// and portTag is not empty, else port. It is an error when neither gives
// a port, or the port is not a number from 1 to 65535.
func (m Member) DialAddr(port, portTag string) (string, error) {
	p, from := port, "port"
	if portTag != "" {
		if v, ok := m.Tags[portTag]; ok && v != "" {
			p, from = v, "tag "+portTag
		}
	}
	if p == "" {
		return "", fmt.Errorf("member %s has no tag %s and no port is configured", m.Name, portTag)
	}
	if _, err := ParsePort(p); err != nil {
		return "", fmt.Errorf("member %s: %s: %v", m.Name, from, err)
	}
	if m.Addr == nil {
		return "", fmt.Errorf("member %s has no address", m.Name)
	}
	return net.JoinHostPort(m.Addr.String(), p), nil
}

// ParsePort parses a TCP port number from 1 to 65535.
func ParsePort(s string) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("port %q: want a number from 1 to 65535", s)
	}
	return p, nil
}

// memberLoad is a member with its last load report, judged by the rule of
// the cluster average.
type memberLoad struct {
	Member
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

// memberLoads returns every member serf knows, with its load as the
// node's decision loop last saw it (the tag and when it last changed, in
// node.seen) judged at now by the app's freshness and metric. It reads
// serf's member list and locks the node briefly: callers on a request path
// must cache what they build from it. It returns ErrNotRunning before the
// app has started or after it stopped.
func (a *App) memberLoads(now time.Time) ([]memberLoad, error) {
	n := a.runningNode()
	if n == nil {
		return nil, ErrNotRunning
	}
	ms := n.serf.Members()
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]memberLoad, 0, len(ms))
	for _, m := range ms {
		self := m.Name == n.name
		seen := n.seen[m.Name]
		r := Report{Name: m.Name, Status: memberStatus(m.Status), At: seen.at}
		r.Metric, r.Load, _ = parseLoadTag(seen.raw)
		if self && len(n.owners) > 0 {
			// The value this node gossips, as of its last step.
			r.Metric, r.Load, r.At = n.owners[len(n.owners)-1].metric, n.local, n.lastAt
		}
		st := a.params.standing(r, now)
		if st != counted {
			r.Load = 0 // not a load to use, and maybe NaN
		}
		out = append(out, memberLoad{
			Member: Member{
				Name: m.Name, Addr: m.Addr, Port: m.Port,
				Status: r.Status, Tags: m.Tags, Self: self,
			},
			Load:   r.Load,
			Counts: st == counted,
		})
	}
	return out, nil
}

// stepClock returns the coarse clock of the app's node (node.steps), or
// nil when the node is not running.
func (a *App) stepClock() *atomic.Int64 {
	n := a.runningNode()
	if n == nil {
		return nil
	}
	return &n.steps
}
