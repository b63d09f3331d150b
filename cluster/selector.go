package cluster

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

// Selector picks cluster members and the address to dial on each. It is
// the one member selection of every module that takes its upstreams from
// the cluster (`dynamic serf`, partition's `serf_tag`).
type Selector struct {
	// Tags the members must carry, all with these values (e.g.
	// {"role": "api"}). Default: none, every alive member.
	Tags map[string]string `json:"tags,omitempty"`

	// Port is the port to dial on every member, unless its PortTag tag
	// gives one. One of Port and PortTag is required.
	Port string `json:"port,omitempty"`

	// PortTag names the member tag that holds the port to dial (e.g.
	// "http_port"); a member without it is dialed at Port, or left out
	// (logged) when Port is not set. Default: none.
	PortTag string `json:"port_tag,omitempty"`

	// ExcludeSelf leaves this node out even when its tags match.
	// Default: false.
	ExcludeSelf bool `json:"exclude_self,omitempty"`
}

// Validate checks the selector.
func (s *Selector) Validate() error {
	if s.Port == "" && s.PortTag == "" {
		return errors.New("give a port or a port_tag (the member tag that holds the port to dial)")
	}
	if s.Port != "" {
		if _, err := ParsePort(s.Port); err != nil {
			return err
		}
	}
	for k, v := range s.Tags {
		if k == "" || v == "" {
			return fmt.Errorf("tag %q=%q: key and value must not be empty", k, v)
		}
	}
	return nil
}

// Select returns the dial address of each alive member that matches, in
// the members' order, and why each other matching member was left out.
// keep, when not nil, also decides which members match.
func (s *Selector) Select(members []Member, keep func(Member) bool) (picked []Picked, skipped []string) {
	for _, m := range members {
		if m.Status != StatusAlive || !m.HasTags(s.Tags) || (s.ExcludeSelf && m.Self) || (keep != nil && !keep(m)) {
			continue
		}
		addr, err := m.DialAddr(s.Port, s.PortTag)
		if err != nil {
			skipped = append(skipped, err.Error())
			continue
		}
		picked = append(picked, Picked{Member: m, Dial: addr})
	}
	return picked, skipped
}

// Picked is a member a Selector picked, with the address to dial.
type Picked struct {
	Member
	Dial string
}

// SelectorOptions are the Caddyfile options UnmarshalOption reads.
var SelectorOptions = []string{"tag", "port", "port_tag", "exclude_self"}

// UnmarshalOption reads one selector option of a Caddyfile block, the
// dispenser on its name:
//
//	tag          <key> <value>
//	port         <port>
//	port_tag     <member tag>
//	exclude_self
//
// `tag` may be repeated with different keys (a member must carry every
// one); once, the caller's, rejects the others when repeated. It reports
// false, consuming nothing, when the option is not one of these. Errors
// start with what.
func (s *Selector) UnmarshalOption(d *caddyfile.Dispenser, what string, once *caddyopt.Once) (bool, error) {
	switch d.Val() {
	case "tag":
		kv := d.RemainingArgs()
		if len(kv) != 2 {
			return true, caddyopt.Errf(d, what, "tag: want <key> <value>, got %d argument(s)", len(kv))
		}
		if err := once.CheckName(d, "tag "+strconv.Quote(kv[0])); err != nil {
			return true, err
		}
		if s.Tags == nil {
			s.Tags = make(map[string]string)
		}
		s.Tags[kv[0]] = kv[1]
	case "port":
		if err := once.Check(d); err != nil {
			return true, err
		}
		val, err := caddyopt.OneArg(d, what)
		if err != nil {
			return true, err
		}
		if _, err := ParsePort(val); err != nil {
			return true, caddyopt.Errf(d, what, "%v", err)
		}
		s.Port = val
	case "port_tag":
		if err := once.Check(d); err != nil {
			return true, err
		}
		val, err := caddyopt.OneArg(d, what)
		if err != nil {
			return true, err
		}
		s.PortTag = val
	case "exclude_self":
		if err := once.Check(d); err != nil {
			return true, err
		}
		if err := caddyopt.NoArgs(d, what); err != nil {
			return true, err
		}
		s.ExcludeSelf = true
	default:
		return false, nil
	}
	return true, nil
}
