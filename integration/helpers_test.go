// Package integration runs lbx inside a real, in-process Caddy (caddytest)
// against real HTTP backends on loopback. One Caddy serves the whole test
// binary; every test loads its own config through the admin API (a real
// reload) and runs serially.
package integration

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	"github.com/pires/go-proxyproto"

	_ "github.com/caddy-lbx/lbx"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// adminAddr is caddytest's default admin address.
const adminAddr = "localhost:2999"

// adminClient talks to Caddy's admin API; its idle connections are closed
// at the end of every test.
var adminClient = &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}

// Ports Caddy serves on, chosen once per test binary: Caddy keeps its
// listeners across reloads, so every config uses the same ones.
var (
	portsOnce           sync.Once
	httpPort, httpsPort int
)

var freePort = lbxtest.FreePort

// env is one test's harness: the caddytest tester, an HTTP client for the
// proxy, and the backends the test started. Its cleanup unloads the test's
// config (stopping health checkers and releasing lbx state) before the
// backends are closed.
type env struct {
	t        *testing.T
	tb       *failRecorder
	tester   *caddytest.Tester
	client   *http.Client
	backends []*backend
	loaded   bool
}

func newEnv(t *testing.T) *env {
	t.Helper()
	portsOnce.Do(func() {
		httpPort, httpsPort = freePort(t), freePort(t)
	})
	rec := &failRecorder{TB: t}
	e := &env{
		t:      t,
		tb:     rec,
		tester: caddytest.NewTester(rec),
		client: newClient(16),
	}
	t.Cleanup(e.cleanup)
	return e
}

func newClient(conns int) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			MaxIdleConnsPerHost: conns,
			DisableCompression:  true,
		},
		Timeout: 20 * time.Second,
	}
}

func (e *env) cleanup() {
	if e.t.Failed() && e.loaded {
		if rep, err := fetchReport(); err == nil {
			b, _ := json.MarshalIndent(rep, "", "  ")
			e.t.Logf("/lbx/upstreams at failure:\n%s", b)
		}
	}
	if e.loaded {
		// Unload the test's sites so nothing keeps probing or
		// referencing its backends.
		if err := postConfig(globalOptions()); err != nil {
			e.t.Errorf("unloading test config: %v", err)
		}
	}
	e.client.CloseIdleConnections()
	adminClient.CloseIdleConnections()
	for i := len(e.backends) - 1; i >= 0; i-- {
		e.backends[i].close()
	}
}

func globalOptions() string { return globalOptionsWith("") }

// globalOptionsWith is globalOptions with more options (tab-indented
// lines) at the end of the block.
func globalOptionsWith(extra string) string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin %s
	http_port %d
	https_port %d
	default_bind 127.0.0.1
	auto_https off
	grace_period 1ns
	servers {
		# h2c lets a test send Caddy a request body of unknown
		# length without chunked framing (HTTP/2).
		protocols h1 h2c
	}
%s}
`, adminAddr, httpPort, httpsPort, extra)
}

// load reloads Caddy with a single site on the test port whose body is
// site, and stops the test if the config does not load.
func (e *env) load(site string) {
	e.t.Helper()
	e.loadFull(fmt.Sprintf(":%d {\n%s\n}\n", httpPort, site))
}

// loadFull reloads Caddy with the global options followed by sites.
func (e *env) loadFull(sites string) {
	e.t.Helper()
	e.loadWith("", sites)
}

// loadWith reloads Caddy with the global options, more of them (extra),
// and sites.
func (e *env) loadWith(extra, sites string) {
	e.t.Helper()
	e.loadCaddyfile(globalOptionsWith(extra) + sites)
}

// loadCaddyfile reloads Caddy with a whole Caddyfile, its own global
// options included.
func (e *env) loadCaddyfile(caddyfile string) {
	e.t.Helper()
	e.loaded = true
	e.tb.failed.Store(false)
	waitOldAdminGone(e.t)
	e.tester.InitServer(caddyfile, "caddyfile")
	if e.tb.failed.Load() {
		e.t.FailNow()
	}
	// (a stock least_conn phase lost a request to EOF in CI without it)
	lbxtest.SettleReload(e.t, e.client, httpPort)
}

// waitOldAdminGone waits until one socket at most listens on the admin
// port. Every load replaces Caddy's admin server and stops the old one
// after answering; until its socket closes, the kernel may hand it a new
// connection and reset it as it closes (SO_REUSEPORT). caddytest's
// InitServer starts by probing the admin API once, and on a failed probe
// starts a second Caddy of its own with a bare config (CI saw "POSTed
// configuration isn't active" after such a reset).
func waitOldAdminGone(t testing.TB) {
	t.Helper()
	_, portText, _ := strings.Cut(adminAddr, ":")
	port, _ := strconv.Atoi(portText)
	lbxtest.WaitOneListener(t, port, "admin")
}

// failRecorder is the testing.TB handed to caddytest: it notes whether
// InitServer itself failed, which t.Failed() cannot tell once an earlier
// check of the same test has failed.
type failRecorder struct {
	testing.TB
	failed atomic.Bool
}

func (f *failRecorder) Fail() { f.failed.Store(true); f.TB.Fail() }

func (f *failRecorder) Error(args ...any) { f.failed.Store(true); f.TB.Error(args...) }

func (f *failRecorder) Errorf(format string, args ...any) {
	f.failed.Store(true)
	f.TB.Errorf(format, args...)
}

// postConfig loads a Caddyfile through the admin API directly (used in
// cleanup, where the tester's own bookkeeping is not wanted).
func postConfig(caddyfile string) error {
	status, body, err := lbxtest.PostLoad(adminClient, "http://"+adminAddr, "text/caddyfile", []byte(caddyfile))
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return fmt.Errorf("status %d: %s", status, body)
	}
	return nil
}

func (e *env) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", httpPort, path)
}

// get sends GET path through Caddy and returns the status, the backend
// that answered (its X-Backend header) and the body.
func (e *env) get(path string) (status int, backendName string, body []byte, err error) {
	return doGet(e.client, e.url(path))
}

func doGet(c *http.Client, url string) (int, string, []byte, error) {
	res, err := c.Get(url)
	if err != nil {
		return 0, "", nil, err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	return res.StatusCode, res.Header.Get("X-Backend"), body, err
}

// mustGet is get that fails the test on a transport error or a status
// other than 200, and returns the answering backend.
func (e *env) mustGet(path string) string {
	e.t.Helper()
	status, name, body, err := e.get(path)
	if err != nil {
		e.t.Fatalf("GET %s: %v", path, err)
	}
	if status != http.StatusOK {
		e.t.Fatalf("GET %s: status %d, body %q", path, status, body)
	}
	return name
}

// loadResult is what a closed-loop load run saw.
type loadResult struct {
	counts   map[string]int // answering backend → requests
	total    int
	errors   []string      // one line per failed request
	statuses map[int]int   // status → requests; 0 for transport errors
	longest  time.Duration // the slowest request
}

func (r loadResult) share(name string) float64 {
	if r.total == 0 {
		return 0
	}
	return float64(r.counts[name]) / float64(r.total)
}

// drive sends n GET requests for path through Caddy from conc concurrent
// workers as fast as they go (closed loop) and counts which backend
// answered each. It returns when every worker has finished.
func (e *env) drive(path string, n, conc int) loadResult {
	return e.drivePaced(path, n, conc, 0)
}

// drivePaths is drive with request i for path(i).
func (e *env) drivePaths(n, conc int, path func(i int) string) loadResult {
	return e.drivePacedPaths(n, conc, 0, path)
}

// drivePaced is drive with request i due at start + i×interval: an open
// loop at a fixed rate, capped at conc requests in flight. Requests are
// sent on schedule, not when earlier ones finish, so a slow backend does
// not slow the arrival rate down.
func (e *env) drivePaced(path string, n, conc int, interval time.Duration) loadResult {
	return e.drivePacedPaths(n, conc, interval, func(int) string { return path })
}

func (e *env) drivePacedPaths(n, conc int, interval time.Duration, path func(i int) string) loadResult {
	var (
		next  atomic.Int64
		mu    sync.Mutex
		res   = loadResult{counts: map[string]int{}, statuses: map[int]int{}}
		wg    sync.WaitGroup
		start = time.Now()
	)
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				if interval > 0 {
					time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
				}
				sent := time.Now()
				status, name, body, err := e.get(path(int(i)))
				took := time.Since(sent)
				mu.Lock()
				res.total++
				res.statuses[status]++
				res.longest = max(res.longest, took)
				switch {
				case err != nil:
					res.errors = append(res.errors, err.Error())
				case status != http.StatusOK:
					res.errors = append(res.errors, fmt.Sprintf("status %d: %.80q", status, body))
				default:
					res.counts[name]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return res
}

// waitFor waits on a condition with a deadline (see lbxtest.WaitFor).
var waitFor = lbxtest.WaitFor

// ---- backends ----

// seenRequest is what a backend recorded about one (non-health) request.
type seenRequest struct {
	Proto         string
	ProtoMajor    int
	TLS           bool
	RemoteAddr    string
	Host          string
	Header        http.Header
	ContentLength int64
	Chunked       bool
	Trailer       http.Header
	Body          []byte
}

// backend is a real HTTP server on 127.0.0.1. It answers /health with
// healthCode (200 unless set) and every other path, after an optional
// delay that ends early if the request is cancelled, with an X-Backend
// header naming itself and either status (when set, with no body) or 200
// and its name as the body.
type backend struct {
	name string
	addr string // host:port
	srv  *httptest.Server

	healthCode atomic.Int32
	status     atomic.Int32 // when set, every non-health request is answered with it
	delay      atomic.Int64 // ns added to every non-health request

	hits       atomic.Int64 // non-health requests
	healthHits atomic.Int64
	active     atomic.Int64 // non-health requests being served
	cancelled  atomic.Int64 // delayed requests whose context ended first

	mu   sync.Mutex
	seen []seenRequest

	closeOnce sync.Once
}

type backendKind int

const (
	plainHTTP  backendKind = iota
	tlsHTTP                // HTTPS, HTTP/1.1 and HTTP/2 by ALPN
	h2cHTTP                // cleartext, HTTP/1.1 and HTTP/2 with prior knowledge
	proxyProto             // cleartext HTTP/1.1 behind a PROXY protocol listener (header required)
)

// startBackends starts n plain HTTP backends named b0, b1, ….
func (e *env) startBackends(n int) []*backend {
	e.t.Helper()
	bs := make([]*backend, n)
	for i := range bs {
		bs[i] = e.backend(fmt.Sprintf("b%d", i), plainHTTP)
	}
	return bs
}

// backend starts a backend of the given kind; it is closed in the test's
// cleanup, after Caddy has let go of it.
func (e *env) backend(name string, kind backendKind) *backend {
	e.t.Helper()
	b := &backend{name: name}
	b.healthCode.Store(http.StatusOK)
	b.srv = httptest.NewUnstartedServer(b)
	switch kind {
	case plainHTTP:
		b.srv.Start()
	case tlsHTTP:
		b.srv.TLS = &tls.Config{NextProtos: []string{"h2", "http/1.1"}}
		b.srv.EnableHTTP2 = true
		b.srv.StartTLS()
	case h2cHTTP:
		p := new(http.Protocols)
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		b.srv.Config.Protocols = p
		b.srv.Start()
	case proxyProto:
		// No policy set: go-proxyproto requires the header.
		b.srv.Listener = &proxyproto.Listener{Listener: b.srv.Listener}
		b.srv.Start()
	}
	b.addr = b.srv.Listener.Addr().String()
	e.backends = append(e.backends, b)
	return b
}

func (b *backend) close() { b.closeOnce.Do(b.srv.Close) }

func (b *backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/health" {
		b.healthHits.Add(1)
		w.WriteHeader(int(b.healthCode.Load()))
		return
	}
	b.active.Add(1)
	defer b.active.Add(-1)
	body, _ := io.ReadAll(r.Body)
	b.mu.Lock()
	b.seen = append(b.seen, seenRequest{
		Proto:         r.Proto,
		ProtoMajor:    r.ProtoMajor,
		TLS:           r.TLS != nil,
		RemoteAddr:    r.RemoteAddr,
		Host:          r.Host,
		Header:        r.Header.Clone(),
		ContentLength: r.ContentLength,
		Chunked:       slices.Contains(r.TransferEncoding, "chunked"),
		Trailer:       r.Trailer.Clone(),
		Body:          body,
	})
	b.mu.Unlock()
	b.hits.Add(1)
	if d := time.Duration(b.delay.Load()); d > 0 {
		timer := time.NewTimer(d)
		select {
		case <-timer.C:
		case <-r.Context().Done():
			timer.Stop()
			b.cancelled.Add(1)
			return
		}
	}
	w.Header().Set("X-Backend", b.name)
	if code := b.status.Load(); code != 0 {
		w.WriteHeader(int(code))
		return
	}
	if n, err := strconv.Atoi(r.URL.Query().Get("size")); err == nil && n > 0 {
		w.Header().Set("Content-Length", strconv.Itoa(n))
		_, _ = w.Write(payload(n))
		return
	}
	_, _ = io.WriteString(w, b.name)
}

// requests returns a copy of what the backend recorded.
func (b *backend) requests() []seenRequest {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.seen)
}

// last returns the most recent recorded request; the test fails if there is none.
func (b *backend) last(t *testing.T) seenRequest {
	t.Helper()
	rs := b.requests()
	if len(rs) == 0 {
		t.Fatalf("backend %s saw no request", b.name)
	}
	return rs[len(rs)-1]
}

// payload returns n deterministic bytes.
func payload(n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte('a' + i%23)
	}
	return p
}

func dials(bs ...*backend) string {
	addrs := make([]string, len(bs))
	for i, b := range bs {
		addrs[i] = b.addr
	}
	return strings.Join(addrs, " ")
}

// ---- admin API ----

// The shapes below mirror the documented JSON of GET /lbx/upstreams; they
// are declared here rather than imported so the test checks the wire format.

type upstreamInfo struct {
	Dial       string  `json:"dial"`
	Reason     string  `json:"ejection_reason"`
	EstimateMs float64 `json:"answer_median_ms"`
	Samples    uint64  `json:"samples"`
	Failures   uint64  `json:"failures"`
	InFlight   int     `json:"in_flight"`
	Pending    int64   `json:"awaiting_headers"`
	EjectedMs  float64 `json:"ejected_for_ms"`
	Ejections  uint64  `json:"ejections_total"`
}

type poolMember struct {
	Dial       string   `json:"dial"`
	Weight     float64  `json:"weight"`
	Healthy    bool     `json:"caddy_healthy"`
	Available  bool     `json:"available"`
	EstimateMs *float64 `json:"expected_ms"`
	SlowStart  *float64 `json:"slow_start_weight_percent"`
}

type poolInfo struct {
	Policy         string       `json:"policy"`
	Upstreams      []poolMember `json:"upstreams"`
	Available      int          `json:"available"`
	PanicThreshold float64      `json:"panic_threshold_percent"`
	Panic          bool         `json:"panic"`
	PanicEntered   uint64       `json:"panic_entered_total"`
	RetryBudget    *struct {
		InFlight int64  `json:"retries_in_flight"`
		Refused  uint64 `json:"retries_refused_total"`
	} `json:"retry_budget"`
}

type adminReport struct {
	Upstreams []upstreamInfo `json:"upstreams"`
	Pools     []poolInfo     `json:"pools"`
}

func fetchReport() (adminReport, error) {
	var rep adminReport
	res, err := adminClient.Get("http://" + adminAddr + "/lbx/upstreams?limit=1000")
	if err != nil {
		return rep, err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	if err != nil {
		return rep, err
	}
	if res.StatusCode != http.StatusOK {
		return rep, fmt.Errorf("GET /lbx/upstreams: status %d: %s", res.StatusCode, body)
	}
	if err := json.Unmarshal(body, &rep); err != nil {
		return rep, fmt.Errorf("decoding /lbx/upstreams: %v: %s", err, body)
	}
	return rep, nil
}

func report(t *testing.T) adminReport {
	t.Helper()
	rep, err := fetchReport()
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// upstream returns the entry for dial, if listed.
func (r adminReport) upstream(dial string) (upstreamInfo, bool) {
	for _, u := range r.Upstreams {
		if u.Dial == dial {
			return u, true
		}
	}
	return upstreamInfo{}, false
}

// pool returns the pool whose members are exactly bs, in order.
func (r adminReport) pool(bs ...*backend) (poolInfo, bool) {
	for _, p := range r.Pools {
		if len(p.Upstreams) != len(bs) {
			continue
		}
		match := true
		for i, m := range p.Upstreams {
			if m.Dial != bs[i].addr {
				match = false
				break
			}
		}
		if match {
			return p, true
		}
	}
	return poolInfo{}, false
}

// waitPool polls the admin API, sending a request through path first each
// time (a pool is counted when it selects), until the pool of bs satisfies
// cond.
func (e *env) waitPool(path, what string, cond func(poolInfo) bool, bs ...*backend) poolInfo {
	e.t.Helper()
	var got poolInfo
	waitFor(e.t, 10*time.Second, what, func() (bool, string) {
		_, _, _, _ = e.get(path)
		rep, err := fetchReport()
		if err != nil {
			return false, err.Error()
		}
		p, ok := rep.pool(bs...)
		if !ok {
			return false, "pool not listed"
		}
		got = p
		return cond(p), fmt.Sprintf("%+v", p)
	})
	return got
}

// healthyMembers returns which members a pool report shows as available.
func healthyMembers(p poolInfo) []string {
	var out []string
	for _, m := range p.Upstreams {
		if m.Available {
			out = append(out, m.Dial)
		}
	}
	return out
}

// cancelAfter returns a context cancelled once cond holds (polled), and a
// function that stops the watcher and waits for it.
func cancelAfter(cond func() bool) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	stop := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if cond() {
					cancel()
					return
				}
			}
		}
	}()
	return ctx, func() { close(stop); <-done; cancel() }
}
