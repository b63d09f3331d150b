package rebalance

import (
	"fmt"
	"net"
	"reflect"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(ListenerWrapper{})
}

// ListenerWrapper counts the bytes read from and written to every
// connection its listener accepts, for the rebalance app's `throughput`
// metric (bytes per second, in + out). It has no options.
//
// It must come before `tls` in a server's listener_wrappers, so that it
// counts the bytes on the wire and net/http still sees the *tls.Conn it
// needs for HTTPS and HTTP/2:
//
//	"listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "tls"}]
//
// Placed after tls (or alone: Caddy then puts tls first), it receives TLS
// connections: it passes them through uncounted, so that HTTPS keeps
// working, and logs an error once naming the fix. Plain HTTP connections
// are counted wherever it is placed. HTTP/3 runs over UDP and does not
// pass through listener wrappers: its bytes are not counted.
//
// Counting costs one atomic add per Read or Write call. The wrapped
// connection keeps what net/http and Caddy look for on an accepted
// connection: ReadFrom (so file_server's sendfile path stays zero-copy),
// CloseWrite and CloseRead, deadlines, and NetConn to reach the socket.
// The byte totals are the process's, across configs: one process is one
// cluster node, and a connection of an old config still carries this
// node's traffic until it closes.
type ListenerWrapper struct {
	conns  *processConns // the process's, from Provision to Cleanup
	logger *zap.Logger
	server *caddyhttp.Server // the server whose listeners this wraps, if any
	// warned is set once the misplacement error is logged (a pointer:
	// CaddyModule takes the module by value).
	warned *atomic.Bool
}

// CaddyModule returns the Caddy module information.
func (ListenerWrapper) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "caddy.listeners.rebalance",
		New: func() caddy.Module { return new(ListenerWrapper) },
	}
}

// Provision records that the HTTP server being provisioned counts its
// bytes, so that the rebalance app can tell whether metric throughput
// measures anything. Caddy provisions a server's listener wrappers with
// the server in the context.
func (w *ListenerWrapper) Provision(ctx caddy.Context) error {
	w.logger = ctx.Logger()
	w.warned = new(atomic.Bool)
	w.conns = acquireConns()
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && srv != nil {
		if err := w.conns.servers.add(srv, w); err != nil {
			return err
		}
		w.server = srv
	}
	return nil
}

// Cleanup forgets the server (its config is unloaded) and lets go of the
// process's connections. It is idempotent.
func (w *ListenerWrapper) Cleanup() error {
	if w.conns == nil {
		return nil
	}
	if w.server != nil {
		w.conns.servers.remove(w.server, w)
		w.server = nil
	}
	w.conns = nil
	releaseConns()
	return nil
}

// WrapListener returns l with counted connections. Caddy calls it once
// the wrapper is provisioned; an unprovisioned wrapper has no counters
// and returns l as it is.
func (w *ListenerWrapper) WrapListener(l net.Listener) net.Listener {
	if w.conns == nil {
		return l
	}
	if isTLSListener(l) {
		// Placed after tls: say so at start, before the first connection.
		w.misplaced(l)
	}
	return w.conns.counters.Listener(l, func() { w.misplaced(l) })
}

// isTLSListener reports whether l is crypto/tls's listener (its type is
// unexported), as the wrapper gets when listed after tls.
func isTLSListener(l net.Listener) bool {
	t := reflect.TypeOf(l)
	return t != nil && t.Kind() == reflect.Pointer && t.Elem().PkgPath() == "crypto/tls"
}

// misplaced logs, once per wrapper, that it was placed after tls.
func (w *ListenerWrapper) misplaced(l net.Listener) {
	if w.logger == nil || w.warned == nil || !w.warned.CompareAndSwap(false, true) {
		return
	}
	fields := []zap.Field{zap.String("listener", l.Addr().String())}
	if w.server != nil {
		fields = append(fields, zap.String("server", w.server.Name()))
	}
	w.logger.Error("the rebalance listener wrapper is placed after tls: it sees TLS connections, "+
		"which it passes through uncounted (HTTPS keeps working, but metric throughput misses their bytes); "+
		`put rebalance before tls: listener_wrappers { rebalance tls } `+
		`(JSON: "listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "tls"}])`, fields...)
}

// serverRegistry maps the HTTP servers of the loaded configs whose
// listener_wrappers include rebalance to the wrapper that counts their
// bytes.
type serverRegistry struct {
	mu sync.Mutex
	m  map[*caddyhttp.Server]*ListenerWrapper
}

// add records that w counts srv's bytes. A second wrapper in the same
// server would count every byte twice.
func (r *serverRegistry) add(srv *caddyhttp.Server, w *ListenerWrapper) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if other, ok := r.m[srv]; ok && other != w {
		return fmt.Errorf("the rebalance listener wrapper is listed twice in this server's listener_wrappers; it would count every byte twice")
	}
	r.m[srv] = w
	return nil
}

// remove forgets srv if w is its wrapper.
func (r *serverRegistry) remove(srv *caddyhttp.Server, w *ListenerWrapper) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m[srv] == w {
		delete(r.m, srv)
	}
}

// has reports whether srv's bytes are counted.
func (r *serverRegistry) has(srv *caddyhttp.Server) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.m[srv]
	return ok
}

// any reports whether any loaded server's bytes are counted.
func (r *serverRegistry) any() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.m) > 0
}

// Interface guards
var (
	_ caddy.Module          = (*ListenerWrapper)(nil)
	_ caddy.Provisioner     = (*ListenerWrapper)(nil)
	_ caddy.CleanerUpper    = (*ListenerWrapper)(nil)
	_ caddy.ListenerWrapper = (*ListenerWrapper)(nil)
)
