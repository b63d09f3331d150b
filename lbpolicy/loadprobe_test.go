package lbpolicy

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/orca"
)

// probeBackend is a transport standing in for the upstreams: it records
// each probe request, answers with status and report, and, when hold is
// set, waits for it (or the probe's end) before answering.
type probeBackend struct {
	status int
	report string
	err    error
	hold   chan struct{}

	mu   sync.Mutex
	reqs []*http.Request
	// inFlight and most count the probes it is serving, and the most at
	// once.
	inFlight, most atomic.Int32
}

func (b *probeBackend) RoundTrip(req *http.Request) (*http.Response, error) {
	b.mu.Lock()
	b.reqs = append(b.reqs, req)
	b.mu.Unlock()
	n := b.inFlight.Add(1)
	defer b.inFlight.Add(-1)
	for {
		m := b.most.Load()
		if n <= m || b.most.CompareAndSwap(m, n) {
			break
		}
	}
	if b.hold != nil {
		select {
		case <-b.hold:
		case <-req.Context().Done():
			return nil, req.Context().Err()
		}
	}
	if b.err != nil {
		return nil, b.err
	}
	h := http.Header{}
	if b.report != "" {
		h.Set(loadReportHeader, b.report)
	}
	status := b.status
	if status == 0 {
		status = 200
	}
	return &http.Response{StatusCode: status, Header: h, Body: http.NoBody}, nil
}

func (b *probeBackend) requests() []*http.Request {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]*http.Request(nil), b.reqs...)
}

// newTestProber returns a prober of cfg (defaults written in) sending
// through b, for a least_time policy over its own table; it is closed
// when the test ends.
func newTestProber(t *testing.T, cfg LoadProbe, b http.RoundTripper, outlier *Outlier) (*loadProber, *LeastTimeSelection) {
	t.Helper()
	cfg.provision()
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	s := provisionLeastTime(t, &LeastTimeSelection{Outlier: outlier})
	p, err := newLoadProber(context.Background(), &cfg, b, s.table, s.LoadReports, s.Outlier, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	return p, s
}

// waitProbes waits for p's probes in flight to end.
func waitProbes(t *testing.T, p *loadProber) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); p.inFlight.Load() > 0; time.Sleep(100 * time.Microsecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d probes still in flight after 5s", p.inFlight.Load())
		}
	}
}

func TestLoadProbeValidate(t *testing.T) {
	for _, c := range []struct {
		probe LoadProbe
		err   string // "" when valid
	}{
		{LoadProbe{Path: "/load"}, ""},
		{LoadProbe{Path: "/load?format=text", PerRequest: 1, MaxRate: 1000, Timeout: caddy.Duration(10 * time.Second)}, ""},
		{LoadProbe{Path: "/load", PerRequest: 0.001, MaxRate: 1, Timeout: caddy.Duration(10 * time.Millisecond)}, ""},
		{LoadProbe{}, "path is missing"},
		{LoadProbe{Path: "load"}, `path "load" must start`},
		{LoadProbe{Path: "//evil.example/load"}, "names no host"},
		{LoadProbe{Path: "http://evil.example/load"}, "must start"},
		{LoadProbe{Path: "/lo ad"}, "spaces"},
		{LoadProbe{Path: "/load#x"}, "fragments"},
		{LoadProbe{Path: "/" + strings.Repeat("a", 1024)}, "longer than 1024 bytes"},
		{LoadProbe{Path: "/load", PerRequest: 1.5}, "per_request 1.5 is above the maximum 1"},
		{LoadProbe{Path: "/load", PerRequest: -0.1}, "per_request -0.1 is below the minimum 0"},
		{LoadProbe{Path: "/load", MaxRate: 1001}, "max_rate 1001 is above the maximum 1000"},
		{LoadProbe{Path: "/load", MaxRate: -1}, "max_rate -1 is below the minimum 1"},
		{LoadProbe{Path: "/load", Timeout: caddy.Duration(time.Millisecond)}, "timeout 1ms is below the minimum 10ms"},
		{LoadProbe{Path: "/load", Timeout: caddy.Duration(time.Minute)}, "timeout 1m0s is above the maximum 10s"},
	} {
		s := LeastTimeSelection{LoadReports: &LoadReports{Probe: &c.probe}}
		err := s.Validate()
		if c.err == "" {
			if err != nil {
				t.Errorf("%+v: %v", c.probe, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.err) || !strings.HasPrefix(err.Error(), "least_time: load_reports: probe: ") {
			t.Errorf("%+v: error %v, want least_time: load_reports: probe: ...%s...", c.probe, err, c.err)
		}
	}
	// defaults are written in
	p := LoadProbe{Path: "/load"}
	p.provision()
	if p.PerRequest != 0.1 || p.MaxRate != 50 || p.Timeout != caddy.Duration(time.Second) {
		t.Fatalf("defaults: %+v", p)
	}
	// the panic policy does not probe
	ps := &PanicSelection{Outlier: &Outlier{}, LoadReports: &LoadReports{Probe: &LoadProbe{Path: "/load"}}}
	if err := ps.misplaced(true); err == nil || !strings.Contains(err.Error(), "the panic policy does not probe") {
		t.Fatalf("panic with a probe: %v", err)
	}
}

func TestLoadProbeCaddyfile(t *testing.T) {
	for _, c := range []struct {
		in   string
		want LoadProbe
		err  string
	}{
		{in: "probe /load", want: LoadProbe{Path: "/load"}},
		{in: "probe /load {\n per_request 0.5\n max_rate 20/s\n timeout 250ms\n}", want: LoadProbe{Path: "/load", PerRequest: 0.5, MaxRate: 20, Timeout: caddy.Duration(250 * time.Millisecond)}},
		{in: "probe /load {\n max_rate 7\n}", want: LoadProbe{Path: "/load", MaxRate: 7}},
		{in: "probe", err: "load_reports: probe: missing value, at Testfile:3"},
		{in: "probe /a /b", err: `probe: one value expected, got another: "/b", at Testfile:3`},
		{in: "probe load", err: `load_reports: probe: path "load" must start with a single "/"`},
		{in: "probe /load {\n per_request 0\n}", err: "probe: per_request must be above 0, at Testfile:4"},
		{in: "probe /load {\n per_request 2\n}", err: "probe: per_request 2 is above the maximum 1, at Testfile:4"},
		{in: "probe /load {\n per_request often\n}", err: `probe: per_request "often": want a number, at Testfile:4`},
		{in: "probe /load {\n max_rate 0/s\n}", err: "probe: max_rate 0 is below the minimum 1, at Testfile:4"},
		{in: "probe /load {\n max_rate 5000/s\n}", err: "probe: max_rate 5000 is above the maximum 1000, at Testfile:4"},
		{in: "probe /load {\n max_rate 5/m\n}", err: `probe: max_rate "5/m": want a whole number per second, such as 50/s, at Testfile:4`},
		{in: "probe /load {\n timeout 0s\n}", err: `probe: timeout "0s": want a positive duration`},
		{in: "probe /load {\n timeout 1h\n}", err: "probe: timeout 1h0m0s is above the maximum 10s, at Testfile:4"},
		{in: "probe /load {\n timeout 1s\n timeout 2s\n}", err: "probe: timeout specified more than once, at Testfile:5"},
		{in: "probe /load {\n rate 5\n}", err: `probe: unknown option "rate" (want per_request, max_rate or timeout), at Testfile:4`},
	} {
		d := caddyfile.NewTestDispenser("least_time {\nload_reports {\n" + c.in + "\n}\n}")
		var s LeastTimeSelection
		err := s.UnmarshalCaddyfile(d)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) || !strings.HasPrefix(err.Error(), "lb_policy least_time: load_reports: ") {
				t.Errorf("%q: error %v, want one containing %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || s.LoadReports == nil || s.LoadReports.Probe == nil || *s.LoadReports.Probe != c.want {
			t.Errorf("%q: got %+v, %v; want %+v", c.in, s.LoadReports, err, c.want)
		}
	}
}

// TestLoadProbeRequest: a probe is a GET of the path to the drawn
// upstream's own address, with its dial info, without request vars, and
// its report becomes the upstream's, as one that came with traffic
// would; it enters no latency statistics.
func TestLoadProbeRequest(t *testing.T) {
	b := &probeBackend{report: "TEXT application_utilization=0.7, rps_fractional=3"}
	p, s := newTestProber(t, LoadProbe{Path: "/load?x=1", PerRequest: 1}, b, nil)
	pool := newPool(t, 1)
	v := s.viewFor(pool)
	p.maybe(pool, v, monoclock.Now())
	p.close()
	reqs := b.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d probes sent, want 1", len(reqs))
	}
	req := reqs[0]
	di, ok := reverseproxy.GetDialInfo(req.Context())
	if req.Method != http.MethodGet || req.URL.Path != "/load" || req.URL.RawQuery != "x=1" || req.URL.Scheme != "http" ||
		req.URL.Host != pool[0].Dial || req.Host != pool[0].Dial || !ok || di.Upstream != pool[0] || di.Address != pool[0].Dial {
		t.Fatalf("probe request %s %s (Host %s), dial info %+v %v", req.Method, req.URL, req.Host, di, ok)
	}
	if vars := req.Context().Value(caddyhttp.VarsCtxKey); vars != nil {
		t.Fatal("a probe carries request vars: the observing transport would count it as traffic")
	}
	if _, ok := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); !ok {
		t.Fatal("a probe carries no replacer; Caddy's transport expects one")
	}
	st := s.table.Stats(pool[0].Dial)
	r := st.LoadReport()
	if r == nil || r.Application != 0.7 || r.RPS != 3 || r.MaxAge != time.Duration(s.LoadReports.MaxAge) {
		t.Fatalf("report from the probe: %+v", r)
	}
	if snap := st.Snapshot(monoclock.Now()); snap.Samples != 0 || snap.Pending != 0 || snap.Probes[hoststate.ProbeOK] != 1 {
		t.Fatalf("after a probe: samples %d, pending %d, probes %v", snap.Samples, snap.Pending, snap.Probes)
	}
	// a bad report is refused and counted as an in-band one is
	b.report = "TEXT cpu_utilization=NaN"
	p2, _ := newTestProber(t, LoadProbe{Path: "/load", PerRequest: 1}, b, nil)
	p2.maybe(pool, v, monoclock.Now())
	p2.close()
	if n, kind := st.LoadReportsRefused(); n != 1 || !errors.Is(kind, orca.ErrValue) || st.LoadReport() != r {
		t.Fatalf("refused report: %d (%v), report %+v", n, kind, st.LoadReport())
	}
}

// TestLoadProbeRateCap: a burst of 10k selections, all probing, starts
// no more probes than max_rate allows over the time they span, and
// none at all beyond one while the clock stands still.
func TestLoadProbeRateCap(t *testing.T) {
	b := &probeBackend{}
	p, s := newTestProber(t, LoadProbe{Path: "/load", PerRequest: 1, MaxRate: 20}, b, nil)
	pool := newPool(t, 4)
	v := s.viewFor(pool)
	start := monoclock.Now()
	for range 10000 {
		p.maybe(pool, v, start)
	}
	// 10k selections over two (simulated) seconds; each probe is let
	// end before the next selection, so that the in-flight cap, which
	// the simulated clock would outrun, does not hold them back
	for i := range 10000 {
		p.maybe(pool, v, start+int64(i)*int64(200*time.Microsecond))
		waitProbes(t, p)
	}
	p.close()
	// one at start, then one per 50ms over 2s
	if n := len(b.requests()); n < 38 || n > 41 {
		t.Fatalf("%d probes started, want one while the clock stood still and about 40 over 2s at 20/s", n)
	}
}

// TestLoadProbeInFlightCap: however fast selections come, at most four
// probes are in flight, and closing the prober ends them.
func TestLoadProbeInFlightCap(t *testing.T) {
	b := &probeBackend{hold: make(chan struct{})}
	p, s := newTestProber(t, LoadProbe{Path: "/load", PerRequest: 1, MaxRate: 1000, Timeout: caddy.Duration(10 * time.Second)}, b, nil)
	pool := newPool(t, 8)
	v := s.viewFor(pool)
	now := monoclock.Now()
	for i := range 1000 {
		p.maybe(pool, v, now+int64(i)*int64(time.Second))
	}
	deadline := time.Now().Add(5 * time.Second)
	for b.inFlight.Load() < maxProbesInFlight {
		if time.Now().After(deadline) {
			t.Fatalf("%d probes in flight, want %d", b.inFlight.Load(), maxProbesInFlight)
		}
		time.Sleep(time.Millisecond)
	}
	if n := len(b.requests()); n != maxProbesInFlight || p.inFlight.Load() != maxProbesInFlight {
		t.Fatalf("%d probes started (%d counted in flight), want %d", n, p.inFlight.Load(), maxProbesInFlight)
	}
	p.close() // cancels the held probes and waits for them
	if n := b.inFlight.Load(); n != 0 || p.inFlight.Load() != 0 {
		t.Fatalf("after close: %d probes still in the backend, %d counted", n, p.inFlight.Load())
	}
	// and starts none after
	p.maybe(pool, v, now+int64(2000*time.Second))
	if n := len(b.requests()); n != maxProbesInFlight || b.most.Load() > maxProbesInFlight {
		t.Fatalf("%d probes after close (most at once %d)", n, b.most.Load())
	}
	// the canceled probes were not charged to the upstreams
	for _, u := range pool {
		if snap := s.table.Stats(u.Dial).Snapshot(monoclock.Now()); snap.ConsecFailures != 0 || snap.Probes != ([hoststate.NumProbeResults]uint64{}) {
			t.Fatalf("%s: canceled probes counted: %d failures, probes %v", u.Dial, snap.ConsecFailures, snap.Probes)
		}
	}
}

// TestLoadProbePicksOlderReport: of the two members drawn, the one whose
// report is older is probed; one with none before any; ejected members
// (and ones unhealthy in Caddy's eyes) are left out.
func TestLoadProbePicksOlderReport(t *testing.T) {
	p, s := newTestProber(t, LoadProbe{Path: "/load"}, &probeBackend{}, nil)
	pool := newPool(t, 3)
	v := s.viewFor(pool)
	now := monoclock.Now()
	r, _ := orca.Parse("TEXT cpu_utilization=0.5")
	for i, age := range []time.Duration{0, time.Second, 2 * time.Second} {
		s.table.Stats(pool[i].Dial).SetLoadReport(r, now-int64(age), time.Minute)
	}
	count := func() [3]int {
		var n [3]int
		for range 3000 {
			if i := p.pick(pool, v, now); i >= 0 {
				n[i]++
			} else {
				t.Fatal("no member picked")
			}
		}
		return n
	}
	// pairs (0,1)→1, (0,2)→2, (1,2)→2: the newest never, the oldest 2/3
	if n := count(); n[0] != 0 || n[2] < 1800 || n[2] > 2200 {
		t.Fatalf("picks %v, want [0 ~1000 ~2000]", n)
	}
	// a member without a report comes first
	pool2 := append(pool, newPool(t, 4)[3])
	v2 := s.viewFor(pool2)
	seen := 0
	for range 3000 {
		if i := p.pick(pool2, v2, now); i == 3 {
			seen++
		} else if i == 0 {
			t.Fatal("the freshest report was probed")
		}
	}
	if seen < 1300 || seen > 1700 { // in every pair it is in: half of them
		t.Fatalf("the member with no report picked %d of 3000, want about 1500", seen)
	}
	// once a probe to it has started, it counts as the freshest: a member
	// whose probes fail does not draw them all
	s.table.Stats(pool2[3].Dial).StartLoadProbe(now + 1)
	for range 1000 {
		if i := p.pick(pool2, v2, now); i == 3 {
			t.Fatal("a member just probed was picked again")
		}
	}
	// ejected ones are left out
	s.table.Stats(pool[2].Dial).Eject(now, time.Minute, func(int64) time.Duration { return time.Minute }, hoststate.ReasonSuccessRate)
	if n := count(); n[2] != 0 {
		t.Fatalf("picks %v: an ejected member was probed", n)
	}
	one := pool[2:]
	if i := p.pick(one, s.viewFor(one), now); i != -1 {
		t.Fatalf("an ejected lone member picked: %d", i)
	}
}

// TestLoadProbeFailuresFeedOutlier: probes that fail (transport errors,
// 5xx) count as failed attempts for outlier ejection and eject a
// backend; 4xx answers are counted as rejected and judged neither way;
// nothing enters the latency statistics.
func TestLoadProbeFailuresFeedOutlier(t *testing.T) {
	for _, c := range []struct {
		name   string
		b      *probeBackend
		result hoststate.ProbeResult
		eject  bool
	}{
		{"transport error", &probeBackend{err: errors.New("connection refused")}, hoststate.ProbeFailed, true},
		{"503", &probeBackend{status: 503}, hoststate.ProbeFailed, true},
		{"500", &probeBackend{status: 500}, hoststate.ProbeFailed, true},
		{"404", &probeBackend{status: 404}, hoststate.ProbeRejected, false},
		{"200", &probeBackend{report: "TEXT cpu_utilization=0.2"}, hoststate.ProbeOK, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			o := &Outlier{Consecutive: 3}
			p, s := newTestProber(t, LoadProbe{Path: "/load", PerRequest: 1, MaxRate: 1000}, c.b, o)
			pool := newPool(t, 1)
			v := s.viewFor(pool)
			now := monoclock.Now()
			for i := range 3 {
				p.maybe(pool, v, now+int64(i)*int64(time.Second))
				waitProbes(t, p) // one at a time, so that each is judged in turn
			}
			p.close()
			st := s.table.Stats(pool[0].Dial)
			snap := st.Snapshot(monoclock.Now())
			if snap.Probes[c.result] != 3 || snap.Samples != 0 || snap.Failures != 0 {
				t.Fatalf("probes %v, samples %d, failures %d; want 3 %v and no latency statistics", snap.Probes, snap.Samples, snap.Failures, c.result)
			}
			if ejected := st.Ejected(monoclock.Now()); ejected != c.eject {
				t.Fatalf("ejected = %v, want %v", ejected, c.eject)
			}
		})
	}
}

// TestLoadProbeInSelect: least_time with a probe block, inside a real
// reverse_proxy handler, probes through the handler's transport as it
// selects, and stops probing when cleaned up.
func TestLoadProbeInSelect(t *testing.T) {
	b := &probeBackend{report: "TEXT application_utilization=0.3"}
	s := provisionLeastTime(t, &LeastTimeSelection{LoadReports: &LoadReports{Probe: &LoadProbe{Path: "/load", PerRequest: 1, MaxRate: 1000}}})
	if s.prober != nil {
		t.Fatal("a prober outside reverse_proxy")
	}
	// as install would leave it, over the test's transport
	s.observer = &observingTransport{inner: b, table: s.table, reports: s.LoadReports}
	var err error
	s.prober, err = newLoadProber(context.Background(), s.LoadReports.Probe, b, s.table, s.LoadReports, nil, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, 3)
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.Select(pool, nil, nil)
		monoclock.Now() // the clock moves with round trips; none here
		reported := 0
		for _, u := range pool {
			if s.table.Stats(u.Dial).LoadReport() != nil {
				reported++
			}
		}
		if reported == len(pool) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d upstreams have a report from probes", reported, len(pool))
		}
		time.Sleep(time.Millisecond)
	}
	if err := s.Cleanup(); err != nil {
		t.Fatal(err)
	}
	n := len(b.requests())
	for range 100 {
		s.Select(pool, nil, nil)
	}
	if m := len(b.requests()); m != n {
		t.Fatalf("%d probes after Cleanup", m-n)
	}
}

// TestLoadProbeProvision: inside a real reverse_proxy handler the prober
// sends through the handler's transport, not the observing wrapper; a
// transport that sends the PROXY protocol is refused.
func TestLoadProbeProvision(t *testing.T) {
	const policy = `"load_balancing":{"selection_policy":{"policy":"least_time","load_reports":{"probe":{"path":"/load"}}}}`
	parent, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	load := func(handlerJSON string) (*reverseproxy.Handler, error) {
		ctx, cancel := caddy.NewContext(parent)
		t.Cleanup(cancel)
		mod, err := ctx.LoadModuleByID("http.handlers.reverse_proxy", []byte(handlerJSON))
		if err != nil {
			return nil, err
		}
		h := mod.(*reverseproxy.Handler)
		t.Cleanup(func() { _ = h.Cleanup() })
		return h, nil
	}
	h, err := load(`{"upstreams":[{"dial":"127.0.0.1:1"}],` + policy + `}`)
	if err != nil {
		t.Fatal(err)
	}
	s := h.LoadBalancing.SelectionPolicy.(*LeastTimeSelection)
	if s.prober == nil || s.prober.transport != s.observer.inner || s.prober.scheme != "" {
		t.Fatalf("prober %+v", s.prober)
	}
	if got := s.LoadReports.Probe; got.PerRequest != 0.1 || got.MaxRate != 50 || got.Timeout != caddy.Duration(time.Second) {
		t.Fatalf("defaults not written in: %+v", got)
	}
	_, err = load(`{"upstreams":[{"dial":"127.0.0.1:1"}],"transport":{"protocol":"http","proxy_protocol":"v2"},` + policy + `}`)
	if err == nil || !strings.Contains(err.Error(), "PROXY protocol") {
		t.Fatalf("probe over PROXY protocol: %v", err)
	}
}

// TestLoadProbeSelectNoAlloc: with probing on, a selection that starts
// no probe allocates nothing.
func TestLoadProbeSelectNoAlloc(t *testing.T) {
	b := &probeBackend{}
	p, s := newTestProber(t, LoadProbe{Path: "/load", PerRequest: 1, MaxRate: 1}, b, nil)
	s.prober = p
	pool := newPool(t, 4)
	s.Select(pool, nil, nil) // starts the one probe the cap allows this second
	waitProbes(t, p)
	if a := testing.AllocsPerRun(100, func() { s.Select(pool, nil, nil) }); a != 0 {
		t.Fatalf("Select allocates %v times with probing on and no probe started", a)
	}
	if n := len(b.requests()); n < 1 || n > 2 {
		t.Fatalf("%d probes; want the one the cap of 1/s allows (two if a second passed)", n)
	}
}
