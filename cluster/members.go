package cluster

import (
	"errors"
	"fmt"
	"net"
	"strconv"

	"github.com/hashicorp/serf/serf"
)

// MemberStatus is serf's view of a member.
type MemberStatus int

// Member statuses.
const (
	StatusAlive MemberStatus = iota
	StatusLeaving
	StatusLeft
	StatusFailed
)

// String returns serf's name for the status.
func (s MemberStatus) String() string {
	switch s {
	case StatusAlive:
		return "alive"
	case StatusLeaving:
		return "leaving"
	case StatusLeft:
		return "left"
	case StatusFailed:
		return "failed"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// statusOf converts serf's status.
func statusOf(s serf.MemberStatus) MemberStatus {
	switch s {
	case serf.StatusAlive:
		return StatusAlive
	case serf.StatusLeaving:
		return StatusLeaving
	case serf.StatusLeft:
		return StatusLeft
	}
	return StatusFailed
}

// Member is a cluster member as this node's serf sees it.
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
	// Tags are the member's serf tags (its configured tags, plus the lbx_
	// ones it publishes). Read-only: serf shares the map.
	Tags map[string]string
	// Self is true for this node.
	Self bool
}

// Status is the state of this node's serf member.
type Status struct {
	// Name is the member's node name.
	Name string
	// Addr is the address other members reach it at (host:port).
	Addr string
	// Encrypted is true when gossip is encrypted.
	Encrypted bool
	// Joined is true once a join of the configured addresses succeeded,
	// and while another member is alive (one that joined this node).
	Joined bool
	// JoinError is the last join's error; empty after a success and
	// while Joined.
	JoinError string
	// Conflict is set when serf shut the member down because another
	// member uses its name.
	Conflict string
}

// Members returns the cluster members this node's serf knows, sorted by
// name: alive ones and the failed and left ones serf still remembers (for
// a day by default). It returns ErrNotRunning before the app has started
// or after it stopped, and the conflict's explanation once serf shut the
// member down over its name. It locks serf's member list briefly; callers
// that serve requests should cache what they build from it.
func (a *App) Members() ([]Member, error) {
	m := a.runningMember()
	if m == nil {
		return nil, a.notRunning()
	}
	return m.list(), nil
}

// Publish sets this node's member tag key (which must start with
// reservedTagPrefix) to value, or removes it when value is empty, and
// has the member's tags gossiped in the background: it does not wait for
// serf's broadcast (up to 2s when no peer acknowledges; serf's errors are
// logged at debug level), and values set while one is under way are
// published together after it. The tag stays across reloads until
// removed. It returns ErrNotRunning, or the
// name conflict, when the member does not run.
func (a *App) Publish(key, value string) error {
	m := a.runningMember()
	if m == nil {
		return a.notRunning()
	}
	m.publish(key, value)
	return nil
}

// Status returns the state of the app's serf member; ok is false when it
// is not running.
func (a *App) Status() (st Status, ok bool) {
	m := a.pooledMember()
	if m == nil {
		return Status{}, false
	}
	return m.status(), true
}

// notRunning is the error of a call on a member that does not run.
func (a *App) notRunning() error {
	if m := a.pooledMember(); m != nil {
		if c := m.status().Conflict; c != "" {
			return errors.New(c)
		}
	}
	return ErrNotRunning
}

// pooledMember returns the serf member the app uses, looked up in the
// pool by the app's pool key (set in Provision, never changed after), so
// it is safe to call from request goroutines while Caddy starts or stops
// the app; nil when there is none.
func (a *App) pooledMember() *member {
	if a == nil || a.poolKey == "" {
		return nil
	}
	var found *member
	members.Range(func(k, v any) bool {
		if k == a.poolKey {
			found, _ = v.(*member)
			return false
		}
		return true
	})
	return found
}

// runningMember is pooledMember while serf runs it.
func (a *App) runningMember() *member {
	if m := a.pooledMember(); m.running() {
		return m
	}
	return nil
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
