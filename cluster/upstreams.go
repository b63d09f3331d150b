package cluster

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

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
)

func init() {
	caddy.RegisterModule(SerfUpstreams{})
}

// Bounds of refresh, for every module that caches what it reads from the
// member list (dynamic serf, lb_policy cluster_load): a reading locks
// serf's member list, so not on every request, and a list an hour old is
// no longer the cluster.
const (
	minRefresh = 10 * time.Millisecond
	maxRefresh = time.Hour
)

// CheckRefresh checks a refresh option: 0 (the default) or from
// minRefresh to maxRefresh.
func CheckRefresh(refresh caddy.Duration) error {
	if refresh == 0 {
		return nil
	}
	return bounds.Duration("refresh", time.Duration(refresh), minRefresh, maxRefresh)
}

// defaultUpstreamsRefresh is how often SerfUpstreams re-reads the member
// list by default.
const defaultUpstreamsRefresh = time.Second

// SerfUpstreams is a dynamic upstream source for reverse_proxy: the alive
// members of this node's cluster whose serf tags match `tags`.
// Each member's dial address is its advertised IP with the port from the
// tag `port_tag` names, or `port`.
//
// Serf keeps the member list current (a member that leaves is gone at
// once; one that crashes once serf marks it failed, within seconds). The
// source re-reads it at most every `refresh`, on a request, and rebuilds
// its list only when the set of addresses changed; the list is sorted,
// so selection policies see the same pool in the same order between
// changes. Each change is logged once.
//
// It needs the cluster app in the same config (the `cluster` global
// option); without it the config does not load.
type SerfUpstreams struct {
	// The member selection, inlined in this module's JSON: `tags`,
	// `port`, `port_tag`, `exclude_self`, `allow_networks` and
	// `allow_ports` pick the members, and the dial policy applies.
	Selector

	// The longest time between two readings of the member
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

// Provision finds the cluster app of the config. It does not read the
// member list: the app's serf member starts after every module is
// provisioned.
func (su *SerfUpstreams) Provision(ctx caddy.Context) error {
	su.logger = ctx.Logger()
	su.upstreamsState = new(upstreamsState)
	su.refresh = time.Duration(su.Refresh)
	if su.refresh == 0 {
		su.refresh = defaultUpstreamsRefresh
	}
	if err := su.Validate(); err != nil {
		return err
	}
	app, err := Lookup(ctx, "dynamic serf")
	if err != nil {
		return err
	}
	su.app = app
	return su.Selector.Use(app)
}

// Validate checks the configuration.
func (su *SerfUpstreams) Validate() error {
	if err := su.Selector.Validate(); err != nil {
		return fmt.Errorf("dynamic serf: %v", err)
	}
	if err := CheckRefresh(su.Refresh); err != nil {
		return fmt.Errorf("dynamic serf: %v", err)
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
	picked, skipped := su.Select(members, nil)
	for _, p := range picked {
		dials = append(dials, p.Dial)
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
//		allow_networks <cidr|ip>...
//		allow_ports    <port|lo-hi>...
//		refresh      <duration>
//	}
//
// `tag` may be repeated (a member must carry every one); the other options
// may appear once. The port may be given on the first line or in the
// block, not both.
func (su *SerfUpstreams) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const what = "dynamic serf"
	once := caddyopt.NewOnce(what)
	d.Next() // the source's name
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		su.Port = args[0]
		once.Mark("port")
	default:
		return caddyopt.Errf(d, what, "at most one argument (the port), got %d", len(args))
	}
	for d.NextBlock(0) {
		if ok, err := su.UnmarshalOption(d, what, once); ok {
			if err != nil {
				return err
			}
			continue
		}
		if d.Val() != "refresh" {
			return caddyopt.Unknown(d, what, slices.Concat(SelectorOptions, []string{"refresh"})...)
		}
		if err := once.Check(d); err != nil {
			return err
		}
		dur, err := caddyopt.PositiveDuration(d, what)
		if err != nil {
			return err
		}
		su.Refresh = caddy.Duration(dur)
		if err := CheckRefresh(su.Refresh); err != nil {
			return caddyopt.Errf(d, what, "%v", err)
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
