package cluster

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// The dial policy: every address a member advertises goes through it in
// Selector.Select before any module dials it. A member chooses its own
// IP (what it advertises) and, through a port tag, the port: without the
// policy a member could have this node proxy public requests to Caddy's
// admin endpoint, which accepts a request whose Host header names it.

// refusal is why the policy refused a member's dial address; its name is
// the reason label of caddy_lbx_cluster_members_refused_total.
type refusal int

// Reasons for refusing a member's dial address.
const (
	refusedAdmin refusal = iota
	refusedOwnListener
	refusedLoopback
	refusedLinkLocal
	refusedUnspecified
	refusedMulticast
	refusedBroadcast
	refusedNetwork
	refusedPort
	refusedName
	numRefusals
)

var refusalNames = [numRefusals]string{
	refusedAdmin:       "admin_endpoint",
	refusedOwnListener: "own_listener",
	refusedLoopback:    "loopback",
	refusedLinkLocal:   "link_local",
	refusedUnspecified: "unspecified",
	refusedMulticast:   "multicast",
	refusedBroadcast:   "broadcast",
	refusedNetwork:     "network_not_allowed",
	refusedPort:        "port_not_allowed",
	refusedName:        "bad_name",
}

var refusalWhy = [numRefusals]string{
	refusedAdmin:       "it is this node's admin endpoint",
	refusedOwnListener: "it is one of this node's own listeners (a loop)",
	refusedLoopback:    "a loopback address, refused unless the cluster is bound to loopback",
	refusedLinkLocal:   "a link-local address",
	refusedUnspecified: "an unspecified address",
	refusedMulticast:   "a multicast address",
	refusedBroadcast:   "the broadcast address",
	refusedNetwork:     "not in the selector's allow_networks",
	refusedPort:        "its port is not in the selector's allow_ports",
	refusedName:        "the member's name is not printable UTF-8 of at most 128 bytes",
}

func (r refusal) String() string { return refusalNames[r] }

// refusedCounts counts refusals by reason, at most one per member, dial
// address and reason per refusalQuiet (see member.noteRefused).
var refusedCounts [numRefusals]atomic.Int64

// CheckAllowNetworks checks allow_networks: CIDRs (10.0.0.0/8,
// fd00::/8) or single IPs.
func CheckAllowNetworks(nets []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(nets))
	for _, s := range nets {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return nil, fmt.Errorf("allow_networks %q: want a CIDR such as 10.0.0.0/8 or an IP", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// portRange is an inclusive range of ports.
type portRange struct{ lo, hi int }

// CheckAllowPorts checks allow_ports: ports (8080) or inclusive ranges
// (8000-8099), each from 1 to 65535.
func CheckAllowPorts(ports []string) ([]portRange, error) {
	out := make([]portRange, 0, len(ports))
	for _, s := range ports {
		lo, hi, isRange := strings.Cut(s, "-")
		a, err := ParsePort(lo)
		b := a
		if err == nil && isRange {
			b, err = ParsePort(hi)
		}
		if err != nil || b < a {
			return nil, fmt.Errorf("allow_ports %q: want a port or a range lo-hi, from 1 to 65535", s)
		}
		out = append(out, portRange{a, b})
	}
	return out, nil
}

// goodName reports whether a member's name is one lbx stores and shows:
// at most maxNodeName bytes (the bound of this node's own node_name),
// valid UTF-8, printable.
func goodName(name string) bool {
	if len(name) > maxNodeName || !utf8.ValidString(name) {
		return false
	}
	for _, r := range name {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// shownName is a member's name as views and logs show it: valid UTF-8,
// cut to maxNodeName bytes with "…" when longer.
func shownName(name string) string {
	return boundText(name, maxNodeName)
}

// boundText returns s as valid UTF-8 of at most n bytes (plus "…" when
// cut).
func boundText(s string, n int) string {
	if len(s) <= n && utf8.ValidString(s) {
		return s
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// check returns whether the policy refuses dialing the member at ip:port,
// and why. loopbackCluster: the cluster is bound to loopback, so its
// members are local processes and loopback addresses are allowed.
func (s *Selector) check(m Member, ip netip.Addr, port int, loopbackCluster bool) (refusal, bool) {
	if !goodName(m.Name) {
		return refusedName, true
	}
	ip = ip.Unmap()
	switch {
	case ip.IsUnspecified():
		return refusedUnspecified, true
	case ip.IsLinkLocalUnicast(), ip.IsLinkLocalMulticast():
		return refusedLinkLocal, true
	case ip.IsMulticast():
		return refusedMulticast, true
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return refusedBroadcast, true
	case ip.IsLoopback() && !loopbackCluster:
		return refusedLoopback, true
	}
	if isAdminAddr(ip, port) {
		return refusedAdmin, true
	}
	if !m.Self && isOwnListener(ip, port) {
		return refusedOwnListener, true
	}
	if len(s.allowNets) > 0 {
		in := false
		for _, p := range s.allowNets {
			if p.Contains(ip) {
				in = true
				break
			}
		}
		if !in {
			return refusedNetwork, true
		}
	}
	if len(s.allowPorts) > 0 {
		in := false
		for _, r := range s.allowPorts {
			if port >= r.lo && port <= r.hi {
				in = true
				break
			}
		}
		if !in {
			return refusedPort, true
		}
	}
	return 0, false
}

// isAdminAddr reports whether ip:port is Caddy's admin endpoint at its
// default address (caddy.DefaultAdminListen: localhost:2019, or the
// CADDY_ADMIN environment variable). Caddy does not export the address a
// config sets (admin.listen); that one is one of Caddy's own listeners,
// which isOwnListener finds for every member but this node itself.
func isAdminAddr(ip netip.Addr, port int) bool {
	network, host, p, err := caddy.SplitNetworkAddress(caddy.DefaultAdminListen)
	if err != nil || (network != "" && !strings.HasPrefix(network, "tcp")) || p != strconv.Itoa(port) {
		return false
	}
	switch host {
	case "", "0.0.0.0", "::":
		return isLocalIP(ip)
	case "localhost":
		return ip.IsLoopback()
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap() == ip
}

// isOwnListener reports whether ip:port reaches one of Caddy's listeners
// in this process (its sites, its admin endpoint, a metrics server):
// whether ip is an address of this host and Caddy's listener pool holds
// a TCP listener there, or on the wildcard address at that port. Only
// listeners Caddy opened through its listener pool are seen (not a
// plugin's own net.Listen, nor serf's gossip port); see allow_ports for
// pinning the ports down.
func isOwnListener(ip netip.Addr, port int) bool {
	if !isLocalIP(ip) {
		return false
	}
	ps := strconv.Itoa(port)
	hosts := []string{net.JoinHostPort(ip.String(), ps), ":" + ps, "0.0.0.0:" + ps, "[::]:" + ps}
	if ip.IsLoopback() {
		hosts = append(hosts, "localhost:"+ps, "127.0.0.1:"+ps, "[::1]:"+ps)
	}
	for _, network := range [...]string{"tcp", "tcp4", "tcp6"} {
		for _, h := range hosts {
			if caddy.ListenerUsage(network, h) > 0 {
				return true
			}
		}
	}
	return false
}

// localIPs caches this host's interface addresses: looked up only for a
// member whose IP might be one, at most once per localIPsTTL.
var localIPs struct {
	mu   sync.Mutex
	at   time.Time
	addr map[netip.Addr]bool
}

const localIPsTTL = time.Second

// isLocalIP reports whether ip is loopback or an address of one of this
// host's interfaces.
func isLocalIP(ip netip.Addr) bool {
	if ip.IsLoopback() {
		return true
	}
	localIPs.mu.Lock()
	defer localIPs.mu.Unlock()
	if now := time.Now(); localIPs.addr == nil || now.Sub(localIPs.at) >= localIPsTTL {
		m := make(map[netip.Addr]bool)
		if addrs, err := net.InterfaceAddrs(); err == nil {
			for _, a := range addrs {
				if n, ok := a.(*net.IPNet); ok {
					if x, ok := netip.AddrFromSlice(n.IP); ok {
						m[x.Unmap()] = true
					}
				}
			}
		}
		localIPs.addr, localIPs.at = m, now
	}
	return localIPs.addr[ip]
}

// isLoopbackHost reports whether a bind host is loopback: only local
// processes reach a port bound there.
func isLoopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}

// refusalQuiet is how long a refusal of the same member, address and
// reason stays quiet (not logged or counted again) and shown in the
// admin view after it was last seen.
const refusalQuiet = time.Minute

// maxRefusals bounds the refusals a member remembers for its view (a
// member churning its port makes a new one each time).
const maxRefusals = 1024

// refusalKey identifies a refusal.
type refusalKey struct {
	name, dial string
	reason     refusal
}

// refusalState is when a refusal was last seen and last logged.
type refusalState struct {
	seen, logged time.Time
}

// refusals is what a member's policy refused lately, for the admin view.
type refusals struct {
	mu sync.Mutex
	m  map[refusalKey]*refusalState
}

// note records a refusal seen now; the first time, and again once it
// was quiet for refusalQuiet, it is counted and logged.
func (rs *refusals) note(logger *zap.Logger, k refusalKey, now time.Time) {
	rs.mu.Lock()
	if rs.m == nil {
		rs.m = make(map[refusalKey]*refusalState)
	}
	st := rs.m[k]
	if st == nil {
		if len(rs.m) >= maxRefusals {
			for key, old := range rs.m {
				if now.Sub(old.seen) >= refusalQuiet {
					delete(rs.m, key)
				}
			}
		}
		if len(rs.m) >= maxRefusals {
			rs.mu.Unlock()
			refusedCounts[k.reason].Add(1) // counted, not remembered
			return
		}
		st = &refusalState{}
		rs.m[k] = st
	}
	st.seen = now
	fresh := now.Sub(st.logged) >= refusalQuiet
	if fresh {
		st.logged = now
	}
	rs.mu.Unlock()
	if fresh {
		refusedCounts[k.reason].Add(1)
		if logger != nil {
			logger.Warn("member's dial address refused by the dial policy",
				zap.String("member", shownName(k.name)), zap.String("dial", k.dial),
				zap.String("reason", k.reason.String()), zap.String("why", refusalWhy[k.reason]))
		}
	}
}

// refusedView is a refusal in the admin view.
type refusedView struct {
	Dial   string `json:"dial"`
	Reason string `json:"reason"`
	Why    string `json:"why"`
}

// byMember returns the refusals seen within refusalQuiet, by member
// name.
func (rs *refusals) byMember(now time.Time) map[string][]refusedView {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := make(map[string][]refusedView)
	for k, st := range rs.m {
		if now.Sub(st.seen) >= refusalQuiet {
			delete(rs.m, k)
			continue
		}
		out[k.name] = append(out[k.name], refusedView{Dial: k.dial, Reason: k.reason.String(), Why: refusalWhy[k.reason]})
	}
	return out
}
