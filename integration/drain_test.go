package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// The drain recipe's timings, shortened from examples/drain.Caddyfile's.
const (
	drainDelay = 2 * time.Second
	drainGrace = 3 * time.Second
)

// drainRecipePath is the recipe the tests run.
const drainRecipePath = "../examples/drain.Caddyfile"

// The drain recipe, end to end, in a real Caddy process built from
// ./cmd/caddy and stopped the way orchestrators stop it, with SIGTERM:
//
//   - during shutdown_delay, /ready answers 503 while proxied requests on
//     new connections still answer 200;
//   - a request in flight when the signal came finishes within
//     grace_period, after the listener has closed;
//   - the process exits by itself with status 0 as soon as that request
//     is done, and logs no error.
//
// The config is examples/drain.Caddyfile itself with free loopback ports,
// the delays above, default_bind 127.0.0.1, and the test's own backends as
// the upstreams (they can hold a request open).
func TestDrainRecipeSIGTERM(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("SIGTERM is POSIX")
	}
	bin := drainBuildCaddy(t)
	hb := startDrainBackends(t, 2)
	cfg := drainProcessConfig(t, hb.addrs())
	front := "http://" + cfg.front
	proc := startDrainCaddy(t, bin, cfg.text)

	// A new connection per request, as an outer load balancer's probe
	// would open: after the listener closes every request is refused.
	probe := &http.Client{
		Transport: &http.Transport{DisableKeepAlives: true},
		Timeout:   10 * time.Second,
	}
	defer probe.CloseIdleConnections()

	waitFor(t, 30*time.Second, "caddy to serve the recipe", func() (bool, string) {
		if proc.Exited() {
			t.Fatalf("caddy exited before serving: %v\nstderr:\n%s", proc.WaitErr(), proc.Log())
		}
		status, body, err := drainGet(probe, front+"/ready")
		if err != nil || status != http.StatusOK || body != "ready" {
			return false, fmt.Sprintf("/ready: %d %q %v", status, body, err)
		}
		status, body, err = drainGet(probe, front+"/warm")
		return err == nil && status == http.StatusOK, fmt.Sprintf("/warm: %d %q %v", status, body, err)
	})

	// A long request, in flight (held by a backend) before the signal.
	type result struct {
		status int
		body   string
		err    error
		at     time.Time
	}
	long := make(chan result, 1)
	var wg sync.WaitGroup
	t.Cleanup(func() {
		hb.releaseAll() // the request ends whether or not Caddy still runs
		wg.Wait()
	})
	longClient := &http.Client{Transport: &http.Transport{}, Timeout: 30 * time.Second}
	defer longClient.CloseIdleConnections()
	wg.Add(1)
	go func() {
		defer wg.Done()
		status, body, err := drainGet(longClient, front+"/hold")
		long <- result{status, body, err, time.Now()}
	}()
	select {
	case <-hb.arrived:
	case r := <-long:
		t.Fatalf("the long request ended before reaching a backend: %d %q %v", r.status, r.body, r.err)
	case <-time.After(10 * time.Second):
		t.Fatal("the long request did not reach a backend within 10s")
	}

	// A kept-alive client that never retries (Python's http.client, say):
	// during the delay its next response says Connection: close, so it
	// leaves at a response boundary instead of racing the close of its
	// idle connection when the delay ends (the recipe's rebalance_close).
	kept := dialKeptAlive(t, cfg.front)
	if closed := kept.get(t, "/kept-before"); closed {
		t.Fatal("before SIGTERM, a kept-alive response says Connection: close")
	}
	keptChecked := false

	sent := time.Now()
	if err := proc.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("sending SIGTERM: %v", err)
	}

	// The shutdown delay: poll /ready and a proxied request on new
	// connections until the listener closes.
	var (
		drainingSeen, proxiedWhileDraining int
		closedAt                           time.Time
		untilShutdown                      []string
	)
	waitFor(t, drainDelay+10*time.Second, "the listener to close after shutdown_delay", func() (bool, string) {
		// A connection accepted in the instant the delay ends is closed
		// by the shutdown before it is answered: EOF or a reset then means
		// the same as a refused connection, but only once the delay is over.
		closing := func(err error) bool {
			return errors.Is(err, syscall.ECONNREFUSED) ||
				time.Since(sent) >= drainDelay && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET))
		}
		status, body, err := drainGet(probe, front+"/ready")
		if err != nil {
			if !closing(err) {
				t.Fatalf("/ready after SIGTERM: %v; want 200, 503 or, once the delay is over, connection refused", err)
			}
			closedAt = time.Now()
			return true, ""
		}
		switch {
		case status == http.StatusOK && drainingSeen == 0:
			return false, "not draining yet" // the signal is still on its way
		case status == http.StatusServiceUnavailable && strings.HasPrefix(body, "draining: shutting down in "):
			drainingSeen++
			untilShutdown = append(untilShutdown, strings.TrimPrefix(body, "draining: shutting down in "))
			if !keptChecked {
				keptChecked = true
				if closed := kept.get(t, "/kept-while-draining"); !closed {
					t.Fatal("during shutdown_delay, a response on a kept-alive connection does not say Connection: close")
				}
			}
		default:
			t.Fatalf("/ready after SIGTERM (%d draining answers seen): %d %q; want 503 and a draining body", drainingSeen, status, body)
		}
		status, body, err = drainGet(probe, front+"/during-delay")
		switch {
		case closing(err):
			closedAt = time.Now()
			return true, ""
		case err != nil || status != http.StatusOK || !strings.HasPrefix(body, "ok from "):
			t.Fatalf("proxied request while draining: %d %q %v; want 200 from a backend", status, body, err)
		}
		proxiedWhileDraining++
		return false, fmt.Sprintf("%d draining answers, %d proxied", drainingSeen, proxiedWhileDraining)
	})
	if drainingSeen == 0 || proxiedWhileDraining == 0 {
		t.Fatalf("during shutdown_delay (listener closed %v after SIGTERM): %d /ready 503s and %d proxied 200s; want both",
			closedAt.Sub(sent).Round(time.Millisecond), drainingSeen, proxiedWhileDraining)
	}
	t.Logf("shutdown delay: listener closed %v after SIGTERM; %d× /ready 503 (time until shutdown %v … %v), %d proxied 200s meanwhile",
		closedAt.Sub(sent).Round(time.Millisecond), drainingSeen, untilShutdown[0], untilShutdown[len(untilShutdown)-1], proxiedWhileDraining)
	// A request served in the instant between the end of the delay and the
	// listener closing sees a slightly negative countdown (Caddy computes
	// it from the scheduled time): allow that, not more.
	const lateBy = 500 * time.Millisecond
	for _, s := range untilShutdown {
		if d, err := time.ParseDuration(s); err != nil || d <= -lateBy || d > drainDelay {
			t.Errorf("{http.time_until_shutdown} rendered %q; want a duration in (-%v, %v]", s, lateBy, drainDelay)
		}
	}
	if got := closedAt.Sub(sent); got < drainDelay {
		t.Errorf("listener closed %v after SIGTERM, before shutdown_delay %v was over", got, drainDelay)
	}

	// The grace period: the long request is still in flight, through the
	// ewma policy (the admin API, still up, shows it), until released.
	select {
	case r := <-long:
		t.Fatalf("the long request ended before it was released: %d %q %v", r.status, r.body, r.err)
	default:
	}
	waitFor(t, drainGrace, "the admin API to show the held request in flight", func() (bool, string) {
		res, err := probe.Get("http://" + cfg.admin + "/lbx/upstreams")
		if err != nil {
			return false, err.Error()
		}
		defer res.Body.Close()
		var rep adminReport
		if err := json.NewDecoder(res.Body).Decode(&rep); err != nil {
			return false, err.Error()
		}
		for _, u := range rep.Upstreams {
			if u.InFlight > 0 {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%+v", rep.Upstreams)
	})
	released := time.Now()
	hb.releaseAll()
	var r result
	select {
	case r = <-long:
	case <-time.After(drainGrace + 5*time.Second):
		t.Fatalf("the long request did not finish within grace_period %v (+5s) of its release", drainGrace)
	}
	if r.err != nil || r.status != http.StatusOK || r.body != "held request done" {
		t.Fatalf("the long request in flight during shutdown: %d %q %v; want 200 \"held request done\"", r.status, r.body, r.err)
	}
	if got := r.at.Sub(closedAt); got >= drainGrace {
		t.Errorf("the long request finished %v into the grace period of %v", got, drainGrace)
	}

	// The exit: by itself, status 0, as soon as nothing is in flight.
	select {
	case <-proc.Done():
	case <-time.After(time.Until(sent.Add(drainDelay + drainGrace + 5*time.Second))):
		t.Fatalf("caddy still running %v after SIGTERM (delay %v + grace %v + 5s margin)", time.Since(sent).Round(time.Millisecond), drainDelay, drainGrace)
	}
	exitAt := time.Now()
	t.Logf("exit %v after SIGTERM, %v after the last request was released", exitAt.Sub(sent).Round(time.Millisecond), exitAt.Sub(released).Round(time.Millisecond))
	if proc.WaitErr() != nil {
		t.Errorf("caddy exited with %v; want status 0\nstderr:\n%s", proc.WaitErr(), proc.Log())
	}
	if got := exitAt.Sub(released); got >= drainGrace {
		t.Errorf("caddy exited %v after the last request finished: the grace period ran out instead of ending when nothing was in flight", got)
	}
	checkDrainLog(t, proc.Log())
}

// An in-process unload of the recipe's site (the same reload path every
// other test's cleanup takes) leaves no goroutine running lbx code and no
// lbx state behind.
func TestDrainUnloadStopsLbxGoroutines(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(2)
	site := drainRecipeSite(t, drainReadRecipe(t))
	site = drainReplaceUpstreams(t, site, []string{bs[0].addr, bs[1].addr})
	// And the other lbx policy, with Caddy's active health checks.
	site += fmt.Sprintf(`
	handle /p/* {
		reverse_proxy %s {
			lb_policy panic {
				policy least_conn
			}
			health_uri /health
			health_interval 100ms
		}
	}`, dials(bs...))
	e.load(site)
	status, _, body, err := e.get("/ready")
	if err != nil || status != http.StatusOK || string(body) != "ready" {
		t.Fatalf("/ready while not shutting down: %d %q %v; want 200 \"ready\"", status, body, err)
	}
	for _, path := range []string{"/", "/p/x"} {
		if r := e.drive(path, 40, 4); len(r.errors) > 0 {
			t.Fatalf("GET %s: %d of %d failed: %q", path, len(r.errors), r.total, r.errors)
		}
	}

	t.Logf("goroutines running lbx code while the recipe is loaded: %d", len(drainLbxGoroutines()))

	// The detector sees lbx code on a stack: the outlier sweep loop, and
	// a request held by a backend, which sits in the observing
	// transport's RoundTrip.
	for _, b := range bs {
		b.delay.Store(int64(5 * time.Second))
	}
	ctx, stop := cancelAfter(func() bool { return len(drainLbxGoroutines()) > 0 })
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.url("/held"), nil)
	res, err := e.client.Do(req)
	stop()
	if err == nil {
		res.Body.Close()
		t.Fatalf("no goroutine ran lbx code while a request was held in flight through lb_policy ewma (status %d); the detector is broken", res.StatusCode)
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("held request: %v; want it cancelled once lbx code was seen on a stack", err)
	}
	for _, b := range bs {
		b.delay.Store(0)
	}
	waitFor(t, 10*time.Second, "the cancelled request to leave the backends", func() (bool, string) {
		n := bs[0].active.Load() + bs[1].active.Load()
		return n == 0, fmt.Sprintf("%d active", n)
	})

	// Unload, as every test's cleanup does.
	if err := postConfig(globalOptions()); err != nil {
		t.Fatalf("unloading: %v", err)
	}
	e.loaded = false
	e.client.CloseIdleConnections()
	waitFor(t, 10*time.Second, "no goroutine running lbx code after the unload", func() (bool, string) {
		gs := drainLbxGoroutines()
		return len(gs) == 0, fmt.Sprintf("%d goroutines:\n%s", len(gs), strings.Join(gs, "\n\n"))
	})
	rep := report(t)
	for _, b := range bs {
		if u, ok := rep.upstream(b.addr); ok {
			t.Errorf("after the unload /lbx/upstreams still lists %s: %+v", b.name, u)
		}
	}
	if len(rep.Pools) > 0 {
		t.Errorf("after the unload /lbx/upstreams still lists pools: %+v", rep.Pools)
	}
}

// ---- the recipe ----

func drainReadRecipe(t *testing.T) string {
	t.Helper()
	src, err := os.ReadFile(drainRecipePath)
	if err != nil {
		t.Fatalf("reading the recipe: %v", err)
	}
	return string(src)
}

// drainReplaceOnce replaces the single match of re in s, and fails the test
// unless there is exactly one.
func drainReplaceOnce(t *testing.T, s, re, repl string) string {
	t.Helper()
	rx := regexp.MustCompile(re)
	if n := len(rx.FindAllStringIndex(s, -1)); n != 1 {
		t.Fatalf("%s: %d matches of %q; want 1", drainRecipePath, n, re)
	}
	return rx.ReplaceAllString(s, repl)
}

// drainReplaceUpstreams replaces the upstream addresses of the recipe's
// single reverse_proxy with dials.
func drainReplaceUpstreams(t *testing.T, s string, dials []string) string {
	t.Helper()
	return drainReplaceOnce(t, s, `(?m)^(\s*reverse_proxy)(?: \S+:\d+)+( \{)$`, "${1} "+strings.Join(dials, " ")+"${2}")
}

// drainRecipeSite returns the body of the recipe's first site, the one
// with the readiness route.
func drainRecipeSite(t *testing.T, src string) string {
	t.Helper()
	m := regexp.MustCompile(`(?ms)^:\d+ \{\n(.*?)\n\}$`).FindStringSubmatch(src)
	if m == nil || !strings.Contains(m[1], "handle /ready {") {
		t.Fatalf("%s: the first site must hold the readiness route (handle /ready)", drainRecipePath)
	}
	return m[1]
}

type drainConfig struct {
	text  string
	front string // host:port of the site with /ready
	admin string // host:port of the admin API
}

// drainProcessConfig is the recipe with every port replaced by a free
// one, the shortened delays, loopback binding, and dials as the upstreams.
func drainProcessConfig(t *testing.T, dials []string) drainConfig {
	t.Helper()
	src := drainReadRecipe(t)
	drainRecipeSite(t, src) // the first site is the one with /ready
	firstSite := regexp.MustCompile(`(?m)^:(\d+) \{$`).FindStringSubmatch(src)
	adminLine := regexp.MustCompile(`(?m)^\s*admin \S+:(\d+)$`).FindStringSubmatch(src)
	if firstSite == nil || adminLine == nil {
		t.Fatalf("%s: want an admin address and a site on a port", drainRecipePath)
	}

	s := drainReplaceOnce(t, src, `(?m)^(\s*shutdown_delay) \S+$`, "${1} "+drainDelay.String())
	s = drainReplaceOnce(t, s, `(?m)^(\s*grace_period) \S+$`, "${1} "+drainGrace.String())
	s = drainReplaceOnce(t, s, `(?m)^\{$`, "{\n\tdefault_bind 127.0.0.1")
	ports := map[string]string{}
	s = regexp.MustCompile(`:(\d{4,5})\b`).ReplaceAllStringFunc(s, func(m string) string {
		old := m[1:]
		if _, ok := ports[old]; !ok {
			ports[old] = strconv.Itoa(freePort(t))
		}
		return ":" + ports[old]
	})
	s = drainReplaceUpstreams(t, s, dials)
	return drainConfig{
		text:  s,
		front: "127.0.0.1:" + ports[firstSite[1]],
		admin: "localhost:" + ports[adminLine[1]],
	}
}

// ---- the process ----

// drainBuildCaddy builds ./cmd/caddy into the test's temporary directory,
// skipping the test if the go command cannot.
func drainBuildCaddy(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skipf("no go command to build cmd/caddy: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "caddy")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := fleet.BuildCaddy(ctx, "", bin); err != nil {
		t.Skip(err)
	}
	return bin
}

// startDrainCaddy runs `caddy run` on config, with its home, config and
// data directories in the test's temporary directory. The process is
// killed in the test's cleanup if it is still running, and its log shown
// if the test failed.
func startDrainCaddy(t *testing.T, bin, config string) *fleet.Proc {
	t.Helper()
	p, err := fleet.StartProc(bin, t.TempDir(), config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Kill(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("caddy's log:\n%s", p.Log())
		}
	})
	return p
}

// checkDrainLog fails the test on any error or panic in Caddy's log (JSON
// lines on stderr), naming lbx's own, on any warning from lbx, and unless
// Caddy logged that it scheduled the delayed shutdown and completed it.
func checkDrainLog(t *testing.T, log string) {
	t.Helper()
	var scheduled, complete bool
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		var entry struct {
			Level    string  `json:"level"`
			Logger   string  `json:"logger"`
			Msg      string  `json:"msg"`
			Delay    float64 `json:"delay_duration"`
			ExitCode *int    `json:"exit_code"`
		}
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			// Not a log entry: a Go panic or fatal error prints plain text.
			if strings.Contains(line, "panic") || strings.HasPrefix(line, "goroutine ") || strings.HasPrefix(line, "fatal error") {
				t.Errorf("caddy's stderr: %s", line)
			}
			continue
		}
		ours := false
		for _, name := range []string{"selection_policies.ewma", "selection_policies.panic", "lbx"} {
			ours = ours || strings.Contains(entry.Logger, name) || strings.Contains(entry.Msg, name)
		}
		level := entry.Level
		if strings.HasPrefix(entry.Msg, "[ERROR]") {
			// The standard library logger, redirected at info level:
			// Caddy reports failed Stop and Cleanup calls this way.
			level = "error"
		}
		switch level {
		case "error", "dpanic", "panic", "fatal":
			if ours {
				t.Errorf("lbx logged %s during the drain: %s", level, line)
			} else {
				t.Errorf("caddy logged %s during the drain: %s", level, line)
			}
		case "warn":
			if ours {
				t.Errorf("lbx logged a warning during the drain: %s", line)
			}
		}
		if entry.Logger == "http" && entry.Msg == "shutdown scheduled" && entry.Delay == drainDelay.Seconds() {
			scheduled = true
		}
		if entry.Msg == "shutdown complete" && entry.ExitCode != nil && *entry.ExitCode == 0 {
			complete = true
		}
	}
	if !scheduled {
		t.Errorf("caddy did not log \"shutdown scheduled\" with delay_duration %v", drainDelay.Seconds())
	}
	if !complete {
		t.Error("caddy did not log \"shutdown complete\" with exit_code 0")
	}
}

func drainGet(c *http.Client, url string) (int, string, error) {
	res, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	return res.StatusCode, string(body), err
}

// ---- backends that hold ----

// drainBackends are HTTP servers on 127.0.0.1 that answer every path at
// once with "ok from <name>", except /hold, which they answer only once
// released (or when the request is cancelled).
type drainBackends struct {
	srvs        []*httptest.Server
	arrived     chan struct{} // one value per /hold request received
	release     chan struct{}
	releaseOnce sync.Once
}

func startDrainBackends(t *testing.T, n int) *drainBackends {
	t.Helper()
	hb := &drainBackends{arrived: make(chan struct{}, 16), release: make(chan struct{})}
	for i := range n {
		name := fmt.Sprintf("h%d", i)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/hold" {
				_, _ = io.WriteString(w, "ok from "+name)
				return
			}
			select {
			case hb.arrived <- struct{}{}:
			default:
			}
			select {
			case <-hb.release:
				_, _ = io.WriteString(w, "held request done")
			case <-r.Context().Done():
			}
		}))
		hb.srvs = append(hb.srvs, srv)
		t.Cleanup(srv.Close) // registered first: runs after the release below
	}
	t.Cleanup(hb.releaseAll)
	return hb
}

func (hb *drainBackends) addrs() []string {
	out := make([]string, len(hb.srvs))
	for i, s := range hb.srvs {
		out[i] = s.Listener.Addr().String()
	}
	return out
}

func (hb *drainBackends) releaseAll() { hb.releaseOnce.Do(func() { close(hb.release) }) }

// ---- goroutines ----

// drainLbxModule is the module path of lbx.
const drainLbxModule = "github.com/caddy-lbx/lbx"

// drainLbxGoroutines returns the stacks of the goroutines running (or
// created by) lbx code other than this test package and its helpers.
func drainLbxGoroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, line := range strings.Split(g, "\n") {
			fn := strings.TrimPrefix(line, "created by ")
			if !strings.HasPrefix(fn, drainLbxModule+"/") && !strings.HasPrefix(fn, drainLbxModule+".") {
				continue // file:line lines start with a tab; headers with "goroutine"
			}
			if strings.HasPrefix(fn, drainLbxModule+"/integration") || strings.HasPrefix(fn, drainLbxModule+"/lbxtest") {
				continue // the test itself, waiting
			}
			out = append(out, g)
			break
		}
	}
	return out
}

// keptAlive is one HTTP/1.1 connection a test reuses, as a client that
// never retries: any error fails the test.
type keptAlive struct {
	conn net.Conn
	br   *bufio.Reader
}

func dialKeptAlive(t *testing.T, addr string) *keptAlive {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &keptAlive{conn: conn, br: bufio.NewReader(conn)}
}

// get sends GET path and reads a 200 response whole; it reports whether
// the response said Connection: close.
func (k *keptAlive) get(t *testing.T, path string) (closed bool) {
	t.Helper()
	k.conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(k.conn, "GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n", path); err != nil {
		t.Fatalf("kept-alive GET %s: %v", path, err)
	}
	res, err := http.ReadResponse(k.br, nil)
	if err != nil {
		t.Fatalf("kept-alive GET %s: %v", path, err)
	}
	body, err := io.ReadAll(res.Body)
	if err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("kept-alive GET %s: %d %q %v", path, res.StatusCode, body, err)
	}
	return res.Close
}
