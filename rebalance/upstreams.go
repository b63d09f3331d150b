package rebalance

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/jsonfield"
)

func init() {
	caddy.RegisterModule(SerfUpstreams{})
}

// Bounds of refresh, for dynamic serf and lb_policy cluster_load: a
// reading locks serf's member list, so not on every request, and a list
// an hour old is no longer the cluster.
const (
	minRefresh = 10 * time.Millisecond
	maxRefresh = time.Hour
)

// DefaultUpstreamsRefresh is how often SerfUpstreams re-reads the member
// list by default.
const DefaultUpstreamsRefresh = time.Second

// SerfUpstreams is a dynamic upstream source for reverse_proxy: the alive
// members of this node's rebalance cluster whose serf tags match Tags.
// Each member's dial address is its advertised IP with the port from its
// tag PortTag, or Port.
//
// Serf keeps the member list current (a member that leaves is gone at
// once; one that crashes once serf marks it failed, within seconds). The
// source re-reads it at most every Refresh, on a request, and rebuilds
// its list only when the set of addresses changed; the list is sorted,
// so selection policies see the same pool in the same order between
// changes. Each change is logged once.
//
// It needs the rebalance app in the same config (the `rebalance` global
// option); without it the config does not load.
type SerfUpstreams struct {
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

	// Refresh is the longest time between two readings of the member
	// list, from 10ms to 1h. Default: 1s.
	Refresh caddy.Duration `json:"refresh,omitempty"`

	app     *App
	refresh time.Duration
	logger  *zap.Logger
	*upstreamsState
}

// upstreamsState is a SerfUpstreams' cache (behind a pointer: the module
// value is copied by CaddyModule).
type upstreamsState struct {
	mu      sync.Mutex // held by the request that refreshes
	skipped string     // the last skipped-members message logged (under mu)
	lastErr string     // the last error logged (under mu)
	builds  atomic.Int64
	stale   atomic.Bool
	snap    atomic.Pointer[upstreamSnapshot]
}

// upstreamSnapshot is one reading of the member list.
type upstreamSnapshot struct {
	at    time.Time
	dials []string // sorted; shared by snapshots until the set changes
	err   error
}

// CaddyModule returns the Caddy module information.
func (SerfUpstreams) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.upstreams.serf",
		New: func() caddy.Module { return new(SerfUpstreams) },
	}
}

// Provision finds the rebalance app of the config. It does not read the
// member list: the app's serf member starts after every module is
// provisioned.
func (su *SerfUpstreams) Provision(ctx caddy.Context) error {
	su.logger = ctx.Logger()
	su.upstreamsState = new(upstreamsState)
	su.refresh = time.Duration(su.Refresh)
	if su.refresh == 0 {
		su.refresh = DefaultUpstreamsRefresh
	}
	if err := su.Validate(); err != nil {
		return err
	}
	app, err := ctx.AppIfConfigured("rebalance")
	if err != nil {
		if errors.Is(err, caddy.ErrNotConfigured) {
			return errors.New("dynamic serf: no rebalance app in this config; its upstreams are members of this node's rebalance cluster, so add the `rebalance` global option (or the \"rebalance\" app in JSON)")
		}
		return fmt.Errorf("dynamic serf: %v", err)
	}
	su.app = app.(*App)
	return nil
}

// Validate checks the configuration.
func (su *SerfUpstreams) Validate() error {
	if su.Port == "" && su.PortTag == "" {
		return errors.New("dynamic serf: give a port or a port_tag (the member tag that holds the port to dial)")
	}
	if su.Port != "" {
		if _, err := ParsePort(su.Port); err != nil {
			return fmt.Errorf("dynamic serf: %v", err)
		}
	}
	if err := checkDuration("refresh", su.Refresh, minRefresh, maxRefresh); err != nil {
		return fmt.Errorf("dynamic serf: %v", err)
	}
	for k, v := range su.Tags {
		if k == "" || v == "" {
			return fmt.Errorf("dynamic serf: tag %q=%q: key and value must not be empty", k, v)
		}
	}
	return nil
}

// GetUpstreams returns the matching members as upstreams. The list is
// read from the last snapshot; one request refreshes it when it is older
// than Refresh while the others keep using it. The Upstream values are new
// on every call, as with Caddy's own dynamic sources: reverse_proxy writes
// into them per request (their Host, circuit breaker, health policy), so
// they cannot be shared between concurrent requests; Caddy keeps their
// health state per dial address.
func (su *SerfUpstreams) GetUpstreams(*http.Request) ([]*reverseproxy.Upstream, error) {
	s := su.snap.Load()
	if s == nil || su.stale.Load() || time.Since(s.at) >= su.refresh {
		if s == nil {
			su.mu.Lock()
			s = su.refreshLocked()
			su.mu.Unlock()
		} else if su.mu.TryLock() {
			s = su.refreshLocked()
			su.mu.Unlock()
		}
	}
	if s.err != nil {
		return nil, s.err
	}
	vals := make([]reverseproxy.Upstream, len(s.dials))
	ups := make([]*reverseproxy.Upstream, len(s.dials))
	for i, d := range s.dials {
		vals[i].Dial = d
		ups[i] = &vals[i]
	}
	return ups, nil
}

// ResetCache makes the next request re-read the member list (reverse_proxy
// calls it before a retry): a member serf has seen fail is then gone.
func (su *SerfUpstreams) ResetCache(*http.Request) error {
	su.stale.Store(true)
	return nil
}

// refreshLocked reads the member list and stores a new snapshot; su.mu is
// held.
func (su *SerfUpstreams) refreshLocked() *upstreamSnapshot {
	now := time.Now()
	prev := su.snap.Load()
	if prev != nil && !su.stale.Load() && now.Sub(prev.at) < su.refresh {
		return prev // another request refreshed it meanwhile
	}
	su.stale.Store(false)

	members, err := su.app.Members()
	if err != nil {
		msg := "dynamic serf: " + err.Error()
		if msg != su.lastErr {
			su.logger.Error("cannot list cluster members", zap.Error(err))
			su.lastErr = msg
		}
		// Keep the last good list, if there is one.
		s := &upstreamSnapshot{at: now, err: errors.New(msg)}
		if prev != nil && prev.err == nil {
			s = &upstreamSnapshot{at: now, dials: prev.dials}
		}
		su.snap.Store(s)
		return s
	}
	if su.lastErr != "" {
		su.logger.Info("cluster members readable again")
		su.lastErr = ""
	}

	dials, skipped := su.build(members)
	if len(skipped) > 0 {
		msg := strings.Join(skipped, "; ")
		if msg != su.skipped {
			su.logger.Warn("members left out of the upstreams", zap.Strings("reasons", skipped))
		}
		su.skipped = msg
	} else {
		su.skipped = ""
	}

	if prev != nil && prev.err == nil && slices.Equal(prev.dials, dials) {
		dials = prev.dials // unchanged: keep the same list
	} else {
		su.builds.Add(1)
		var old []string
		if prev != nil {
			old = prev.dials
		}
		added, removed := diffSorted(old, dials)
		su.logger.Info("serf upstreams changed",
			zap.Int("upstreams", len(dials)), zap.Strings("added", added), zap.Strings("removed", removed))
	}
	s := &upstreamSnapshot{at: now, dials: dials}
	su.snap.Store(s)
	return s
}

// build returns the sorted, deduplicated dial addresses of the alive
// members that match, and why the others that match were left out.
func (su *SerfUpstreams) build(members []Member) (dials, skipped []string) {
	for _, m := range members {
		if m.Status != StatusAlive || !m.HasTags(su.Tags) || (su.ExcludeSelf && m.Self) {
			continue
		}
		addr, err := m.DialAddr(su.Port, su.PortTag)
		if err != nil {
			skipped = append(skipped, err.Error())
			continue
		}
		dials = append(dials, addr)
	}
	sort.Strings(dials)
	return slices.Compact(dials), skipped
}

// diffSorted returns what b has that a has not, and the reverse; both
// sorted.
func diffSorted(a, b []string) (added, removed []string) {
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i] < b[j]):
			removed = append(removed, a[i])
			i++
		case i == len(a) || b[j] < a[i]:
			added = append(added, b[j])
			j++
		default:
			i++
			j++
		}
	}
	return added, removed
}

// UnmarshalCaddyfile sets up the source from Caddyfile tokens. Syntax:
//
//	dynamic serf [<port>] {
//		tag          <key> <value>
//		port         <port>
//		port_tag     <tag key>
//		exclude_self
//		refresh      <duration>
//	}
//
// `tag` may be repeated (a member must carry every one); the other options
// may appear once. The port may be given on the first line or in the
// block, not both.
func (su *SerfUpstreams) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the source's name
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		su.Port = args[0]
	default:
		return d.Errf("dynamic serf: at most one argument (the port), got %d", len(args))
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if opt != "tag" && seen[opt] {
			return d.Errf("dynamic serf: %s already specified", opt)
		}
		seen[opt] = true
		switch opt {
		case "tag":
			kv := d.RemainingArgs()
			if len(kv) != 2 {
				return d.Errf("dynamic serf: tag: want <key> <value>, got %d argument(s)", len(kv))
			}
			if su.Tags == nil {
				su.Tags = make(map[string]string)
			}
			if _, dup := su.Tags[kv[0]]; dup {
				return d.Errf("dynamic serf: tag %q already specified", kv[0])
			}
			su.Tags[kv[0]] = kv[1]
		case "port":
			if su.Port != "" {
				return d.Errf("dynamic serf: port already specified")
			}
			if !d.NextArg() {
				return d.ArgErr()
			}
			su.Port = d.Val()
			if _, err := ParsePort(su.Port); err != nil {
				return d.Errf("dynamic serf: %v", err)
			}
			if d.NextArg() {
				return d.ArgErr()
			}
		case "port_tag":
			if !d.NextArg() {
				return d.ArgErr()
			}
			su.PortTag = d.Val()
			if d.NextArg() {
				return d.ArgErr()
			}
		case "exclude_self":
			if d.NextArg() {
				return d.ArgErr()
			}
			su.ExcludeSelf = true
		case "refresh":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil || dur <= 0 {
				return d.Errf("dynamic serf: refresh %q: want a positive duration", d.Val())
			}
			su.Refresh = caddy.Duration(dur)
			if err := checkDuration("refresh", su.Refresh, minRefresh, maxRefresh); err != nil {
				return d.Errf("dynamic serf: %v", err)
			}
			if d.NextArg() {
				return d.ArgErr()
			}
		default:
			return d.Errf("dynamic serf: unknown option %q", opt)
		}
	}
	if err := su.Validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// UnmarshalJSON decodes the source's JSON as Caddy does, naming the
// field of a value that does not decode.
func (su *SerfUpstreams) UnmarshalJSON(b []byte) error {
	type serfUpstreamsJSON SerfUpstreams
	return jsonfield.Decode(b, (*serfUpstreamsJSON)(su))
}

// Interface guards
var (
	_ reverseproxy.UpstreamSource        = (*SerfUpstreams)(nil)
	_ reverseproxy.CachingUpstreamSource = (*SerfUpstreams)(nil)
	_ caddy.Provisioner                  = (*SerfUpstreams)(nil)
	_ caddy.Validator                    = (*SerfUpstreams)(nil)
	_ caddyfile.Unmarshaler              = (*SerfUpstreams)(nil)
	_ json.Unmarshaler                   = (*SerfUpstreams)(nil)
)
