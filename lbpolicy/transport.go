package lbpolicy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// observingTransport wraps the transport of a reverse_proxy handler and
// records, for every proxied attempt, the time to response headers and
// whether the upstream answered. It changes nothing about the round trip
// itself: every optional interface reverse_proxy looks for is forwarded to
// the wrapped transport, so TLS, h2c, PROXY protocol, buffering and header
// operations behave exactly as they would without it.
//
// Active health-check requests also go through the transport; they carry no
// request vars (only real client requests do), which is how they are kept
// out of the statistics, and out of load reports.
//
// It also takes in the ORCA load reports responses carry (see
// LoadReports) and, unless configured to forward them, removes their
// headers and trailers before reverse_proxy copies them to the client. Each handler has its own wrapper, so whether the header is
// forwarded is the setting of the policy that installed it, also when
// other pools share the address.
type observingTransport struct {
	inner   http.RoundTripper
	table   *hoststate.Table
	outlier *Outlier // nil: no outlier ejection
	// probe, when set (outlier ejection and active health checks are
	// both on), lets passing health checks end an ejection early.
	probe *probeRule
	// budget, when set, counts the retries in flight that a policy's
	// retry budget granted.
	budget *RetryBudget
	// reports says how the load reports in responses are taken in;
	// nil: they are not read (a wrapper built in a test).
	reports *LoadReports
	// owned is a transport this package created in place of reverse_proxy's
	// default one; it is cleaned up with the wrapper.
	owned caddy.CleanerUpper
}

// RoundTrip implements http.RoundTripper.
func (t *observingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	di, ok := reverseproxy.GetDialInfo(ctx)
	if !ok || di.Upstream == nil {
		return t.inner.RoundTrip(req)
	}
	vars, _ := ctx.Value(caddyhttp.VarsCtxKey).(map[string]any)
	if vars == nil {
		// an active health check: not traffic, so not observed
		if t.probe != nil {
			return t.roundTripProbe(req, di.Upstream.Dial)
		}
		return t.inner.RoundTrip(req)
	}
	if t.budget != nil && t.budget.isRetry(ctx) {
		t.budget.inFlight.Add(1)
		defer t.budget.inFlight.Add(-1)
	}
	s := t.table.Stats(di.Upstream.Dial)
	s.SetHost(di.Upstream.Host)
	start := s.Begin()
	resp, err := t.inner.RoundTrip(req)
	outcome := classify(ctx, err)
	if outcome == hoststate.Success && t.failedStatus(resp.StatusCode) {
		// An instant 503 is not a fast answer: charged as a failure, it
		// makes the upstream look slower at once, with or without an
		// outlier block, so a black hole is priced out.
		outcome = hoststate.Failure
	}
	t.table.Observe(s, start, outcome)
	if err == nil && t.reports != nil {
		takeLoadReports(s, resp, t.reports)
	}
	if t.outlier != nil && outcome != hoststate.Abandoned {
		t.outlier.judge(t.table, s, di.Upstream.Dial, outcome == hoststate.Failure)
	}
	return resp, err
}

// failedStatus is the one rule for which response statuses are failed
// attempts: the outlier block's failure_status when there is one, else
// defaultFailureStatus.
func (t *observingTransport) failedStatus(code int) bool {
	if t.outlier != nil {
		return t.outlier.failedStatus(code)
	}
	return slices.Contains(defaultFailureStatus, code)
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
func (t *observingTransport) TLSEnabled() bool {
	if tt, ok := t.inner.(reverseproxy.TLSTransport); ok {
		return tt.TLSEnabled()
	}
	return false
}

// EnableTLS implements reverseproxy.TLSTransport.
func (t *observingTransport) EnableTLS(base *reverseproxy.TLSConfig) error {
	if tt, ok := t.inner.(reverseproxy.TLSTransport); ok {
		return tt.EnableTLS(base)
	}
	return fmt.Errorf("transport %T does not support TLS", t.inner)
}

// EnableH2C implements reverseproxy.H2CTransport.
func (t *observingTransport) EnableH2C() error {
	if ht, ok := t.inner.(reverseproxy.H2CTransport); ok {
		return ht.EnableH2C()
	}
	return fmt.Errorf("transport %T does not support h2c", t.inner)
}

// ProxyProtocolEnabled implements reverseproxy.ProxyProtocolTransport.
func (t *observingTransport) ProxyProtocolEnabled() bool {
	if pt, ok := t.inner.(reverseproxy.ProxyProtocolTransport); ok {
		return pt.ProxyProtocolEnabled()
	}
	return false
}

// OverrideHealthCheckScheme implements
// reverseproxy.HealthCheckSchemeOverriderTransport.
func (t *observingTransport) OverrideHealthCheckScheme(base *url.URL, port string) {
	if ht, ok := t.inner.(reverseproxy.HealthCheckSchemeOverriderTransport); ok {
		ht.OverrideHealthCheckScheme(base, port)
	}
}

// DefaultBufferSizes implements reverseproxy.BufferedTransport.
func (t *observingTransport) DefaultBufferSizes() (int64, int64) {
	if bt, ok := t.inner.(reverseproxy.BufferedTransport); ok {
		return bt.DefaultBufferSizes()
	}
	return 0, 0
}

// RequiresContentLength implements reverseproxy.ContentLengthRequiredTransport.
func (t *observingTransport) RequiresContentLength() bool {
	if ct, ok := t.inner.(reverseproxy.ContentLengthRequiredTransport); ok {
		return ct.RequiresContentLength()
	}
	return false
}

// RequestHeaderOps implements reverseproxy.RequestHeaderOpsTransport.
func (t *observingTransport) RequestHeaderOps() *headers.HeaderOps {
	if ht, ok := t.inner.(reverseproxy.RequestHeaderOpsTransport); ok {
		return ht.RequestHeaderOps()
	}
	return nil
}

// Cleanup implements caddy.CleanerUpper. It cleans up only a transport the
// wrapper created itself; a configured transport module is cleaned up by
// Caddy like any other module.
func (t *observingTransport) Cleanup() error {
	if t.owned != nil {
		return t.owned.Cleanup()
	}
	return nil
}

// Interface guards
var (
	_ http.RoundTripper                                = (*observingTransport)(nil)
	_ caddy.CleanerUpper                               = (*observingTransport)(nil)
	_ reverseproxy.TLSTransport                        = (*observingTransport)(nil)
	_ reverseproxy.H2CTransport                        = (*observingTransport)(nil)
	_ reverseproxy.ProxyProtocolTransport              = (*observingTransport)(nil)
	_ reverseproxy.HealthCheckSchemeOverriderTransport = (*observingTransport)(nil)
	_ reverseproxy.BufferedTransport                   = (*observingTransport)(nil)
	_ reverseproxy.ContentLengthRequiredTransport      = (*observingTransport)(nil)
	_ reverseproxy.RequestHeaderOpsTransport           = (*observingTransport)(nil)
)
