package status

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// request returns a request as a server would hand it over a connection
// from remote to local (local "" for none). The addresses are data only:
// nothing is sent anywhere.
func request(method, remote string, local net.Addr, clientIP string) *http.Request {
	r := httptest.NewRequest(method, "http://127.0.0.1/lbx/upstreams", nil)
	r.RemoteAddr = remote
	ctx := r.Context()
	if local != nil {
		ctx = context.WithValue(ctx, http.LocalAddrContextKey, local)
	}
	vars := map[string]any{}
	if clientIP != "" {
		vars[caddyhttp.ClientIPVarKey] = clientIP
	}
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, vars)
	return r.WithContext(ctx)
}

func tcp(ip string, port int) net.Addr { return &net.TCPAddr{IP: net.ParseIP(ip), Port: port} }

// TestFromLoopback: only a connection between two loopback addresses (or
// a Unix socket) is local; headers never make a remote client local.
func TestFromLoopback(t *testing.T) {
	for _, c := range []struct {
		name     string
		remote   string
		local    net.Addr
		clientIP string
		spoof    bool
		want     bool
	}{
		{name: "v4 loopback both ends", remote: "127.0.0.1:50000", local: tcp("127.0.0.1", 2020), clientIP: "127.0.0.1", want: true},
		{name: "v6 loopback both ends", remote: "[::1]:50000", local: tcp("::1", 2020), want: true},
		{name: "127/8", remote: "127.0.0.2:50000", local: tcp("127.0.0.1", 2020), want: true},
		{name: "v4-mapped loopback", remote: "[::ffff:127.0.0.1]:50000", local: tcp("::ffff:127.0.0.1", 2020), want: true},
		{name: "unix socket", remote: "@", local: &net.UnixAddr{Name: "/run/caddy.sock", Net: "unix"}, want: true},
		{name: "remote peer on a wildcard listener", remote: "192.0.2.7:50000", local: tcp("127.0.0.1", 2020), want: false},
		{name: "remote peer, spoofed Host and X-Forwarded-For", remote: "192.0.2.7:50000", local: tcp("127.0.0.1", 2020), spoof: true, want: false},
		{name: "remote peer to a public interface", remote: "192.0.2.7:50000", local: tcp("192.0.2.10", 2020), want: false},
		{name: "link-local peer", remote: "[fe80::1%eth0]:50000", local: tcp("fe80::2", 2020), want: false},
		{name: "loopback peer named by a PROXY header, public interface", remote: "127.0.0.1:50000", local: tcp("192.0.2.10", 2020), want: false},
		{name: "loopback trusted proxy forwarding a remote client", remote: "127.0.0.1:50000", local: tcp("127.0.0.1", 2020), clientIP: "198.51.100.4", want: false},
		{name: "no local address", remote: "127.0.0.1:50000", want: false},
		{name: "unparsable remote", remote: "localhost:50000", local: tcp("127.0.0.1", 2020), want: false},
		{name: "empty remote", remote: "", local: tcp("127.0.0.1", 2020), want: false},
	} {
		r := request(http.MethodGet, c.remote, c.local, c.clientIP)
		if c.spoof {
			r.Host = "127.0.0.1:2020"
			r.Header.Set("X-Forwarded-For", "127.0.0.1")
			r.Header.Set("X-Real-IP", "127.0.0.1")
			r.Header.Set("Forwarded", "for=127.0.0.1")
		}
		if got := fromLoopback(r); got != c.want {
			t.Errorf("%s: fromLoopback = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestRefusalLogRateLimited: a burst of refusals logs one line, which
// counts them, and the next line only after refusalLogEvery.
func TestRefusalLogRateLimited(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	h := &Handler{views: viewRoutes(), logger: zap.New(core), refused: new(refusals)}
	remote := func() *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		if err := h.ServeHTTP(rec, request(http.MethodGet, "192.0.2.7:50000", tcp("127.0.0.1", 2020), ""), nil); err != nil {
			t.Fatal(err)
		}
		return rec
	}
	for range 100 {
		if rec := remote(); rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), "allow_remote") {
			t.Fatalf("status %d, body %q: want 403 naming allow_remote", rec.Code, rec.Body)
		}
	}
	if n := logs.Len(); n != 1 {
		t.Fatalf("%d log lines for 100 refusals in a burst, want 1", n)
	}
	// A minute later the next refusal logs, with the count since.
	h.refused.lastLog.Add(-int64(refusalLogEvery))
	remote()
	entries := logs.All()
	if len(entries) != 2 {
		t.Fatalf("%d log lines after refusalLogEvery, want 2", len(entries))
	}
	f := entries[1].ContextMap()
	if f["refused_since_last_log"] != uint64(100) || f["refused_total"] != uint64(101) || f["remote_addr"] != "192.0.2.7:50000" {
		t.Errorf("second line's fields %v: want 100 since the last line, 101 in total, the peer address", f)
	}
}

// TestSiteIsReadOnly: through a site, even with allow_remote and from
// loopback, a route that changes state on the admin endpoint (POST
// /lbx/drain) is refused before it runs.
func TestSiteIsReadOnly(t *testing.T) {
	called := false
	h := &Handler{AllowRemote: true, logger: zap.NewNop(), refused: new(refusals), views: map[string]caddy.AdminHandler{
		"drain": caddy.AdminHandlerFunc(func(http.ResponseWriter, *http.Request) error { called = true; return nil }),
	}}
	for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodDelete} {
		r := request(method, "127.0.0.1:50000", tcp("127.0.0.1", 2020), "")
		r.URL.Path = "/status/drain"
		err := h.ServeHTTP(httptest.NewRecorder(), r, nil)
		var he caddyhttp.HandlerError
		if !errors.As(err, &he) || he.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("%s /status/drain: %v; want 405", method, err)
		}
	}
	if called {
		t.Fatal("a state-changing route ran through a site")
	}
	r := request(http.MethodGet, "127.0.0.1:50000", tcp("127.0.0.1", 2020), "")
	r.URL.Path = "/status/drain"
	if err := h.ServeHTTP(httptest.NewRecorder(), r, nil); err != nil || !called {
		t.Fatalf("GET of a view: %v, called %v", err, called)
	}
}
