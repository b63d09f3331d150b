package lbpolicy

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/healthx"
	"github.com/caddy-lbx/lbx/internal/hoststate"
)

func init() {
	caddy.RegisterModule(new(PanicSelection))
}

// PanicSelection gives any selection policy panic mode. While at least
// Threshold percent of the upstreams are available, it simply delegates to
// the wrapped policy. Below that, too much of the pool looks down for the
// health checks to be believed (a busy day makes every probe time out;
// ejecting the whole pool would turn slowness into an outage), so the
// wrapped policy chooses among all upstreams that are not full, as if they
// were healthy. Entering and leaving panic mode is logged once each.
type PanicSelection struct {
	// Percentage of upstreams that must be available for health to be
	// respected. 0 disables panic mode. Default: 50.
	Threshold *float64 `json:"threshold,omitempty"`

	// The wrapped selection policy. Default: random (Caddy's default).
	PolicyRaw json.RawMessage `json:"selection_policy,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`

	inner     reverseproxy.Selector
	innerName string
	view      atomic.Pointer[poolView]
	panic     panicMode
}

// CaddyModule returns the Caddy module information.
func (*PanicSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.panic",
		New: func() caddy.Module { return new(PanicSelection) },
	}
}

// Provision loads the wrapped policy.
func (p *PanicSelection) Provision(ctx caddy.Context) error {
	p.inner, p.innerName = reverseproxy.RandomSelection{}, "random"
	if p.PolicyRaw != nil {
		mod, err := ctx.LoadModule(p, "PolicyRaw")
		if err != nil {
			return fmt.Errorf("loading wrapped selection policy: %v", err)
		}
		sel, ok := mod.(reverseproxy.Selector)
		if !ok {
			return fmt.Errorf("wrapped module %T is not a selection policy", mod)
		}
		p.inner = sel
		p.innerName = string(mod.(caddy.Module).CaddyModule().ID.Name())
	}
	p.panic = newPanicMode(p.Threshold, "panic("+p.innerName+")", ctx.Logger(), healthx.NewEmitter(ctx))
	if err := healthx.RegisterMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	hoststate.RegisterPool(p)
	return nil
}

// Validate checks the threshold.
func (p *PanicSelection) Validate() error {
	if p.Threshold != nil {
		if err := healthx.CheckPercent(*p.Threshold); err != nil {
			return fmt.Errorf("panic: threshold %v", err)
		}
	}
	return nil
}

// Cleanup unregisters the pool from the admin API.
func (p *PanicSelection) Cleanup() error {
	hoststate.UnregisterPool(p)
	return nil
}

// Select delegates to the wrapped policy, over health-blind twins of the
// upstreams when the pool is in panic mode.
func (p *PanicSelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	if len(pool) == 0 {
		return nil
	}
	v := p.viewFor(pool)
	if !p.panic.check(v, pool, hoststate.Now()) {
		return p.inner.Select(pool, r, w)
	}
	picked := p.inner.Select(v.shadows, r, w)
	if picked == nil {
		return nil
	}
	if i, ok := v.shadowOf[picked]; ok {
		return pool[i]
	}
	return picked
}

// viewFor returns the view of pool, building the twins the wrapped policy
// sees in panic mode: same dial address, same Caddy host record (so
// requests in flight are counted as usual), same max_requests, but no health
// state, so Available() reports only whether they are full.
func (p *PanicSelection) viewFor(pool reverseproxy.UpstreamPool) *poolView {
	if v := p.view.Load(); v.matches(pool) {
		return v
	}
	v := newView(pool)
	v.shadows = make([]*reverseproxy.Upstream, len(pool))
	v.shadowOf = make(map[*reverseproxy.Upstream]int, len(pool))
	for i, u := range pool {
		twin := &reverseproxy.Upstream{Host: u.Host, Dial: u.Dial, MaxRequests: u.MaxRequests}
		v.shadows[i] = twin
		v.shadowOf[twin] = i
	}
	p.view.Store(v)
	return v
}

// ReportPool implements hoststate.PoolReporter.
func (p *PanicSelection) ReportPool() (hoststate.PoolReport, bool) {
	v := p.view.Load()
	if v == nil {
		return hoststate.PoolReport{}, false
	}
	rep := hoststate.PoolReport{
		Policy:         "panic(" + p.innerName + ")",
		Available:      v.availableNow(),
		PanicThreshold: p.panic.percent(),
		Panic:          p.panic.on.Load(),
		PanicEntered:   p.panic.entered.Load(),
	}
	for _, u := range v.ups {
		rep.Upstreams = append(rep.Upstreams, hoststate.PoolMember{Dial: u.Dial, Weight: 1, Available: u.Available()})
	}
	return rep, true
}

// Interface guards
var (
	_ reverseproxy.Selector  = (*PanicSelection)(nil)
	_ caddy.Provisioner      = (*PanicSelection)(nil)
	_ caddy.Validator        = (*PanicSelection)(nil)
	_ caddy.CleanerUpper     = (*PanicSelection)(nil)
	_ hoststate.PoolReporter = (*PanicSelection)(nil)
)
