package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// statusScreenshotEnv names the file TestStatusPage writes a screenshot of
// the page to, when set (docs/status-page.png is made so).
const statusScreenshotEnv = "LBX_STATUS_SCREENSHOT"

// findChromium returns the Chromium (or Chrome) binary to drive: the one
// LBX_CHROMIUM names, or the first on PATH. The test is skipped without
// one.
func findChromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("LBX_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("no Chromium to drive: install it (Debian: apt-get install chromium) or set LBX_CHROMIUM to its path")
	return ""
}

// startBrowser starts a headless Chromium with a fresh profile and no
// background networking, and returns its first tab's context. The browser
// is stopped, and its process checked gone by PID, when the test ends.
func startBrowser(t *testing.T, bin string) context.Context {
	t.Helper()
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(bin),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-breakpad", true),
		chromedp.Flag("password-store", "basic"),
		chromedp.WindowSize(1280, 900),
	)
	ctx, cancel := chromedp.NewContext(actx)
	// The first Run starts the browser; its context must outlive the test.
	if err := chromedp.Do(ctx); err != nil {
		cancel()
		cancelAlloc()
		t.Fatalf("starting %s: %v", bin, err)
	}
	proc := chromedp.FromContext(ctx).Browser.Process()
	t.Cleanup(func() {
		cancel()
		cancelAlloc() // kills the browser and waits for it
		if proc == nil {
			return
		}
		// Belt and braces: the process must be gone.
		if err := proc.Signal(syscall.Signal(0)); err == nil {
			t.Errorf("Chromium (pid %d) still runs after the allocator stopped; killing it", proc.Pid)
			_ = proc.Kill()
		}
	})
	return ctx
}

// domText evaluates js, an expression giving a string, in ctx's tab.
func domText(ctx context.Context, js string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return chromedp.Run(ctx, chromedp.Evaluate[string](js))
}

// rowText is a JS expression: the visible text of the first element sel
// selects, or "" when there is none.
func rowText(sel string) string {
	return fmt.Sprintf(`(document.querySelector(%q) || {innerText: ""}).innerText`, sel)
}

// waitDOM waits until js's string satisfies ok, polling the page every
// 100 ms, or fails the test at the deadline with the last value.
func waitDOM(t *testing.T, ctx context.Context, timeout time.Duration, what, js string, ok func(string) bool) string {
	t.Helper()
	var last string
	waitFor(t, timeout, what, func() (bool, string) {
		s, err := domText(ctx, js)
		if err != nil {
			return false, err.Error()
		}
		last = s
		return ok(s), fmt.Sprintf("%q", s)
	})
	return last
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// holdConns opens n HTTP/1.1 connections to addr, sends one request on
// each, and leaves them open and idle: n connections of load for the
// rebalance metric. They are closed when the test ends.
func holdConns(t *testing.T, addr string, n int) {
	t.Helper()
	for range n {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", addr)
		res, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		_ = c.SetDeadline(time.Time{})
	}
}

// statusNodeCaddyfile is the observed node's config: the cluster and
// rebalance apps, one site with a least_time pool (outlier ejection, slow start)
// and a partition handler, and the status page on a loopback site of its
// own.
func statusNodeCaddyfile(admin, serf, site, statusSite, ok1, ok2, bad, dead string) string {
	return fmt.Sprintf(`{
	admin %s
	persist_config off
	auto_https off
	default_bind 127.0.0.1
	cluster {
		node_name a
		bind %s
	}
	rebalance {
		interval 200ms
		history 1s
		freshness 1s
		threshold 20%%
		shed_rate 5%%
		min_connections 20
	}
}

http://%s {
	rebalance_close
	handle /pool/* {
		reverse_proxy %s %s %s {
			lb_policy least_time {
				outlier {
					consecutive_failures 3
					failure_status 503
					base_ejection_time 5m
					max_ejection_percent 50%%
				}
				slow_start 1m
			}
		}
	}
	handle /part/* {
		partition {
			to %s 0/2
			to %s 1/2
			to %s 1/2
			fail_duration 5m
			max_fails 1
		}
	}
	respond "ok"
}

http://%s {
	bind 127.0.0.1
	lbx_status
}
`, admin, serf, site, ok1, ok2, bad, ok1, ok2, dead, statusSite)
}

// TestStatusPage loads the status page in a real headless Chromium against
// a running 3-node fleet: node a (a least_time pool of two good backends and
// one answering 503, a partition handler with a dead replica, the page on
// a loopback site of its own) and nodes b and c. It checks what the page
// shows — the pool and its ejected upstream, the partitions and the dead
// replica, the members alive and counted, the shed totals — then that it
// refreshes by itself: connections piled on a are shed and the total
// grows, c leaves and shows as left, with no reload. Then it opens the
// page the admin endpoint serves: a browser's navigation is refused, as
// the status admin module (admin.api.lbx_status) says, and the page
// loaded as if by a same-origin link reads the views through the admin endpoint's origin checks. Last, a is
// killed, and the page shows its error banner over the last data.
func TestStatusPage(t *testing.T) {
	chrome := findChromium(t)
	bin := drainBuildCaddy(t)

	okBackend := func(report string) *httptest.Server {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if report != "" {
				w.Header().Set("Endpoint-Load-Metrics", report)
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"items":[1]}`)
		}))
		t.Cleanup(s.Close)
		return s
	}
	// ok1 sends ORCA load reports: the upstreams table gains its
	// "reported" column
	ok1, ok2 := okBackend("TEXT application_utilization=0.4, cpu_utilization=0.7"), okBackend("")
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
	}))
	t.Cleanup(bad.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	host := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }

	ports, err := fleet.FreePorts(4)
	if err != nil {
		t.Fatal(err)
	}
	addr := func(p int) string { return fmt.Sprintf("127.0.0.1:%d", p) }
	admin, serf, site, statusSite := addr(ports[0]), addr(ports[1]), addr(ports[2]), addr(ports[3])
	a := startDrainCaddy(t, bin, statusNodeCaddyfile(admin, serf, site, statusSite, host(ok1), host(ok2), host(bad), dead))
	waitFor(t, 20*time.Second, "node a's admin API", func() (bool, string) {
		var v map[string]any
		err := getJSON("http://"+admin+"/lbx/rebalance", &v)
		return err == nil, fmt.Sprint(err, a.Exited())
	})
	settings := fleet.Settings{Interval: "200ms", History: "1s", Freshness: "1s", Threshold: 20, ShedRate: 5, MinConnections: 20}
	others := map[string]*fleet.Node{}
	for _, name := range []string{"b", "c"} {
		n, err := fleet.StartNode(bin, t.TempDir(), fleet.NodeSpec{Name: name, Join: serf, Settings: settings})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := n.Proc.Kill(); err != nil {
				t.Error(err)
			}
		})
		others[name] = n
	}

	// Traffic: the 503 backend is ejected, the dead replica marked down.
	client := &http.Client{Timeout: 5 * time.Second}
	get := func(path string) {
		res, err := client.Get("http://" + site + path)
		if err == nil {
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
		}
	}
	waitFor(t, 15*time.Second, "the 503 backend ejected and the dead replica down", func() (bool, string) {
		for range 10 {
			get("/pool/x")
			get("/part/x")
		}
		var ups struct {
			Upstreams []struct {
				Dial    string  `json:"dial"`
				Ejected float64 `json:"ejected_for_ms"`
			} `json:"upstreams"`
		}
		var parts struct {
			Handlers []struct {
				Schemes []struct {
					Partitions []struct {
						Replicas []struct{ Dial, Health string } `json:"replicas"`
					} `json:"partition_list"`
				} `json:"schemes"`
			} `json:"handlers"`
		}
		if err := getJSON("http://"+admin+"/lbx/upstreams?limit=1000", &ups); err != nil {
			return false, err.Error()
		}
		if err := getJSON("http://"+admin+"/lbx/partitions", &parts); err != nil {
			return false, err.Error()
		}
		ejected, down := false, false
		for _, u := range ups.Upstreams {
			ejected = ejected || (u.Dial == host(bad) && u.Ejected > 0)
		}
		for _, h := range parts.Handlers {
			for _, s := range h.Schemes {
				for _, p := range s.Partitions {
					for _, r := range p.Replicas {
						down = down || (r.Dial == dead && r.Health == "unavailable")
					}
				}
			}
		}
		return ejected && down, fmt.Sprintf("ejected %v, dead replica down %v", ejected, down)
	})
	// Load on b and c about what the browser's connections will put on
	// a: a node with none, below the others, would be lifted toward the
	// average and, gaining nothing, left out of it for a while.
	client.CloseIdleConnections()
	holdConns(t, others["b"].HTTP, 6)
	holdConns(t, others["c"].HTTP, 6)
	waitFor(t, 20*time.Second, "a to count b and c", func() (bool, string) {
		var v struct {
			Nodes []struct {
				Members []struct {
					Name, Status string
					Counted      bool
					Why          string `json:"excluded_because"`
				}
			}
		}
		if err := getJSON("http://"+admin+"/lbx/rebalance", &v); err != nil || len(v.Nodes) != 1 {
			return false, fmt.Sprint(err, v)
		}
		n := 0
		for _, m := range v.Nodes[0].Members {
			if m.Status == "alive" && m.Counted {
				n++
			}
		}
		return n == 3, fmt.Sprint(v.Nodes[0].Members)
	})

	ctx := startBrowser(t, chrome)
	start := time.Now()
	pageURL := "http://" + statusSite + "/lbx/status"
	res, err := chromedp.Run(ctx, chromedp.NavigateResponse(pageURL))
	if err != nil {
		t.Fatalf("opening %s: %v", pageURL, err)
	}
	if res.Status != http.StatusOK || !strings.HasPrefix(res.MimeType, "text/html") {
		t.Fatalf("%s: status %d, %s", pageURL, res.Status, res.MimeType)
	}
	// A mark that a reload would wipe.
	if _, err := domText(ctx, `(window.lbxTestMark = "still here")`); err != nil {
		t.Fatal(err)
	}
	waitDOM(t, ctx, 10*time.Second, "the first refresh", `document.getElementById("updated").dataset.refreshes || ""`,
		func(s string) bool { return s != "" })

	// Pools and upstreams.
	for _, u := range []*httptest.Server{ok1, ok2} {
		waitDOM(t, ctx, 5*time.Second, "pool row of "+host(u), rowText(fmt.Sprintf(`#pools tr[data-dial=%q]`, host(u))),
			func(s string) bool { return containsAll(s, host(u), "healthy", "yes") })
	}
	waitDOM(t, ctx, 5*time.Second, "pool row of the ejected backend", rowText(fmt.Sprintf(`#pools tr[data-dial=%q]`, host(bad))),
		func(s string) bool { return containsAll(s, host(bad), "no") })
	waitDOM(t, ctx, 5*time.Second, "upstream row of the ejected backend", rowText(fmt.Sprintf(`#upstreams tr[data-dial=%q]`, host(bad))),
		func(s string) bool { return containsAll(s, "ejected for", "consecutive_failures") })
	waitDOM(t, ctx, 5*time.Second, "the reported column of the reporting backend", rowText(fmt.Sprintf(`#upstreams tr[data-dial=%q]`, host(ok1))),
		func(s string) bool { return containsAll(s, "40%", "ago") })
	waitDOM(t, ctx, 5*time.Second, "the pool's summary", rowText("#pools"),
		func(s string) bool { return containsAll(s, "policy least_time", "available 2 of 3", "panic no") })

	// Partitions.
	waitDOM(t, ctx, 5*time.Second, "partition p0", rowText(`#partitions tr[data-partition="2:p0"]`),
		func(s string) bool { return containsAll(s, "p0 (0/2)", host(ok1), "usable") })
	waitDOM(t, ctx, 5*time.Second, "partition p1 with the dead replica", rowText(`#partitions tr[data-partition="2:p1"]`),
		func(s string) bool { return containsAll(s, "p1 (1/2)", host(ok2), dead, "unavailable") })

	// Members, decision, shed totals; selective is not in the config.
	// Each member is alive, and counted or not counted with the reason: a
	// holds the browser's and this test's connections too, so it may
	// already shed and lift b or c, whose count then waits (the lift
	// rule) — both are what the page must show.
	for _, name := range []string{"a", "b", "c"} {
		row := waitDOM(t, ctx, 5*time.Second, "member "+name, rowText(fmt.Sprintf(`#members tr[data-member=%q]`, name)),
			func(s string) bool {
				if !containsAll(s, name, "alive", "counted") {
					return false
				}
				_, why, notCounted := strings.Cut(s, "not counted: ")
				return !notCounted || strings.TrimSpace(why) != ""
			})
		t.Logf("member %s: %q", name, row)
	}
	waitDOM(t, ctx, 5*time.Second, "a's last decision", rowText("#decision-a"), func(s string) bool { return s != "" && !strings.Contains(s, "no decision yet") })
	shed0 := waitDOM(t, ctx, 5*time.Second, "a's shed totals", rowText("#shed-a"), func(s string) bool { return s != "" })
	waitDOM(t, ctx, 5*time.Second, "selective not configured", rowText("#selective"), func(s string) bool { return strings.Contains(s, "not configured") })
	if s, _ := domText(ctx, rowText("#error")); s != "" {
		t.Errorf("error banner shown: %q", s)
	}

	// Self-refresh: 30 more idle connections on a, so a sheds (below
	// min_connections, 20, nobody did); the page shows the shed total grow
	// with no reload.
	holdConns(t, site, 30)
	shedTotal := func(s string) int {
		var n int
		fmt.Sscan(s, &n)
		return n
	}
	t.Logf("shed totals before: %q", shed0)
	shed1 := waitDOM(t, ctx, 15*time.Second, "the page to show a's shed total grow", rowText("#shed-a"),
		func(s string) bool { return shedTotal(s) > shedTotal(shed0) })
	t.Logf("shed totals after: %q", shed1)
	if path := os.Getenv(statusScreenshotEnv); path != "" {
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote a screenshot to %s", path)
	}

	// c leaves; the page shows it without a reload.
	c := others["c"]
	if err := c.Proc.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Proc.Done():
	case <-time.After(15 * time.Second):
		t.Fatal("c did not stop within 15s of SIGTERM")
	}
	waitDOM(t, ctx, 15*time.Second, "the page to show c gone", rowText(`#members tr[data-member="c"]`),
		func(s string) bool {
			f := strings.Split(s, "\t") // member, address, status, …
			return len(f) > 2 && (f[2] == "left" || f[2] == "failed") && strings.Contains(s, "not counted")
		})
	if s, err := domText(ctx, `window.lbxTestMark || "reloaded"`); err != nil || s != "still here" {
		t.Errorf("the page was reloaded (%q, %v): it must refresh its data in place", s, err)
	}
	if s, _ := domText(ctx, rowText("#error")); s != "" {
		t.Errorf("error banner shown: %q", s)
	}

	// The admin endpoint's page. A browser's navigation is refused.
	actx, cancel := chromedp.NewContext(ctx) // a new tab
	defer cancel()
	adminURL := "http://" + admin + "/lbx/status"
	res, err = chromedp.Run(actx, chromedp.NavigateResponse(adminURL))
	if err != nil {
		t.Fatalf("opening %s: %v", adminURL, err)
	}
	if res.Status != http.StatusForbidden {
		t.Errorf("a browser opening %s got status %d, not 403: Caddy's admin endpoint now lets it in; update docs/status.md and the status admin module's comment", adminURL, res.Status)
	}
	// Loaded as from a link on the admin origin, the page's requests,
	// which carry its URL as Referer, pass the origin check.
	if err := chromedp.Do(actx, chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		r, err := cdp.Call(ctx, tg, page.Navigate, page.NavigateParams{URL: adminURL, Referrer: "http://" + admin + "/"})
		if err == nil && r.ErrorText != "" {
			err = fmt.Errorf("%s", r.ErrorText)
		}
		return err
	})); err != nil {
		t.Fatal(err)
	}
	waitDOM(t, actx, 10*time.Second, "the admin endpoint's page to show member b", rowText(`#members tr[data-member="b"]`),
		func(s string) bool { return containsAll(s, "b", "alive") })
	if s, _ := domText(actx, rowText("#error")); s != "" {
		t.Errorf("the admin endpoint's page shows an error: %q", s)
	}

	// Node a goes away: the first tab's page says its refresh failed, and
	// keeps the last data.
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	waitDOM(t, ctx, 10*time.Second, "the error banner", rowText("#error"),
		func(s string) bool { return containsAll(s, "Refresh failed", "upstreams: ", "rebalance: ") })
	if s, _ := domText(ctx, rowText(`#members tr[data-member="b"]`)); !strings.Contains(s, "alive") {
		t.Errorf("after a failed refresh, member b's row is %q; want the last data kept", s)
	}
	t.Logf("browser part took %v", time.Since(start).Round(time.Millisecond))
}

// TestStatusSiteRefusesRemote serves lbx_status from a real Caddy, on a
// site bound to loopback and on a site behind Caddy's proxy_protocol
// listener wrapper, whose PROXY header lets the test present a connection
// as coming from another machine without sending a packet anywhere but
// 127.0.0.1 (the addresses in the headers are data). A client on this
// machine gets the views whatever Host it sends; a client elsewhere —
// a remote peer, or a loopback peer on a non-loopback interface — gets
// 403 and the fix, Host spoofed or not.
func TestStatusSiteRefusesRemote(t *testing.T) {
	e := newEnv(t)
	plain, proxied := freePort(t), freePort(t)
	e.loadWith(fmt.Sprintf(`	servers 127.0.0.1:%[2]d {
		listener_wrappers {
			proxy_protocol {
				allow 127.0.0.1/32
			}
		}
	}
`, plain, proxied), fmt.Sprintf(`http://127.0.0.1:%[1]d {
	bind 127.0.0.1
	handle /lbx/* {
		lbx_status
	}
}

http://127.0.0.1:%[2]d {
	bind 127.0.0.1
	handle /lbx/* {
		lbx_status
	}
}
`, plain, proxied))

	// ask sends GET /lbx/upstreams to 127.0.0.1:port, after proxyHeader
	// when not empty, with the spoofed Host of the finding.
	ask := func(port int, proxyHeader string) (int, string) {
		t.Helper()
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		req := proxyHeader + fmt.Sprintf("GET /lbx/upstreams HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-Forwarded-For: 127.0.0.1\r\nConnection: close\r\n\r\n", port)
		if _, err := io.WriteString(c, req); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	proxyHeader := func(src, dst string) string {
		return fmt.Sprintf("PROXY TCP4 %s %s 40000 %d\r\n", src, dst, proxied)
	}

	for _, c := range []struct {
		name   string
		port   int
		header string
		want   int
	}{
		{"loopback client, loopback site", plain, "", http.StatusOK},
		{"PROXY header: loopback to loopback", proxied, proxyHeader("127.0.0.1", "127.0.0.1"), http.StatusOK},
		{"PROXY header: a remote client", proxied, proxyHeader("192.0.2.7", "127.0.0.1"), http.StatusForbidden},
		{"PROXY header: a remote client to a public interface", proxied, proxyHeader("192.0.2.7", "192.0.2.10"), http.StatusForbidden},
		{"PROXY header: loopback source on a public interface", proxied, proxyHeader("127.0.0.1", "192.0.2.10"), http.StatusForbidden},
	} {
		code, body := ask(c.port, c.header)
		if code != c.want {
			t.Errorf("%s: status %d, want %d; body %.300s", c.name, code, c.want, body)
			continue
		}
		switch code {
		case http.StatusOK:
			if !strings.Contains(body, `"upstreams"`) {
				t.Errorf("%s: body %.300s is not the upstreams view", c.name, body)
			}
		case http.StatusForbidden:
			if !strings.Contains(body, "allow_remote") || strings.Contains(body, `"upstreams"`) {
				t.Errorf("%s: body %.300s does not name the fix, or holds the view", c.name, body)
			}
		}
	}
}
