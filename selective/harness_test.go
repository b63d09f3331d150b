package selective

// Tests run a real, in-process Caddy (caddytest) against real backends on
// 127.0.0.1. This package's Caddy has its own ports, chosen once per test
// binary.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-lbx/lbx/lbpolicy"
	"github.com/caddy-lbx/lbx/lbxtest"
	_ "github.com/caddy-lbx/lbx/partition"
)

func TestMain(m *testing.M) {
	lbxtest.RunCheckingLeaks(m, "selective.(*attempt).run", "selective.(*call).run")
}

var (
	portsOnce           sync.Once
	adminPort, httpPort int
)

var freePort = lbxtest.FreePort

// env is one test's Caddy and backends.
type env struct {
	t      *testing.T
	tester *caddytest.Tester
	client *http.Client
	loaded bool
}

func newEnv(t *testing.T) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("starts Caddy")
	}
	portsOnce.Do(func() { adminPort, httpPort = freePort(t), freePort(t) })
	e := &env{
		t: t,
		tester: caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{
			AdminPort:          adminPort,
			LoadRequestTimeout: 10 * time.Second,
		}),
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 20 * time.Second},
	}
	t.Cleanup(func() {
		if e.loaded {
			if err := e.post(globalOptions()); err != nil {
				t.Errorf("unloading the test config: %v", err)
			}
		}
		e.client.CloseIdleConnections()
	})
	return e
}

func globalOptions() string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	default_bind 127.0.0.1
	auto_https off
	grace_period 1ns
}
`, adminPort, httpPort)
}

// load runs Caddy with one site on the test port whose body is site.
func (e *env) load(site string) {
	e.t.Helper()
	e.loaded = true
	lbxtest.WaitOneListener(e.t, adminPort, "admin")
	e.tester.InitServer(globalOptions()+fmt.Sprintf(":%d {\n%s\n}\n", httpPort, site), "caddyfile")
	if e.t.Failed() {
		e.t.FailNow()
	}
	// (stock Caddy drops about one keep-alive request per reload on this
	// machine without it; measured at stop 16)
	lbxtest.SettleReload(e.t, e.client, httpPort)
}

// loadErr pushes site through POST /load on the serving Caddy and returns
// the admin API's answer as an error, if any.
func (e *env) loadErr(site string) error {
	return e.post(globalOptions() + fmt.Sprintf(":%d {\n%s\n}\n", httpPort, site))
}

func (e *env) post(caddyfile string) error {
	status, b, err := lbxtest.PostLoad(http.DefaultClient, fmt.Sprintf("http://localhost:%d", adminPort), "text/caddyfile", []byte(caddyfile))
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		var msg struct{ Error string }
		if json.Unmarshal(b, &msg) == nil && msg.Error != "" {
			return fmt.Errorf("status %d: %s", status, msg.Error)
		}
		return fmt.Errorf("status %d: %s", status, b)
	}
	return nil
}

// reply is what the client got.
type reply struct {
	status int
	header http.Header
	body   string
	err    error
}

// do sends a request with the given method, path and headers (pairs).
func (e *env) do(method, path string, header ...string) reply {
	req, err := http.NewRequest(method, fmt.Sprintf("http://127.0.0.1:%d%s", httpPort, path), nil)
	if err != nil {
		return reply{err: err}
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := e.client.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return reply{status: res.StatusCode, header: res.Header, body: string(b), err: err}
}

func (e *env) get(path string, header ...string) reply {
	e.t.Helper()
	r := e.do(http.MethodGet, path, header...)
	if r.err != nil {
		e.t.Fatalf("GET %s: %v", path, r.err)
	}
	return r
}

// admin reads GET /lbx/selective.
func (e *env) admin() selectiveStatus {
	e.t.Helper()
	res, err := http.Get(fmt.Sprintf("http://localhost:%d/lbx/selective", adminPort))
	if err != nil {
		e.t.Fatal(err)
	}
	defer res.Body.Close()
	var v selectiveStatus
	if err := json.NewDecoder(res.Body).Decode(&v); err != nil {
		e.t.Fatal(err)
	}
	return v
}

// backend is a real HTTP server on 127.0.0.1 that answers with its name,
// after delay, with status (200 when 0), and counts what it saw,
// including requests cancelled while it waited.
type backend struct {
	name      string
	addr      string
	srv       *httptest.Server
	delay     atomic.Int64 // ns
	status    atomic.Int64
	health    atomic.Int64 // status of GET /health; 200 when 0
	hits      atomic.Int64
	cancelled atomic.Int64
	arrived   atomic.Int64 // requests whose headers arrived, body read or not
	partial   atomic.Int64 // requests whose body broke off
}

func (e *env) backend(name string) *backend {
	b := &backend{name: name}
	b.srv = httptest.NewServer(b)
	b.addr = b.srv.Listener.Addr().String()
	e.t.Cleanup(b.srv.Close)
	return b
}

func (b *backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/health" {
		if s := b.health.Load(); s != 0 {
			w.WriteHeader(int(s))
		}
		return
	}
	b.arrived.Add(1)
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		b.partial.Add(1)
	}
	b.hits.Add(1)
	if d := time.Duration(b.delay.Load()); d > 0 {
		select {
		case <-time.After(d):
		case <-r.Context().Done():
			b.cancelled.Add(1)
			return
		}
	}
	if s := b.status.Load(); s != 0 {
		w.WriteHeader(int(s))
	}
	_, _ = io.WriteString(w, b.name)
}

// waitFor waits on a condition with a deadline.
var waitFor = lbxtest.WaitFor
