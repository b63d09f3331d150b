package rebalance

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"reflect"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(ListenerWrapper{})
}

// traffic counts the bytes of every connection accepted through a
// rebalance listener wrapper in this process, across configs: one process
// is one cluster node, and a connection of an old config still carries
// this node's traffic until it closes.
var traffic = new(byteCounters)

// byteCounters are the process-wide byte totals. In and out sit on
// separate cache lines: a connection's reads and writes run on different
// goroutines (and cores), which would otherwise contend for one line.
type byteCounters struct {
	_   [64]byte
	in  atomic.Uint64 // bytes read from accepted connections
	_   [56]byte
	out atomic.Uint64 // bytes written to accepted connections
	_   [56]byte
	// zeroCopyOut is the part of out that the inner connection's ReadFrom
	// (sendfile, splice) moved without a copy through user space.
	zeroCopyOut atomic.Uint64
	// tlsUncounted counts connections passed through uncounted because
	// they were already TLS connections (the wrapper placed after tls).
	tlsUncounted atomic.Uint64
}

// ByteTotals are a snapshot of the byte counters.
type ByteTotals struct {
	// In is the number of bytes read from the connections the wrapper
	// accepted (requests, uploads, TLS records from clients).
	In uint64 `json:"in"`
	// Out is the number of bytes written to them (responses, downloads).
	Out uint64 `json:"out"`
	// OutZeroCopy is the part of Out sent by sendfile or splice.
	OutZeroCopy uint64 `json:"out_zero_copy"`
	// TLSUncounted is the number of connections that arrived already
	// decrypted by tls (the wrapper placed after tls) and were not
	// counted.
	TLSUncounted uint64 `json:"tls_connections_not_counted"`
}

// Total returns In + Out.
func (b ByteTotals) Total() uint64 { return b.In + b.Out }

// totals reads the counters. A nil receiver reads zeros.
func (b *byteCounters) totals() ByteTotals {
	if b == nil {
		return ByteTotals{}
	}
	return ByteTotals{
		In:           b.in.Load(),
		Out:          b.out.Load(),
		OutZeroCopy:  b.zeroCopyOut.Load(),
		TLSUncounted: b.tlsUncounted.Load(),
	}
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
type ListenerWrapper struct {
	counters *byteCounters
	logger   *zap.Logger
	server   *caddyhttp.Server // the server whose listeners this wraps, if any
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
	w.counters = traffic
	w.warned = new(atomic.Bool)
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && srv != nil {
		if err := countedServers.add(srv, w); err != nil {
			return err
		}
		w.server = srv
	}
	return nil
}

// Cleanup forgets the server (its config is unloaded). It is idempotent.
func (w *ListenerWrapper) Cleanup() error {
	if w.server != nil {
		countedServers.remove(w.server, w)
		w.server = nil
	}
	return nil
}

// WrapListener returns l with counted connections.
func (w *ListenerWrapper) WrapListener(l net.Listener) net.Listener {
	if w.counters == nil {
		// Not provisioned (used outside Caddy's module loading).
		w.counters = traffic
	}
	if isTLSListener(l) {
		// Placed after tls: say so at start, before the first connection.
		w.misplaced(l)
	}
	return &countingListener{Listener: l, w: w}
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

// countingListener wraps accepted connections in countingConn.
type countingListener struct {
	net.Listener
	w *ListenerWrapper
}

// Accept accepts a connection and wraps it, except a TLS connection: net/http
// must see the *tls.Conn itself to serve HTTPS and HTTP/2.
func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return c, err
	}
	switch c.(type) {
	case *tls.Conn:
		l.w.counters.tlsUncounted.Add(1)
		l.w.misplaced(l.Listener)
		return c, nil
	case *countingConn:
		// Already counted by an outer wrapper: never count twice.
		return c, nil
	}
	return &countingConn{Conn: c, counters: l.w.counters}, nil
}

// countingConn counts the bytes read from and written to its connection.
type countingConn struct {
	net.Conn
	counters *byteCounters
	// prefaceRead is how many of the bytes read so far matched the
	// HTTP/2 client preface, or -1 after a mismatch. Only Read uses it:
	// net/http reads a connection from one goroutine at a time.
	prefaceRead int
	// h2c is set once the whole preface has been read first thing: the
	// connection speaks cleartext HTTP/2, which the connection tracker
	// needs to know to shed it gracefully and Go's server does not
	// report (sawH2Preface).
	h2c atomic.Bool
}

// h2Preface is the HTTP/2 client connection preface (RFC 9113 §3.4).
const h2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// Read reads from the connection and counts the bytes read.
func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.counters.in.Add(uint64(n))
		if c.prefaceRead >= 0 && c.prefaceRead < len(h2Preface) {
			c.matchPreface(p[:n])
		}
	}
	return n, err
}

// matchPreface follows the first bytes read, p being the next ones.
func (c *countingConn) matchPreface(p []byte) {
	k := min(len(p), len(h2Preface)-c.prefaceRead)
	if string(p[:k]) != h2Preface[c.prefaceRead:c.prefaceRead+k] {
		c.prefaceRead = -1
		return
	}
	c.prefaceRead += k
	if c.prefaceRead == len(h2Preface) {
		c.h2c.Store(true)
	}
}

// sawH2Preface reports whether c, a connection net/http accepted, is or
// wraps a countingConn that read the HTTP/2 client preface first: a
// cleartext HTTP/2 connection. Without the wrapper (or below a wrapper
// that hides the connection it wraps) it reports false.
func sawH2Preface(c net.Conn) bool {
	cc, ok := findConn[*countingConn](c)
	return ok && cc.h2c.Load()
}

// findConn returns the first connection of type T among c and the
// connections it wraps, unwrapping TLS (NetConn) and PROXY-protocol (Raw)
// wrappers, and countingConn, which has NetConn too.
func findConn[T any](c net.Conn) (T, bool) {
	for range 8 {
		if t, ok := c.(T); ok {
			return t, true
		}
		switch w := c.(type) {
		case interface{ NetConn() net.Conn }:
			c = w.NetConn()
		case interface{ Raw() net.Conn }:
			c = w.Raw()
		default:
			var zero T
			return zero, false
		}
	}
	var zero T
	return zero, false
}

// Write writes to the connection and counts the bytes written.
func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.counters.out.Add(uint64(n))
	}
	return n, err
}

// zeroCopyChunk is the most bytes one call of the inner connection's
// ReadFrom moves before they are counted: sendfile and splice return only
// when done, so a large download would otherwise be counted in one lump
// when it ends, in a single interval.
const zeroCopyChunk = 1 << 20

// maxLimitDepth is how many *io.LimitedReader levels ReadFrom looks
// through for a file or socket. net/http passes a response body limited
// to its length, and Caddy's write-deadline wrapper limits it again per
// 64 KiB chunk: two levels, while the socket's own ReadFrom (sendfile,
// splice) looks through one only.
const maxLimitDepth = 4

// ReadFrom implements io.ReaderFrom, which net/http uses to send a
// response body from a file with sendfile. When r is a file or a socket,
// possibly behind *io.LimitedReader (as net/http and Caddy pass it), and
// the inner connection has its own ReadFrom, it hands the inner
// ReadFrom the file or socket under a single limit, in chunks of at most
// 1 MiB, keeping the zero-copy path and counting after each chunk; the
// limits r carried are reduced by what was sent, as reading through them
// would have. Any other source is copied through Write.
func (c *countingConn) ReadFrom(r io.Reader) (int64, error) {
	rf, ok := c.Conn.(io.ReaderFrom)
	if !ok {
		return c.copyFrom(r)
	}
	var levels [maxLimitDepth]*io.LimitedReader
	depth := 0
	src, limit := r, int64(math.MaxInt64)
	for {
		lr, ok := src.(*io.LimitedReader)
		if !ok {
			break
		}
		if depth == len(levels) {
			return c.copyFrom(r)
		}
		levels[depth] = lr
		depth++
		limit = min(limit, lr.N)
		src = lr.R
	}
	if _, zeroCopy := src.(syscall.Conn); !zeroCopy {
		return c.copyFrom(r)
	}
	var total int64
	chunk := &io.LimitedReader{R: src}
	for limit > 0 {
		chunk.N = min(limit, zeroCopyChunk)
		asked := chunk.N
		n, err := rf.ReadFrom(chunk)
		if n > 0 {
			total += n
			limit -= n
			for _, lr := range levels[:depth] {
				lr.N -= n
			}
			c.counters.out.Add(uint64(n))
			c.counters.zeroCopyOut.Add(uint64(n))
		}
		// ReadFrom returns less than asked, without an error, at EOF.
		if err != nil || n < asked {
			return total, err
		}
	}
	return total, nil
}

// copyBufs are the buffers copyFrom copies through.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// copyFrom copies r to the connection through Write (which counts).
func (c *countingConn) copyFrom(r io.Reader) (int64, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	return io.CopyBuffer(connWriter{c}, r, *bp)
}

// connWriter hides countingConn's ReadFrom from io.CopyBuffer, which would
// otherwise call it back.
type connWriter struct{ c *countingConn }

func (w connWriter) Write(p []byte) (int, error) { return w.c.Write(p) }

// errNoHalfClose is returned by CloseWrite and CloseRead when the inner
// connection cannot half-close.
var errNoHalfClose = errors.New("rebalance: the wrapped connection cannot half-close")

// CloseWrite shuts down the writing side, as *net.TCPConn does: net/http
// calls it before closing a connection, so that the client reads the
// whole response, and reverse_proxy calls it on an upgraded stream when
// the backend is done writing.
func (c *countingConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return fmt.Errorf("%w (%T)", errNoHalfClose, c.Conn)
}

// CloseRead shuts down the reading side, as *net.TCPConn does.
func (c *countingConn) CloseRead() error {
	if cr, ok := c.Conn.(interface{ CloseRead() error }); ok {
		return cr.CloseRead()
	}
	return fmt.Errorf("%w (%T)", errNoHalfClose, c.Conn)
}

// NetConn returns the inner connection, as *tls.Conn's NetConn does, so
// that code looking for the socket (connClosed) can unwrap this one.
func (c *countingConn) NetConn() net.Conn { return c.Conn }

// countedServers are the HTTP servers of the loaded configs whose
// listener_wrappers include rebalance, with the wrapper of each.
var countedServers = &serverRegistry{m: make(map[*caddyhttp.Server]*ListenerWrapper)}

// serverRegistry maps servers to the wrapper that counts their bytes.
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
	_ io.ReaderFrom         = (*countingConn)(nil)
)
