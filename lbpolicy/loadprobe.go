package lbpolicy

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
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
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/randpick"
)

// LoadProbe configures load probes, after Prequal (Wydrowski et al.,
// NSDI 2024): besides the reports that come with real traffic, the
// policy asks upstreams for their load itself, at a rate tied to its
// traffic, so that an upstream this proxy rarely sends to still has a
// fresh report. On a share of selections (per_request), within a cap
// (max_rate, and at most 4 probes in flight per policy), it sends one
// GET of path to the upstream whose report is the older of two drawn at
// random from the pool being served, through the handler's transport
// (its TLS and h2c settings apply), and takes the report in the
// response's Endpoint-Load-Metrics (or -Bin) header or trailer exactly
// as one that came with traffic. Selection is never held up: a probe
// runs on its own goroutine.
//
// A probe is not traffic: it is not counted in the latency estimates or
// in the upstreams' requests in flight. A probe that gets no answer
// within timeout, or a 5xx, counts as a failed attempt for outlier
// ejection (when an outlier block is configured): an upstream that
// cannot serve its load endpoint is no better at real requests. A probe
// that passes does not count as a success there, since a cheap endpoint
// answering says little about real requests. A 4xx is counted as
// rejected and judged neither way: the path is likely wrong.
type LoadProbe struct {
	// The path (and query, if any) probes request, e.g. "/load". It
	// must start with "/" and is at most 1024 bytes; the host is always
	// the upstream's own. Required.
	Path string `json:"path,omitempty"`

	// The number of probes started per selection, above 0 and at most 1:
	// 0.1 probes on one selection in ten. Default: 0.1.
	PerRequest float64 `json:"per_request,omitempty"`

	// The most probes the policy starts per second, from 1 to 1000,
	// whatever its traffic. Default: 50.
	MaxRate int `json:"max_rate,omitempty"`

	// How long a probe may take, to the end of its body, from 10ms to
	// 10s. Default: 1s.
	Timeout caddy.Duration `json:"timeout,omitempty"`
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *LoadProbe) UnmarshalJSON(b []byte) error {
	type plain LoadProbe
	return jsonfield.Decode(b, (*plain)(x))
}

// Defaults and bounds of the probe options.
//
// One probe per ten selections adds a tenth to the requests an upstream
// gets from this proxy, each a cheap one, and keeps a small pool's
// reports within the default max_age (3s) where each proxy sends only a
// few requests per upstream per second, the gap probing is for: at 20
// requests a second over 4 upstreams, each is probed about every 2s, on
// top of what its traffic brings. Prequal itself probes more (a few
// probes per query) because its probes are cheap RPCs; an HTTP request
// costs more. The cap of 50 per second keeps a busy proxy's probes to a
// trickle next to its traffic while refreshing a pool of 50 upstreams
// every second, and at most 4 in flight bound what a stalled fleet
// costs (each held for at most timeout).
const (
	defaultProbePerRequest = 0.1
	defaultProbeMaxRate    = 50
	defaultProbeTimeout    = time.Second

	maxProbeRate      = 1000
	minProbeTimeout   = 10 * time.Millisecond
	maxProbeTimeout   = 10 * time.Second
	maxProbePathLen   = 1024
	maxProbesInFlight = 4
	// maxLoadProbeBody is how much of a probe's body is read (and
	// discarded) before the connection is given up on.
	maxLoadProbeBody = 64 << 10
)

// provision writes in the defaults.
func (p *LoadProbe) provision() {
	if p.PerRequest == 0 {
		p.PerRequest = defaultProbePerRequest
	}
	if p.MaxRate == 0 {
		p.MaxRate = defaultProbeMaxRate
	}
	if p.Timeout == 0 {
		p.Timeout = caddy.Duration(defaultProbeTimeout)
	}
}

// loadProbeOptions lists the options check knows, in the order validate
// reports them.
var loadProbeOptions = []string{"path", "per_request", "max_rate", "timeout"}

// validate checks the configuration; a zero option is its default.
func (p *LoadProbe) validate() error {
	for _, opt := range loadProbeOptions {
		if err := p.check(opt); err != nil {
			return fmt.Errorf("probe: %v", err)
		}
	}
	return nil
}

// check is the rule for one option, shared by validate and the
// Caddyfile parser. A zero per_request, max_rate or timeout is the
// default.
func (p *LoadProbe) check(opt string) error {
	switch opt {
	case "path":
		_, err := probeTarget(p.Path)
		return err
	case "per_request":
		if p.PerRequest != 0 {
			return bounds.Positive(opt, p.PerRequest, 1)
		}
	case "max_rate":
		if p.MaxRate != 0 {
			return bounds.Int(opt, p.MaxRate, 1, maxProbeRate)
		}
	case "timeout":
		if p.Timeout != 0 {
			return bounds.Duration(opt, time.Duration(p.Timeout), minProbeTimeout, maxProbeTimeout)
		}
	}
	return nil
}

// probeTarget parses path, the probe's path and optional query, refusing
// anything that could name a host or scheme: a probe goes only to the
// upstream it was drawn for.
func probeTarget(path string) (*url.URL, error) {
	switch {
	case path == "":
		return nil, fmt.Errorf("path is missing; give the path that answers with the load report, e.g. /load")
	case len(path) > maxProbePathLen:
		return nil, fmt.Errorf("path %.20q... is longer than %d bytes", path, maxProbePathLen)
	case path[0] != '/' || strings.HasPrefix(path, "//"):
		return nil, fmt.Errorf("path %q must start with a single \"/\"; it names no host or scheme", path)
	}
	for _, c := range []byte(path) {
		if c <= ' ' || c == 0x7f || c == '#' {
			return nil, fmt.Errorf("path %q has %q; spaces, control characters and fragments are not allowed", path, c)
		}
	}
	u, err := url.ParseRequestURI(path)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil {
		return nil, fmt.Errorf("path %q is not a path and query", path)
	}
	return &url.URL{Path: u.Path, RawPath: u.RawPath, RawQuery: u.RawQuery}, nil
}

// unmarshalCaddyfile reads a probe option, the dispenser on its name;
// errors start with what (the enclosing block, "lb_policy least_time:
// load_reports"):
//
//	probe <path> [{
//		per_request <ratio>
//		max_rate    <n>[/s]
//		timeout     <duration>
//	}]
func (p *LoadProbe) unmarshalCaddyfile(d *caddyfile.Dispenser, what string) error {
	path, err := caddyopt.Arg(d, what)
	if err != nil {
		return err
	}
	p.Path = path
	if err := caddyopt.Checked(d, what+": probe", p.check("path")); err != nil {
		return err
	}
	what += ": probe"
	return caddyopt.Options(d, what, func(opt string) error {
		switch opt {
		case "per_request":
			v, err := parseFloat(d, what)
			if err != nil {
				return err
			}
			// 0 would be the default in JSON: refused here, not ignored
			if err := caddyopt.Checked(d, what, bounds.Positive(opt, v, 1)); err != nil {
				return err
			}
			p.PerRequest = v
		case "max_rate":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			n, err := strconv.Atoi(strings.TrimSuffix(val, "/s"))
			if err != nil {
				return caddyopt.Invalid(d, what, opt, val, "a whole number per second, such as 50/s")
			}
			if err := caddyopt.Checked(d, what, bounds.Int(opt, n, 1, maxProbeRate)); err != nil {
				return err
			}
			p.MaxRate = n
		case "timeout":
			dur, err := caddyopt.PositiveDuration(d, what)
			if err != nil {
				return err
			}
			p.Timeout = caddy.Duration(dur)
			return caddyopt.Checked(d, what, p.check(opt))
		default:
			return caddyopt.Unknown(d, what, "per_request", "max_rate", "timeout")
		}
		return nil
	})
}

// loadProber sends one policy's load probes. Select calls maybe, which
// costs a random draw when no probe starts; the probes run on goroutines
// of their own, at most maxProbesInFlight, all ended by close.
type loadProber struct {
	cfg       *LoadProbe
	target    *url.URL
	transport http.RoundTripper
	// scheme is set on probe URLs when the transport does not choose
	// one itself (Caddy's HTTP transport does, by its TLS settings).
	scheme  string
	table   *hoststate.Table
	reports *LoadReports
	outlier *Outlier // nil: probe failures are only counted
	logger  *zap.Logger

	// interval is the least time between two probes' starts, ns; next is
	// when the next may start (monoclock).
	interval int64
	next     atomic.Int64
	inFlight atomic.Int32

	ctx    context.Context
	cancel context.CancelFunc
	// mu orders starting a probe with close: no probe starts after
	// close, and close waits for every one started.
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// newLoadProber returns the prober of cfg (provisioned and validated),
// sending through transport; its probes end when parent is done or
// close is called.
func newLoadProber(parent context.Context, cfg *LoadProbe, transport http.RoundTripper, table *hoststate.Table,
	reports *LoadReports, outlier *Outlier, logger *zap.Logger) (*loadProber, error) {
	target, err := probeTarget(cfg.Path)
	if err != nil {
		return nil, fmt.Errorf("load_reports: probe: %v", err)
	}
	if pt, ok := transport.(reverseproxy.ProxyProtocolTransport); ok && pt.ProxyProtocolEnabled() {
		return nil, fmt.Errorf("load_reports: probe: the transport sends the PROXY protocol, and a probe has no client address to send")
	}
	p := &loadProber{
		cfg: cfg, target: target, transport: transport, table: table, reports: reports, outlier: outlier, logger: logger,
		interval: int64(time.Second) / int64(cfg.MaxRate),
	}
	if _, ok := transport.(interface{ SetScheme(*http.Request) }); !ok {
		p.scheme = "http"
		if tt, ok := transport.(reverseproxy.TLSTransport); ok && tt.TLSEnabled() {
			p.scheme = "https"
		}
	}
	p.ctx, p.cancel = context.WithCancel(parent)
	return p, nil
}

// maybe starts, on a per_request share of calls and within the caps, a
// probe of the older-reported of two members of v drawn at random. It
// never blocks.
func (p *loadProber) maybe(pool reverseproxy.UpstreamPool, v *poolView, now int64) {
	if rand.Float64() >= p.cfg.PerRequest {
		return
	}
	if p.inFlight.Load() >= maxProbesInFlight {
		return // before taking a token, which would be wasted
	}
	i := p.pick(pool, v, now)
	if i < 0 || !p.admit(now) {
		return
	}
	if p.inFlight.Add(1) > maxProbesInFlight {
		p.inFlight.Add(-1)
		return
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.inFlight.Add(-1)
		return
	}
	p.wg.Add(1)
	p.mu.Unlock()
	st := v.members[i].stats
	st.StartLoadProbe(now)
	go p.run(pool[i], st)
}

// pick returns which member of pool to probe: of two drawn at random, the
// one whose report is older (none is oldest), leaving out members that
// are unhealthy in Caddy's eyes or ejected; -1 when both are. A probe
// sent counts as a report on its way, so that a member whose probes
// fail, and that never has a fresh report, does not draw every probe.
func (p *loadProber) pick(pool reverseproxy.UpstreamPool, v *poolView, now int64) int {
	usable := func(i int) bool { return pool[i].Healthy() && !v.members[i].stats.Ejected(now) }
	if len(pool) == 1 {
		if usable(0) {
			return 0
		}
		return -1
	}
	i, j := randpick.TwoDistinct(rand.Uint64(), len(pool))
	switch ui, uj := usable(i), usable(j); {
	case !ui && !uj:
		return -1
	case !ui:
		return j
	case !uj:
		return i
	}
	if refreshedAt(v.members[j].stats) < refreshedAt(v.members[i].stats) {
		return j
	}
	return i
}

// refreshedAt is when st's latest report arrived or its last probe
// started, whichever is later; the least value when neither happened,
// which makes it the first to probe.
func refreshedAt(st *hoststate.Stats) int64 {
	at := int64(math.MinInt64)
	if probed := st.LoadProbedAt(); probed != 0 {
		at = probed
	}
	if r := st.LoadReport(); r != nil {
		at = max(at, r.AtNs)
	}
	return at
}

// admit takes a token of the rate cap at now: one probe per interval,
// without burst. A lagging clock only admits fewer.
func (p *loadProber) admit(now int64) bool {
	for {
		next := p.next.Load()
		if now < next {
			return false
		}
		if p.next.CompareAndSwap(next, now+p.interval) {
			return true
		}
	}
}

// run sends one probe to u, whose state is st, and takes in what it
// brings.
func (p *loadProber) run(u *reverseproxy.Upstream, st *hoststate.Stats) {
	defer p.wg.Done()
	defer p.inFlight.Add(-1)
	defer func() {
		if r := recover(); r != nil {
			p.logger.Error("load probe panicked", zap.String("upstream", u.Dial), zap.Any("panic", r))
		}
	}()
	result := p.send(u, st)
	if result == hoststate.ProbeFailed && p.ctx.Err() != nil {
		// cut short by the config's end: says nothing of the upstream
		return
	}
	st.CountLoadProbe(result)
	if result == hoststate.ProbeFailed && p.outlier != nil {
		p.outlier.judge(p.table, st, u.Dial, true)
	}
}

// send makes the probe's round trip and reads its report. A dial address
// that needs a request's placeholders has no address of its own to probe:
// it counts as rejected.
func (p *loadProber) send(u *reverseproxy.Upstream, st *hoststate.Stats) hoststate.ProbeResult {
	di, hostAddr, ok := probeDialInfo(u)
	if !ok {
		return hoststate.ProbeRejected
	}
	ctx, cancel := context.WithTimeout(p.ctx, time.Duration(p.cfg.Timeout))
	defer cancel()
	// As Caddy's active health checks do: a replacer of its own, the
	// upstream to dial, and no request vars, so the observing transport
	// (if the request reached it) would take it for a health check.
	ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, caddy.NewReplacer())
	ctx = context.WithValue(ctx, dialInfoKey, di)
	target := *p.target
	target.Scheme, target.Host = p.scheme, hostAddr
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "/", nil)
	if err != nil {
		return hoststate.ProbeFailed
	}
	req.URL, req.Host = &target, hostAddr
	req.Header.Set("User-Agent", "lbx-load-probe")
	resp, err := p.transport.RoundTrip(req)
	if err != nil {
		return hoststate.ProbeFailed
	}
	// the same path as a report that came with traffic; a trailer report
	// is read when the body ends within the bound
	takeLoadReports(st, resp, p.reports)
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxLoadProbeBody))
	_ = resp.Body.Close()
	switch {
	case resp.StatusCode >= 500:
		return hoststate.ProbeFailed
	case resp.StatusCode >= 400:
		return hoststate.ProbeRejected
	}
	return hoststate.ProbeOK
}

// dialInfoKey is the context key under which reverse_proxy's transports
// find the upstream to dial (reverseproxy.GetDialInfo). Caddy has no
// setter for it; if the key ever changes, probes dial the URL's host,
// which is the same address.
const dialInfoKey caddy.CtxKey = "reverse_proxy.dial_info"

// probeDialInfo returns the dial information of u and the host:port to
// put in the probe's URL and Host header: the upstream's own address
// ("localhost" for a socket). ok is false when u's address needs a
// request's placeholders or is not one socket.
func probeDialInfo(u *reverseproxy.Upstream) (di reverseproxy.DialInfo, hostAddr string, ok bool) {
	if strings.Contains(u.Dial, "{") {
		return di, "", false
	}
	addr, err := caddy.ParseNetworkAddress(u.Dial)
	if err != nil || addr.PortRangeSize() != 1 {
		return di, "", false
	}
	di = reverseproxy.DialInfo{
		Upstream: u,
		Network:  addr.Network,
		Address:  addr.JoinHostPort(0),
		Host:     addr.Host,
		Port:     strconv.FormatUint(uint64(addr.StartPort), 10),
	}
	hostAddr = di.Address
	if addr.IsUnixNetwork() || addr.IsFdNetwork() {
		hostAddr = "localhost"
	}
	return di, hostAddr, true
}

// close stops starting probes, cancels those in flight and waits for
// them to end. It is idempotent.
func (p *loadProber) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
}
