package lbpolicy

import (
	"errors"
	"fmt"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// errNoProxyHandler is returned by install when the module being provisioned
// is not inside a reverse_proxy handler.
var errNoProxyHandler = errors.New("not provisioned inside a reverse_proxy handler")

// install puts an observingTransport around the transport of the
// reverse_proxy handler that is provisioning the calling module, so that
// every attempt that handler makes feeds table. It is how
// `lb_policy least_time` works with no other configuration.
//
// It must be called from the Provision of a module loaded by
// reverseproxy.Handler.Provision (a selection policy): Caddy loads the
// configured transport before the selection policy, so it can be wrapped in
// place, and only installs its default transport after, when none is set —
// so when no transport is configured install provisions that same default
// (an empty HTTPTransport, exactly as reverse_proxy would) and wraps it.
// The handler then sees a transport that implements every optional
// interface the inner one does, with neutral answers otherwise.
//
// Responses' load reports are taken in as reports says (see LoadReports).
//
// With a non-nil outlier, every attempt also feeds outlier ejection, and a
// goroutine applies its interval rules (success rate, failure percentage)
// to table until ctx is done. When the handler also has active health
// checks, probes that pass end an ejection early.
//
// install returns the handler it instrumented.
func install(ctx caddy.Context, table *hoststate.Table, outlier *Outlier, reports *LoadReports) (*reverseproxy.Handler, error) {
	h := parentProxy(ctx)
	if h == nil {
		return nil, errNoProxyHandler
	}
	if ot, ok := h.Transport.(*observingTransport); ok {
		// Two of our modules in one handler (the panic wrapper around
		// least_time): they must share one table, the first one installed.
		if ot.table != table {
			return h, fmt.Errorf("reverse_proxy transport is already observed by another lbx module")
		}
		return h, nil
	}
	wrapper := &observingTransport{inner: h.Transport, table: table, outlier: outlier, reports: reports}
	if outlier != nil && !outlier.KeepEjectedOnHealthCheck && h.HealthChecks != nil {
		probe, err := newProbeRule(h.HealthChecks.Active)
		if err != nil {
			return nil, err
		}
		wrapper.probe = probe
	}
	if h.Transport == nil {
		def := new(reverseproxy.HTTPTransport)
		if err := def.Provision(ctx); err != nil {
			return nil, fmt.Errorf("provisioning default transport: %v", err)
		}
		wrapper.inner, wrapper.owned = def, def
	}
	h.Transport = wrapper
	// Take table's references on the static upstreams now rather than on
	// first use: Caddy starts a new config before it stops the old one,
	// but the new config need not serve a request in between, and state
	// only the old config referenced would be released with it — a reload
	// would forget every estimate.
	for _, u := range h.Upstreams {
		if u != nil && u.Dial != "" {
			table.Stats(u.Dial)
		}
	}
	if outlier != nil {
		// Success-rate and failure-percentage ejection: one loop per
		// handler, ended with the config (its context is cancelled when
		// it is unloaded or fails to provision).
		outlier.startSweeping(table, ctx.Done())
	}
	return h, nil
}

// parentProxy returns the nearest reverse_proxy handler among the modules
// currently being provisioned, or nil.
func parentProxy(ctx caddy.Context) *reverseproxy.Handler {
	mods := ctx.Modules()
	for i := len(mods) - 1; i >= 0; i-- {
		if h, ok := mods[i].(*reverseproxy.Handler); ok {
			return h
		}
	}
	return nil
}

// observeTraffic is install for a policy that serves without it too: when
// the policy is not inside a reverse_proxy handler, it logs unobserved
// (which names the policy and what it goes without) and returns nils;
// else the instrumented handler and its observing transport.
func observeTraffic(ctx caddy.Context, table *hoststate.Table, outlier *Outlier, reports *LoadReports, unobserved string) (*reverseproxy.Handler, *observingTransport, error) {
	h, err := install(ctx, table, outlier, reports)
	switch {
	case errors.Is(err, errNoProxyHandler):
		ctx.Logger().Warn(unobserved)
		return nil, nil, nil
	case err != nil:
		return nil, nil, err
	}
	observer, _ := h.Transport.(*observingTransport)
	return h, observer, nil
}
