package cluster

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

// Selector picks cluster members and the address to dial on each. It is
// the one member selection of every module that takes its upstreams from
// the cluster (`dynamic serf`, partition's `serf_tag`).
type Selector struct {
	// The tags the members must carry, all with these values (e.g.
	// {"role": "api"}). Default: none, every alive member.
	Tags map[string]string `json:"tags,omitempty"`

	// The port to dial on every member, unless its `port_tag` tag
	// gives one. One of `port` and `port_tag` is required.
	Port string `json:"port,omitempty"`

	// The member tag that holds the port to dial (e.g.
	// "http_port"); a member without it is dialed at `port`, or left out
	// (logged) when `port` is not set. Default: none.
	PortTag string `json:"port_tag,omitempty"`

	// Leave this node out even when its tags match.
	// Default: false.
	ExcludeSelf bool `json:"exclude_self,omitempty"`

	// When set, the only networks (CIDRs such as
	// 10.0.0.0/8, or single IPs) a member's advertised IP may be in to
	// be dialed; other members are refused (reason
	// network_not_allowed). Whatever it says, the dial policy also
	// refuses this node's admin endpoint and own listeners, and
	// loopback, link-local, unspecified, multicast and broadcast
	// addresses (loopback is allowed when the cluster binds loopback).
	// Default: none, every network.
	AllowNetworks []string `json:"allow_networks,omitempty"`

	// When set, the only ports (8080) or inclusive port
	// ranges (8000-8099) a member may be dialed at; other members are
	// refused (reason port_not_allowed). Default: none, every port.
	AllowPorts []string `json:"allow_ports,omitempty"`

	allowNets  []netip.Prefix
	allowPorts []portRange
	app        *App // for the loopback exemption and the refusals' view
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
	nets, err := CheckAllowNetworks(s.AllowNetworks)
	if err != nil {
		return err
	}
	ports, err := CheckAllowPorts(s.AllowPorts)
	if err != nil {
		return err
	}
	s.allowNets, s.allowPorts = nets, ports
	return nil
}

// Use validates the selector and ties it to the config's cluster app:
// Select then allows loopback members when the app binds loopback, and
// records what it refuses in the app member's admin view.
func (s *Selector) Use(app *App) error {
	if err := s.Validate(); err != nil {
		return err
	}
	s.app = app
	return nil
}

// Select returns the dial address of each alive member that matches, in
// the members' order, and why each other matching member was left out.
// keep, when not nil, also decides which members match. Every dial
// address goes through the dial policy (dialpolicy.go): a member it
// refuses is left out with the reason, counted, logged at most once a
// minute, and shown in the admin view of the app given to Use.
func (s *Selector) Select(members []Member, keep func(Member) bool) (picked []Picked, skipped []string) {
	var (
		rs       *refusals
		logger   *zap.Logger
		loopback bool
		now      time.Time
	)
	if s.app != nil {
		loopback = isLoopbackHost(s.app.bindHost)
		if m := s.app.pooledMember(); m != nil {
			rs, logger = &m.refused, m.logger
		}
	}
	for _, m := range members {
		if m.Status != StatusAlive || !m.HasTags(s.Tags) || (s.ExcludeSelf && m.Self) || (keep != nil && !keep(m)) {
			continue
		}
		addr, err := m.DialAddr(s.Port, s.PortTag)
		if err != nil && goodName(m.Name) {
			skipped = append(skipped, err.Error())
			continue
		}
		var ip netip.Addr
		var port int
		if err == nil {
			ap, perr := netip.ParseAddrPort(addr)
			if perr != nil {
				skipped = append(skipped, fmt.Sprintf("member %s: dial address %q: %v", m.Name, addr, perr))
				continue
			}
			ip, port = ap.Addr(), int(ap.Port())
		}
		why, refused := refusedName, !goodName(m.Name)
		if !refused {
			why, refused = s.check(m, ip, port, loopback)
		}
		if refused {
			skipped = append(skipped, fmt.Sprintf("member %s: dial address %s refused (%s): %s", shownName(m.Name), addr, why, refusalWhy[why]))
			if rs != nil {
				if now.IsZero() {
					now = time.Now()
				}
				rs.note(logger, refusalKey{name: m.Name, dial: addr, reason: why}, now)
			} else {
				refusedCounts[why].Add(1)
			}
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
var SelectorOptions = []string{"tag", "port", "port_tag", "exclude_self", "allow_networks", "allow_ports"}

// UnmarshalOption reads one selector option of a Caddyfile block, the
// dispenser on its name:
//
//	tag          <key> <value>
//	port         <port>
//	port_tag     <member tag>
//	exclude_self
//	allow_networks <cidr|ip>...
//	allow_ports    <port|lo-hi>...
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
	case "allow_networks", "allow_ports":
		opt := d.Val()
		if err := once.Check(d); err != nil {
			return true, err
		}
		vals, err := caddyopt.Args(d, what)
		if err != nil {
			return true, err
		}
		if opt == "allow_networks" {
			_, err = CheckAllowNetworks(vals)
			s.AllowNetworks = vals
		} else {
			_, err = CheckAllowPorts(vals)
			s.AllowPorts = vals
		}
		if err != nil {
			return true, caddyopt.Errf(d, what, "%v", err)
		}
	default:
		return false, nil
	}
	return true, nil
}
