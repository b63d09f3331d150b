package partition

// A harness for tests against a real, in-process Caddy (caddytest) and
// real backends on 127.0.0.1, after integration/helpers_test.go. This
// package's Caddy has its own admin port, chosen once per test binary, so
// it never talks to another package's test Caddy.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/caddy-lbx/lbx/lbxtest"
)

var (
	portsOnce                      sync.Once
	adminPort, httpPort, httpsPort int
	adminClient                    = &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
)

var freePort = lbxtest.FreePort

// env is one test's harness. Its cleanup unloads the test's config, closes
// the backends and checks that no goroutine of this package is left.
type env struct {
	t        *testing.T
	tester   *caddytest.Tester
	client   *http.Client
	backends []*backend
	loaded   bool
	// global is added to the global options of every config this test
	// loads (e.g. a log block).
	global string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("starts Caddy")
	}
	portsOnce.Do(func() {
		adminPort, httpPort, httpsPort = freePort(t), freePort(t), freePort(t)
	})
	e := &env{
		t: t,
		tester: caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{
			AdminPort:          adminPort,
			LoadRequestTimeout: 10 * time.Second,
		}),
		client: &http.Client{
			Transport: &http.Transport{MaxIdleConnsPerHost: 32, DisableCompression: true},
			Timeout:   20 * time.Second,
		},
	}
	t.Cleanup(e.cleanup)
	return e
}

func (e *env) cleanup() {
	if e.loaded {
		if err := postConfig(globalOptions()); err != nil {
			e.t.Errorf("unloading test config: %v", err)
		}
	}
	e.client.CloseIdleConnections()
	adminClient.CloseIdleConnections()
	for i := len(e.backends) - 1; i >= 0; i-- {
		e.backends[i].close()
	}
	checkNoLeak(e.t)
}

// checkNoLeak waits until no goroutine runs this package's non-test code.
func checkNoLeak(t *testing.T) {
	t.Helper()
	ours := []string{
		"partition.(*Handler).",
		"partition.(*FanOut).",
		"partition.(*Parallel).",
		"partition.(*namingWatcher).run",
		"partition.(*serfWatcher).run",
	}
	var last string
	deadline := time.Now().Add(5 * time.Second)
	for {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		last = ""
		for _, g := range strings.Split(string(buf), "\n\n") {
			for _, f := range ours {
				if strings.Contains(g, f) {
					last = g
				}
			}
		}
		if last == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("goroutine left running:\n%s", last)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// globalOptions returns the test Caddy's global options block, with extra
// lines added inside it.
func globalOptions(extra ...string) string {
	var more strings.Builder
	for _, l := range extra {
		if l != "" {
			more.WriteString("\t" + l + "\n")
		}
	}
	return fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	default_bind 127.0.0.1
	auto_https off
	grace_period 1ns
%s}
`, adminPort, httpPort, httpsPort, more.String())
}

// load reloads Caddy with one site on the test port whose body is site.
func (e *env) load(site string) {
	e.t.Helper()
	e.loaded = true
	lbxtest.WaitOneListener(e.t, adminPort, "admin")
	e.tester.InitServer(globalOptions(e.global)+fmt.Sprintf(":%d {\n%s\n}\n", httpPort, site), "caddyfile")
	if e.t.Failed() {
		e.t.FailNow()
	}
	// a POST right after a reload lost to EOF in CI without it
	lbxtest.SettleReload(e.t, e.client, httpPort)
}

// loadErr tries to load site and returns the admin API's error, if any.
func (e *env) loadErr(site string) error {
	e.t.Helper()
	e.load("\trespond ok") // starts the in-process Caddy if need be
	return postConfig(globalOptions(e.global) + fmt.Sprintf(":%d {\n%s\n}\n", httpPort, site))
}

func postConfig(caddyfile string) error { return post("text/caddyfile", caddyfile) }

func postJSON(cfg string) error { return post("application/json", cfg) }

func post(contentType, cfg string) error {
	status, body, err := lbxtest.PostLoad(adminClient, fmt.Sprintf("http://localhost:%d", adminPort), contentType, []byte(cfg))
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

// response is what the client got.
type response struct {
	status int
	header http.Header
	body   string
}

func (e *env) do(req *http.Request) (response, error) {
	res, err := e.client.Do(req)
	if err != nil {
		return response{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return response{status: res.StatusCode, header: res.Header, body: string(b)}, err
}

func (e *env) get(path string) response {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.url(path), nil)
	if err != nil {
		e.t.Fatal(err)
	}
	res, err := e.do(req)
	if err != nil {
		e.t.Fatalf("GET %s: %v", path, err)
	}
	return res
}

// waitFor waits on a condition with a deadline (see lbxtest.WaitFor).
var waitFor = lbxtest.WaitFor

// ---- backends ----

// backend is a real HTTP server on 127.0.0.1. By default it answers with
// JSON naming itself and the partition the request was for (from the
// X-Partition header that the test configs set with header_up):
//
//	{"items":[<index>],"by":{"p<index>":"<name>"},"count":<count>}
//
// handler, when set, replaces that.
type backend struct {
	name string
	addr string
	srv  *httptest.Server

	handler atomic.Pointer[func(b *backend, w http.ResponseWriter, r *http.Request)]

	hits      atomic.Int64
	cancelled atomic.Int64 // requests whose context was cancelled while the handler waited

	mu   sync.Mutex
	seen []seen
}

type seen struct {
	header http.Header
	body   string
}

func (e *env) backend(name string) *backend {
	e.t.Helper()
	b := &backend{name: name}
	b.srv = httptest.NewServer(b)
	b.addr = b.srv.Listener.Addr().String()
	e.backends = append(e.backends, b)
	return b
}

func (b *backend) close() { b.srv.Close() }

// deadAddr returns the address of a backend that was closed: a
// connection to it is refused.
func (e *env) deadAddr() string {
	e.t.Helper()
	dead := e.backend("dead")
	dead.close()
	return dead.addr
}

// loadDeadReplica loads a site of two schemes with passive health checks:
// scheme 0/1 has one replica, which refuses connections (at the returned
// address), and scheme 0/2 1/2 two that answer.
func (e *env) loadDeadReplica() (ok0, ok1 *backend, deadAddr string) {
	e.t.Helper()
	ok0, ok1 = e.backend("ok0"), e.backend("ok1")
	deadAddr = e.deadAddr()
	e.load(partitionSite([]string{deadAddr + " 0/1", ok0.addr + " 0/2", ok1.addr + " 1/2"},
		"fail_duration 1m", "max_fails 1"))
	return ok0, ok1, deadAddr
}

func (b *backend) setHandler(f func(b *backend, w http.ResponseWriter, r *http.Request)) {
	b.handler.Store(&f)
}

func (b *backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	b.mu.Lock()
	b.seen = append(b.seen, seen{header: r.Header.Clone(), body: string(body)})
	b.mu.Unlock()
	b.hits.Add(1)
	if f := b.handler.Load(); f != nil {
		(*f)(b, w, r)
		return
	}
	idx, cnt, _ := strings.Cut(r.Header.Get("X-Partition"), "/")
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"items": []any{json.Number(idx)},
		"by":    map[string]any{"p" + idx: b.name},
		"count": json.Number(cnt),
	})
}

// waitCancelled blocks until the request's context ends and counts it.
func (b *backend) waitCancelled(r *http.Request) {
	<-r.Context().Done()
	b.cancelled.Add(1)
}

func (b *backend) requests() []seen {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]seen(nil), b.seen...)
}
