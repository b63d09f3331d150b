package rebalance

import (
	"crypto/tls"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// testWrapper returns a provisioned-looking wrapper with its own process
// connections and a logger that records.
func testWrapper() (*ListenerWrapper, *processConns, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	conns := newProcessConns()
	return &ListenerWrapper{conns: conns, logger: zap.New(core), warned: new(atomic.Bool)}, conns, logs
}

// TestListenerWrapperPlacement wraps a listener before TLS (counted into
// the process's counters, nothing logged) and after TLS (the accepted
// *tls.Conn passes through unwrapped and uncounted, and one error names
// the fix however many connections arrive).
func TestListenerWrapperPlacement(t *testing.T) {
	_, _, cert := lbxtest.Cert(t)
	serverConf := &tls.Config{Certificates: []tls.Certificate{cert}}

	t.Run("before tls", func(t *testing.T) {
		w, conns, logs := testWrapper()
		srv, cl := lbxtest.TCPPair(t, func(l net.Listener) net.Listener { return tls.NewListener(w.WrapListener(l), serverConf) })
		go cl.Write(make([]byte, 100)) // a client hello it never finishes
		if _, err := io.ReadFull(srv.(*tls.Conn).NetConn(), make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
		if got := conns.counters.Totals(); got.In != 100 || got.TLSUncounted != 0 || logs.Len() != 0 {
			t.Fatalf("totals %+v, %d log entries; want 100 bytes in, nothing logged", got, logs.Len())
		}
	})

	t.Run("after tls", func(t *testing.T) {
		w, conns, logs := testWrapper()
		for i := range 3 {
			srv, _ := lbxtest.TCPPair(t, func(l net.Listener) net.Listener { return w.WrapListener(tls.NewListener(l, serverConf)) })
			if _, ok := srv.(*tls.Conn); !ok {
				t.Fatalf("accepted %T; want the *tls.Conn", srv)
			}
			if got := conns.counters.Totals(); got.TLSUncounted != uint64(i+1) {
				t.Fatalf("connection %d: totals %+v; want %d passed through", i+1, got, i+1)
			}
		}
		entries := logs.All()
		if len(entries) != 1 || entries[0].Level != zapcore.ErrorLevel {
			t.Fatalf("%d log entries (%v); want exactly one error", len(entries), entries)
		}
		msg := entries[0].Message
		for _, want := range []string{"placed after tls", "passes through uncounted", "listener_wrappers { rebalance tls }", `{"wrapper": "rebalance"}, {"wrapper": "tls"}`} {
			if !strings.Contains(msg, want) {
				t.Errorf("error %q does not say %q", msg, want)
			}
		}
	})
}

// TestListenerWrapperLifecycle: a provisioned wrapper registers its
// server with the process's connections, which every wrapper and config
// shares; Cleanup, idempotent, forgets the server and lets the
// connections go once no one uses them. An unprovisioned wrapper counts
// nothing.
func TestListenerWrapperLifecycle(t *testing.T) {
	if loadedConns() != nil {
		t.Fatal("before the test, a module still holds the process's connections: a Provision without Cleanup")
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	srv := new(caddyhttp.Server)
	ctx = ctx.WithValue(caddyhttp.ServerCtxKey, srv)
	a, b := new(ListenerWrapper), new(ListenerWrapper)
	if err := a.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	conns := loadedConns()
	if conns == nil || a.conns != conns || !conns.servers.has(srv) {
		t.Fatalf("after Provision: pooled %p, the wrapper's %p, server registered %v", conns, a.conns, conns != nil && conns.servers.has(srv))
	}
	if err := b.Provision(ctx); err == nil || !strings.Contains(err.Error(), "listed twice") {
		t.Errorf("a second wrapper in the same server: %v; want listed twice", err)
	}
	b.Cleanup()
	for range 2 {
		if err := a.Cleanup(); err != nil {
			t.Fatal(err)
		}
	}
	if conns.servers.has(srv) || loadedConns() != nil {
		t.Errorf("after Cleanup: server registered %v, connections still pooled %v", conns.servers.has(srv), loadedConns() != nil)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if got := new(ListenerWrapper).WrapListener(ln); got != ln {
		t.Errorf("an unprovisioned wrapper returned %T; want the listener as it is", got)
	}
}
