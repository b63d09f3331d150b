package lbpolicy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy/fastcgi"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// probePolicy is a selection policy that installs the observer, with
// outlier ejection when given an outlier block, standing in for lbx's
// policies so the observer is tested apart from their selection.
type probePolicy struct {
	Outlier *Outlier `json:"outlier,omitempty"`
	table   *hoststate.Table
}

func (*probePolicy) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.lbx_probe",
		New: func() caddy.Module { return new(probePolicy) },
	}
}

var lastProbe *probePolicy

func (p *probePolicy) Provision(ctx caddy.Context) error {
	p.table = hoststate.NewTable(hoststate.Config{})
	lastProbe = p
	if p.Outlier != nil {
		p.Outlier.provision(zap.NewNop(), events.Emitter{})
		if err := p.Outlier.validate(); err != nil {
			return err
		}
	}
	_, err := install(ctx, p.table, p.Outlier, loadReportsOrDefault(nil))
	return err
}

func (p *probePolicy) Cleanup() error {
	p.table.Release()
	return nil
}

func (p *probePolicy) Select(pool reverseproxy.UpstreamPool, _ *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	return pool[0]
}

func init() { caddy.RegisterModule(new(probePolicy)) }

// provisionProxy provisions a real reverse_proxy handler from JSON in a
// context of its own, and returns it, the probe policy that ran inside it
// and the function that cancels the context (as Caddy does when it
// unloads the config; the test's cleanup does too).
func provisionProxy(t *testing.T, handlerJSON string) (*reverseproxy.Handler, *probePolicy, context.CancelFunc) {
	t.Helper()
	parent, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := caddy.NewContext(parent)
	t.Cleanup(cancel)
	lastProbe = nil
	mod, err := ctx.LoadModuleByID("http.handlers.reverse_proxy", json.RawMessage(handlerJSON))
	if err != nil {
		t.Fatal(err)
	}
	h, p := mod.(*reverseproxy.Handler), lastProbe
	t.Cleanup(func() { _ = h.Cleanup(); _ = p.Cleanup() })
	return h, p, cancel
}

const probe = `"load_balancing":{"selection_policy":{"policy":"lbx_probe"}}`

func TestInstallWrapsDefaultTransport(t *testing.T) {
	h, _, _ := provisionProxy(t, `{"upstreams":[{"dial":"127.0.0.1:1"}],`+probe+`}`)
	ot, ok := h.Transport.(*observingTransport)
	if !ok {
		t.Fatalf("transport is %T, want *observingTransport", h.Transport)
	}
	if _, ok := ot.inner.(*reverseproxy.HTTPTransport); !ok {
		t.Fatalf("inner transport is %T, want Caddy's default *HTTPTransport", ot.inner)
	}
	if ot.owned == nil {
		t.Fatal("a default transport created by install must be cleaned up with it")
	}
}

func TestInstallWrapsConfiguredTransport(t *testing.T) {
	h, _, _ := provisionProxy(t, `{"upstreams":[{"dial":"127.0.0.1:1"}],`+probe+`,
		"transport":{"protocol":"http","tls":{"insecure_skip_verify":true},"versions":["1.1"]}}`)
	ot := h.Transport.(*observingTransport)
	inner, ok := ot.inner.(*reverseproxy.HTTPTransport)
	if !ok || !inner.TLSEnabled() {
		t.Fatalf("inner transport %T should be the configured TLS HTTPTransport", ot.inner)
	}
	if !ot.TLSEnabled() {
		t.Fatal("TLSEnabled not forwarded")
	}
	if ot.owned != nil {
		t.Fatal("a configured transport is Caddy's to clean up, not ours")
	}
	// The health-check scheme is overridden through the wrapper.
	u := &url.URL{Scheme: "http", Host: "example"}
	ot.OverrideHealthCheckScheme(u, "443")
	if u.Scheme != "https" {
		t.Fatalf("OverrideHealthCheckScheme not forwarded: scheme %q", u.Scheme)
	}
}

func TestForwardsFastCGIInterfaces(t *testing.T) {
	h, _, _ := provisionProxy(t, `{"upstreams":[{"dial":"127.0.0.1:9000"}],`+probe+`,
		"transport":{"protocol":"fastcgi","root":"/srv"}}`)
	ot := h.Transport.(*observingTransport)
	if _, ok := ot.inner.(*fastcgi.Transport); !ok {
		t.Fatalf("inner is %T", ot.inner)
	}
	if !ot.RequiresContentLength() {
		t.Fatal("RequiresContentLength not forwarded from fastcgi")
	}
	req, resp := ot.DefaultBufferSizes()
	wreq, wresp := new(fastcgi.Transport).DefaultBufferSizes()
	if req != wreq || resp != wresp {
		t.Fatalf("DefaultBufferSizes = %d,%d, want %d,%d", req, resp, wreq, wresp)
	}
	if ot.ProxyProtocolEnabled() || ot.TLSEnabled() {
		t.Fatal("neutral answers expected from a transport without these features")
	}
	if ot.EnableH2C() == nil {
		t.Fatal("EnableH2C on a transport without h2c must fail, not silently succeed")
	}
}

// fakeTransport answers after a delay, or fails.
type fakeTransport struct {
	delay time.Duration
	err   error
}

func (f fakeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	select {
	case <-time.After(f.delay):
	case <-req.Context().Done():
		return nil, req.Context().Err()
	}
	if f.err != nil {
		return nil, f.err
	}
	return &http.Response{StatusCode: 200, Body: http.NoBody}, nil
}

// request builds a request as reverse_proxy would hand it to the transport:
// with dial info, and with request vars unless it is a health check.
func request(ctx context.Context, u *reverseproxy.Upstream, healthCheck bool) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+u.Dial+"/", nil)
	if !healthCheck {
		ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
	}
	return req.WithContext(withDialInfo(ctx, u))
}

// withDialInfo attaches dial info under reverse_proxy's context key (Caddy
// has no setter; if the key ever changes, GetDialInfo finds nothing and
// these tests fail).
func withDialInfo(ctx context.Context, u *reverseproxy.Upstream) context.Context {
	ctx = context.WithValue(ctx, caddy.CtxKey("reverse_proxy.dial_info"), reverseproxy.DialInfo{Upstream: u, Network: "tcp", Address: u.Dial})
	if _, ok := reverseproxy.GetDialInfo(ctx); !ok {
		panic("reverse_proxy's dial info key changed")
	}
	return ctx
}

func TestObservesAttemptsButNotHealthChecks(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
	ot := &observingTransport{inner: fakeTransport{delay: 5 * time.Millisecond}, table: table}

	for range 3 {
		if _, err := ot.RoundTrip(request(context.Background(), u, true)); err != nil {
			t.Fatal(err)
		}
	}
	snap := table.Stats(u.Dial).Snapshot(monoclock.Now())
	if snap.Samples != 0 {
		t.Fatalf("health checks counted: %d samples", snap.Samples)
	}
	if _, err := ot.RoundTrip(request(context.Background(), u, false)); err != nil {
		t.Fatal(err)
	}
	snap = table.Stats(u.Dial).Snapshot(monoclock.Now())
	if snap.Samples != 1 || snap.Estimate < 5*time.Millisecond || snap.Pending != 0 {
		t.Fatalf("want one ≥5ms sample and nothing pending, got %+v", snap)
	}
}

func TestFailureAndAbandonedClassification(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}

	refused := &observingTransport{inner: fakeTransport{err: errors.New("connection refused")}, table: table}
	if _, err := refused.RoundTrip(request(context.Background(), u, false)); err == nil {
		t.Fatal("want error")
	}
	if f := table.Stats(u.Dial).Snapshot(monoclock.Now()).Failures; f != 1 {
		t.Fatalf("transport error must count as a failure, got %d", f)
	}

	slow := &observingTransport{inner: fakeTransport{delay: time.Minute}, table: table}
	ctx, cancel := context.WithCancel(context.Background())
	st := table.Stats(u.Dial)
	go func() {
		// cancel once the attempt is under way
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && st.Snapshot(monoclock.Now()).Pending == 0; {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	if _, err := slow.RoundTrip(request(ctx, u, false)); err == nil {
		t.Fatal("want cancellation error")
	}
	if f := table.Stats(u.Dial).Snapshot(monoclock.Now()).Failures; f != 1 {
		t.Fatalf("a client that went away is not the upstream's failure: failures=%d", f)
	}
}

// instant answers at once, for measuring the observer's own cost.
type instant struct{}

func (instant) RoundTrip(*http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: 200, Body: http.NoBody}, nil
}

// BenchmarkObserve measures what observation adds to one proxied attempt:
// the same request through the bare inner transport and through the
// observing one, with and without outlier detection.
//
//	go test ./lbpolicy -run '^$' -bench Observe -benchmem
func BenchmarkObserve(b *testing.B) {
	table := hoststate.NewTable(hoststate.Config{})
	b.Cleanup(table.Release)
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: "bench:80"}
	req := request(context.Background(), u, false)
	o := Outlier{}
	o.provision(zap.NewNop(), events.Emitter{})
	for _, c := range []struct {
		name string
		rt   http.RoundTripper
	}{
		{"bare", instant{}},
		{"observed", &observingTransport{inner: instant{}, table: table}},
		{"observed_outlier", &observingTransport{inner: instant{}, table: table, outlier: &o}},
		{"observed_report", &observingTransport{inner: reporting{"TEXT cpu_utilization=0.4, rps_fractional=12, named_metrics.queue=3"}, table: table, reports: loadReportsOrDefault(nil)}},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.rt.RoundTrip(req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
