package rebalance

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestWarnNoCloseHandler: the start-up warning names the servers whose
// routes have no rebalance_close, found in provisioned handlers, in
// subroutes, in named routes and in a route's unprovisioned JSON, and
// leaves out Caddy's redirect server; with every server covered it says
// nothing.
func TestWarnNoCloseHandler(t *testing.T) {
	handlers := func(h ...caddyhttp.MiddlewareHandler) caddyhttp.RouteList {
		return caddyhttp.RouteList{{Handlers: h}}
	}
	static := &caddyhttp.StaticResponse{}
	servers := map[string]*caddyhttp.Server{
		"direct":                {Routes: handlers(&CloseHandler{}, static)},
		"subroute":              {Routes: handlers(&caddyhttp.Subroute{Routes: handlers(static, &CloseHandler{})})},
		"named":                 {Routes: handlers(static), NamedRoutes: map[string]*caddyhttp.Route{"r": {Handlers: []caddyhttp.MiddlewareHandler{&CloseHandler{}}}}},
		"raw":                   {Routes: caddyhttp.RouteList{{HandlersRaw: []json.RawMessage{json.RawMessage(`{"handler": "subroute", "routes": [{"handle": [{"handler": "rebalance_close"}]}]}`)}}}},
		"without":               {Routes: handlers(&caddyhttp.Subroute{Routes: handlers(static)})},
		"empty":                 {},
		autoHTTPSRedirectServer: {Routes: handlers(static)},
	}
	core, logs := observer.New(zapcore.WarnLevel)
	a := &App{logger: zap.New(core), httpApp: &caddyhttp.App{Servers: servers}, IdleCloseAfter: caddy.Duration(2 * time.Minute)}
	a.warnNoCloseHandler()
	entries := logs.TakeAll()
	if len(entries) != 1 {
		t.Fatalf("%d warnings; want 1: %v", len(entries), entries)
	}
	got := fmt.Sprint(entries[0].ContextMap()["servers"])
	if got != "[empty without]" {
		t.Errorf("servers named %s; want [empty without]", got)
	}
	delete(servers, "empty")
	delete(servers, "without")
	a.warnNoCloseHandler()
	if n := logs.Len(); n != 0 {
		t.Errorf("%d warnings with every server covered; want none", n)
	}
}

// TestCaddyIdleCloseAfter loads a real config with idle_close_after and
// two servers, one with rebalance_close in a subroute (as a Caddyfile site
// puts it) and one without: the tracker takes the bound; a shed idle
// connection on the first gets Connection: close on its next response,
// and one on the second is answered normally and closed once idle for
// the bound, both without a failed request.
func TestCaddyIdleCloseAfter(t *testing.T) {
	withPort, withoutPort, gossipPort := freePort(t), freePort(t), freePort(t)
	config := fmt.Appendf(nil, `{
		"admin": {"disabled": true},
		"apps": {
			"http": {"servers": {
				"with": {
					"listen": ["127.0.0.1:%d"],
					"routes": [{"handle": [{"handler": "subroute", "routes": [{"handle": [
						{"handler": "rebalance_close"}, {"handler": "static_response", "body": "ok"}]}]}]}]
				},
				"without": {
					"listen": ["127.0.0.1:%d"],
					"routes": [{"handle": [{"handler": "static_response", "body": "ok"}]}]
				}
			}},
			"cluster": {"node_name": "idle-close", "bind": "127.0.0.1:%d"},
			"rebalance": {"interval": "10m", "history": "10m", "idle_close_after": "1s"}
		}
	}`, withPort, withoutPort, gossipPort)
	if err := caddy.Load(config, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })
	tracker := runningConns(t).tracker
	if got := tracker.IdleCloseAfter(); got != time.Second {
		t.Fatalf("the tracker's bound is %v; want idle_close_after 1s", got)
	}

	type conn struct {
		c  net.Conn
		br *bufio.Reader
	}
	get := func(c conn) (*http.Response, error) {
		if _, err := io.WriteString(c.c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			return nil, err
		}
		resp, err := http.ReadResponse(c.br, nil)
		if err != nil {
			return nil, err
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil && string(body) != "ok" {
			err = fmt.Errorf("body %q", body)
		}
		return resp, err
	}
	dial := func(port int) conn {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(20 * time.Second))
		cn := conn{c, bufio.NewReader(c)}
		if _, err := get(cn); err != nil {
			t.Fatal(err)
		}
		return cn
	}
	with, without := dial(withPort), dial(withoutPort)
	lbxtest.WaitFor(t, 5*time.Second, "2 idle connections", func() (bool, string) {
		c := tracker.Counts()
		return c.Idle == 2, fmt.Sprintf("%+v", c)
	})
	if r := tracker.Shed(2); r != (ShedResult{Idle: 2}) {
		t.Fatalf("Shed(2) = %+v; want 2 idle", r)
	}
	resp, err := get(with)
	if err != nil || !resp.Close {
		t.Fatalf("with rebalance_close: %v, %v; want a response with Connection: close", err, resp)
	}
	resp, err = get(without)
	if err != nil || resp.Close {
		t.Fatalf("without rebalance_close: %v, %v; want a plain response", err, resp)
	}
	start := time.Now()
	for _, c := range []conn{with, without} {
		if _, err := c.br.ReadByte(); err != io.EOF {
			t.Errorf("read %v; want the server's EOF", err)
		}
	}
	if d := time.Since(start); d < 900*time.Millisecond {
		t.Errorf("the connection without rebalance_close closed %v after its response; want about idle_close_after (1s)", d)
	}
	if n := tracker.IdleCloseTotal(); n != 1 {
		t.Errorf("%d closed after the bound; want 1", n)
	}
	var n *node
	nodes.Range(func(_, v any) bool {
		if v.(*node).name == "idle-close" {
			n = v.(*node)
		}
		return true
	})
	if n == nil {
		t.Fatal("no node in the pool")
	}
	if v := n.view(time.Now(), runningConns(t).stats()); v.IdleCloseAfter != 1000 || v.IdleCloses != 1 {
		t.Errorf("admin view: idle_close_after_ms %d, idle_closes_total %d; want 1000 and 1", v.IdleCloseAfter, v.IdleCloses)
	}
}
