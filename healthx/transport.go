// Package healthx observes every attempt reverse_proxy makes to an upstream
// and turns it into shared per-upstream state (latency estimate, outcome
// counters) that lbx's selection policies read, and shows that state through
// Caddy's admin API.
package healthx

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// ObservingTransport wraps the transport of a reverse_proxy handler and
// records, for every proxied attempt, the time to response headers and
// whether the upstream answered. It changes nothing about the round trip
// itself: every optional interface reverse_proxy looks for is forwarded to
// the wrapped transport, so TLS, h2c, PROXY protocol, buffering and header
// operations behave exactly as they would without it.
//
// Active health-check requests also go through the transport; they carry no
// request vars (only real client requests do), which is how they are kept
// out of the statistics.
type ObservingTransport struct {
	inner   http.RoundTripper
	table   *hoststate.Table
	outlier *Outlier // nil: no outlier ejection
	// owned is a transport this package created in place of reverse_proxy's
	// default one; it is cleaned up with the wrapper.
	owned caddy.CleanerUpper
}

// Inner returns the wrapped transport.
func (t *ObservingTransport) Inner() http.RoundTripper { return t.inner }

// RoundTrip implements http.RoundTripper.
func (t *ObservingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	di, ok := reverseproxy.GetDialInfo(ctx)
	if !ok || di.Upstream == nil || ctx.Value(caddyhttp.VarsCtxKey) == nil {
		return t.inner.RoundTrip(req)
	}
	s := t.table.Stats(di.Upstream.Dial)
	s.SetHost(di.Upstream.Host)
	start := s.Begin()
	resp, err := t.inner.RoundTrip(req)
	outcome := classify(ctx, err)
	t.table.Observe(s, start, outcome)
	if t.outlier != nil && outcome != hoststate.Abandoned {
		failed := outcome == hoststate.Failure || t.outlier.failedStatus(resp.StatusCode)
		t.outlier.judge(t.table, s, di.Upstream.Dial, failed)
	}
	return resp, err
}

// classify tells a dead or slow upstream from a client that went away.
func classify(ctx context.Context, err error) hoststate.Outcome {
	switch {
	case err == nil:
		return hoststate.Success
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), context.Canceled):
		return hoststate.Abandoned
	default:
		return hoststate.Failure
	}
}

// TLSEnabled implements reverseproxy.TLSTransport.
func (t *ObservingTransport) TLSEnabled() bool {
	if tt, ok := t.inner.(reverseproxy.TLSTransport); ok {
		return tt.TLSEnabled()
	}
	return false
}

// EnableTLS implements reverseproxy.TLSTransport.
func (t *ObservingTransport) EnableTLS(base *reverseproxy.TLSConfig) error {
	if tt, ok := t.inner.(reverseproxy.TLSTransport); ok {
		return tt.EnableTLS(base)
	}
	return fmt.Errorf("transport %T does not support TLS", t.inner)
}

// EnableH2C implements reverseproxy.H2CTransport.
func (t *ObservingTransport) EnableH2C() error {
	if ht, ok := t.inner.(reverseproxy.H2CTransport); ok {
		return ht.EnableH2C()
	}
	return fmt.Errorf("transport %T does not support h2c", t.inner)
}

// ProxyProtocolEnabled implements reverseproxy.ProxyProtocolTransport.
func (t *ObservingTransport) ProxyProtocolEnabled() bool {
	if pt, ok := t.inner.(reverseproxy.ProxyProtocolTransport); ok {
		return pt.ProxyProtocolEnabled()
	}
	return false
}

// OverrideHealthCheckScheme implements
// reverseproxy.HealthCheckSchemeOverriderTransport.
func (t *ObservingTransport) OverrideHealthCheckScheme(base *url.URL, port string) {
	if ht, ok := t.inner.(reverseproxy.HealthCheckSchemeOverriderTransport); ok {
		ht.OverrideHealthCheckScheme(base, port)
	}
}

// DefaultBufferSizes implements reverseproxy.BufferedTransport.
func (t *ObservingTransport) DefaultBufferSizes() (int64, int64) {
	if bt, ok := t.inner.(reverseproxy.BufferedTransport); ok {
		return bt.DefaultBufferSizes()
	}
	return 0, 0
}

// RequiresContentLength implements reverseproxy.ContentLengthRequiredTransport.
func (t *ObservingTransport) RequiresContentLength() bool {
	if ct, ok := t.inner.(reverseproxy.ContentLengthRequiredTransport); ok {
		return ct.RequiresContentLength()
	}
	return false
}

// RequestHeaderOps implements reverseproxy.RequestHeaderOpsTransport.
func (t *ObservingTransport) RequestHeaderOps() *headers.HeaderOps {
	if ht, ok := t.inner.(reverseproxy.RequestHeaderOpsTransport); ok {
		return ht.RequestHeaderOps()
	}
	return nil
}

// Cleanup implements caddy.CleanerUpper. It cleans up only a transport the
// wrapper created itself; a configured transport module is cleaned up by
// Caddy like any other module.
func (t *ObservingTransport) Cleanup() error {
	if t.owned != nil {
		return t.owned.Cleanup()
	}
	return nil
}

// Interface guards
var (
	_ http.RoundTripper                                = (*ObservingTransport)(nil)
	_ caddy.CleanerUpper                               = (*ObservingTransport)(nil)
	_ reverseproxy.TLSTransport                        = (*ObservingTransport)(nil)
	_ reverseproxy.H2CTransport                        = (*ObservingTransport)(nil)
	_ reverseproxy.ProxyProtocolTransport              = (*ObservingTransport)(nil)
	_ reverseproxy.HealthCheckSchemeOverriderTransport = (*ObservingTransport)(nil)
	_ reverseproxy.BufferedTransport                   = (*ObservingTransport)(nil)
	_ reverseproxy.ContentLengthRequiredTransport      = (*ObservingTransport)(nil)
	_ reverseproxy.RequestHeaderOpsTransport           = (*ObservingTransport)(nil)
)
