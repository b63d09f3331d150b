package conntrack

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
)

// ByteCounters count the bytes read from and written to the connections
// accepted through their listeners (Listener). In and out sit on separate
// cache lines: a connection's reads and writes run on different
// goroutines (and cores), which would otherwise contend for one line. The
// zero value counts from zero; it is safe for concurrent use.
type ByteCounters struct {
	_   [64]byte
	in  atomic.Uint64 // bytes read from accepted connections
	_   [56]byte
	out atomic.Uint64 // bytes written to accepted connections
	_   [56]byte
	// zeroCopyOut is the part of out that the inner connection's ReadFrom
	// (sendfile, splice) moved without a copy through user space.
	zeroCopyOut atomic.Uint64
	// tlsUncounted counts connections passed through uncounted because
	// they were already TLS connections (the listener wraps a TLS one).
	tlsUncounted atomic.Uint64
}

// ByteTotals are a snapshot of ByteCounters.
type ByteTotals struct {
	// In is the number of bytes read from the connections accepted
	// (requests, uploads, TLS records from clients).
	In uint64 `json:"in"`
	// Out is the number of bytes written to them (responses, downloads).
	Out uint64 `json:"out"`
	// OutZeroCopy is the part of Out sent by sendfile or splice.
	OutZeroCopy uint64 `json:"out_zero_copy"`
	// TLSUncounted is the number of connections that arrived already
	// decrypted by tls (the counting listener placed after tls) and were
	// not counted.
	TLSUncounted uint64 `json:"tls_connections_not_counted"`
}

// Total returns In + Out.
func (b ByteTotals) Total() uint64 { return b.In + b.Out }

// Totals reads the counters. A nil receiver reads zeros.
func (b *ByteCounters) Totals() ByteTotals {
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

// Listener returns l with its accepted connections counting their bytes
// into b. It must wrap the raw listener, below tls, so that it counts the
// bytes on the wire and net/http still sees the *tls.Conn it needs for
// HTTPS and HTTP/2: a TLS connection (l is, or wraps, a TLS listener) is
// passed through uncounted, counted in TLSUncounted, and reported to
// onTLS, when not nil. A connection already counted (a second counting
// listener above this one) is never counted twice.
//
// Counting costs one atomic add per Read or Write call. The wrapped
// connection keeps what net/http and Caddy look for on an accepted
// connection: ReadFrom (so a sendfile path stays zero-copy), CloseWrite
// and CloseRead, deadlines, and NetConn to reach the socket. It also
// recognizes the cleartext HTTP/2 client preface, which the Tracker needs
// to shed h2c connections gracefully.
func (b *ByteCounters) Listener(l net.Listener, onTLS func()) net.Listener {
	return &countingListener{Listener: l, counters: b, onTLS: onTLS}
}

// countingListener wraps accepted connections in countingConn.
type countingListener struct {
	net.Listener
	counters *ByteCounters
	onTLS    func()
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
		l.counters.tlsUncounted.Add(1)
		if l.onTLS != nil {
			l.onTLS()
		}
		return c, nil
	case *countingConn:
		// Already counted by an outer wrapper: never count twice.
		return c, nil
	}
	return &countingConn{Conn: c, counters: l.counters}, nil
}

// countingConn counts the bytes read from and written to its connection.
type countingConn struct {
	net.Conn
	counters *ByteCounters
	// prefaceRead is how many of the bytes read so far matched the
	// HTTP/2 client preface, or -1 after a mismatch. Only Read uses it:
	// net/http reads a connection from one goroutine at a time.
	prefaceRead int
	// h2c is set once the whole preface has been read first thing: the
	// connection speaks cleartext HTTP/2, which the Tracker needs to know
	// to shed it gracefully and Go's server does not report
	// (sawH2Preface).
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
// cleartext HTTP/2 connection. Without a counting listener (or below a
// wrapper that hides the connection it wraps) it reports false.
func sawH2Preface(c net.Conn) bool {
	cc, ok := findConn[*countingConn](c)
	return ok && cc.h2c.Load()
}

// findConn returns the first connection of type T among c and the
// connections it wraps, unwrapping TLS (NetConn) and PROXY-protocol (Raw)
// wrappers, countingConn, which has NetConn too, and wrappers that only
// embed the connection they wrap (embeddedConn).
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
			if c = embeddedConn(c); c == nil {
				var zero T
				return zero, false
			}
		}
	}
	var zero T
	return zero, false
}

// embeddedConn returns the net.Conn that c, a struct or a pointer to one,
// embeds (its field Conn), or nil. Caddy wraps accepted connections so:
// a server limited to HTTP/1 or to HTTP/2 in its http2Conn, one whose
// listener wrapper returns TLS state without a *tls.Conn in its
// tlsStateConn, neither with a method that returns the connection.
func embeddedConn(c net.Conn) net.Conn {
	v := reflect.ValueOf(c)
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return nil
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return nil
	}
	sf, ok := v.Type().FieldByName("Conn")
	if !ok || !sf.Anonymous || sf.Type != reflect.TypeFor[net.Conn]() {
		return nil
	}
	f := v.FieldByIndex(sf.Index)
	if !f.CanInterface() || f.IsNil() {
		return nil
	}
	inner, _ := f.Interface().(net.Conn)
	return inner
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

// Interface guards
var _ io.ReaderFrom = (*countingConn)(nil)
