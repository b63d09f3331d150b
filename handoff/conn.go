package handoff

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// conn is a connection a listener gave its server. While a newer config
// listens on the address, it moves to the newer server:
//   - at its first read that returns bytes: the bytes and the socket go to
//     the newer server, and this one sees the connection end before its
//     first byte;
//   - when this server closes it having read the headers of an HTTP/1
//     request with a safe method (GET, HEAD, OPTIONS, TRACE), nothing after
//     them, and written nothing: that is net/http dropping a request it
//     read after its shutdown began (it checks between reading a request's
//     headers and calling the handler), and the request goes to the newer
//     server. A server that goes on to run the handler reads again first
//     (net/http's background read, or the body), and from then on the
//     connection stays. The method rule is the one net/http's client
//     follows to send a request again on a connection that closed: it
//     covers a handler that closed the connection unanswered (Caddy's
//     abort) before that read.
type conn struct {
	net.Conn // the accepted connection
	l        *listener
	// prefix is what an earlier server read before it handed the
	// connection over; reads return it first.
	prefix []byte
	// started is set by the first read that returns bytes, and headersRead
	// once what this server read holds the end of a request's headers;
	// only the server's reading goroutine touches them.
	started, headersRead bool
	// mu guards head: a copy of what this server read, up to the end of
	// the first request's headers, kept until it reads past them, for
	// Close to hand over.
	mu   sync.Mutex
	head []byte
	// wentOn is set once the server read past the headers, wrote, or read
	// more than maxHead without their end: the connection stays.
	wentOn atomic.Bool
	// handed is set once the connection went to another listener: then
	// this server's Close and half-closes leave it alone.
	handed atomic.Bool
}

// maxHead bounds the request headers a connection keeps a copy of.
// net/http's default limit is 1 MiB, but a request to send again is a
// short one; past this the connection stays with its server.
const maxHead = 16 << 10

// headEnd ends an HTTP/1 request's headers.
var headEnd = []byte("\r\n\r\n")

// Read reads from the prefix, then from the connection. The first read
// that returns bytes hands the connection over instead, if a newer
// listener has joined the hub since this one took it.
func (c *conn) Read(p []byte) (int, error) {
	if c.handed.Load() {
		return 0, io.EOF
	}
	if c.wentOn.Load() {
		return c.read(p)
	}
	if c.headersRead {
		c.goOn()
		return c.read(p)
	}
	n, err := c.read(p)
	if n == 0 {
		return n, err
	}
	if !c.started {
		if newest, _ := c.l.hub.newest(); newest != nil && newest != c.l && err == nil {
			c.handOver(p[:n])
			return 0, io.EOF
		}
		c.started = true
	}
	c.mu.Lock()
	c.head = append(c.head, p[:n]...)
	c.headersRead = bytes.Contains(c.head, headEnd)
	tooLong := !c.headersRead && len(c.head) > maxHead
	c.mu.Unlock()
	if tooLong {
		c.goOn()
	}
	return n, err
}

// goOn marks the connection as staying with this server.
func (c *conn) goOn() {
	if c.wentOn.Load() {
		return
	}
	c.mu.Lock()
	c.wentOn.Store(true)
	c.head = nil
	c.mu.Unlock()
}

func (c *conn) read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// handOver gives the socket, with read (what this server read and did
// not use) before the rest of the prefix, to the newest listener.
func (c *conn) handOver(read []byte) {
	c.handed.Store(true)
	// The new server sets the deadlines it wants; it need not clear the
	// old server's (net/http leaves a write deadline alone without a
	// WriteTimeout).
	c.Conn.SetDeadline(time.Time{})
	prefix := append(append([]byte(nil), read...), c.prefix...)
	c.prefix = nil
	c.l.hub.put(accepted{conn: c.Conn, prefix: prefix, from: c.l})
}

// dropped returns what the server read, if it closes c after reading the
// headers of a request it never served while a newer listener exists (see
// conn).
func (c *conn) dropped() (read []byte, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.wentOn.Load() || !bytes.Contains(c.head, headEnd) || !safeRequest(c.head) {
		return nil, false
	}
	newest, _ := c.l.hub.newest()
	return c.head, newest != nil && newest != c.l
}

// safeRequest reports whether b starts an HTTP/1 request with a safe
// method.
func safeRequest(b []byte) bool {
	for _, m := range [...]string{"GET ", "HEAD ", "OPTIONS ", "TRACE "} {
		if bytes.HasPrefix(b, []byte(m)) {
			return true
		}
	}
	return false
}

// errHandedOver is what writes to a connection that went to another
// server return.
var errHandedOver = errors.New("lbx_handoff: the connection went to a newer config's server")

// Write writes to the connection, unless it was handed over.
func (c *conn) Write(p []byte) (int, error) {
	if c.handed.Load() {
		return 0, errHandedOver
	}
	c.goOn()
	return c.Conn.Write(p)
}

// Close closes the connection, unless it was handed over or a dropped
// request goes to a newer server with it.
func (c *conn) Close() error {
	if c.handed.Load() {
		return nil
	}
	if read, ok := c.dropped(); ok {
		c.handOver(read)
		return nil
	}
	return c.Conn.Close()
}

// CloseWrite shuts down the writing side, as *net.TCPConn does (net/http
// calls it before closing a connection).
func (c *conn) CloseWrite() error {
	if c.handed.Load() {
		return nil
	}
	c.goOn()
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// CloseRead shuts down the reading side, as *net.TCPConn does.
func (c *conn) CloseRead() error {
	if c.handed.Load() {
		return nil
	}
	if cr, ok := c.Conn.(interface{ CloseRead() error }); ok {
		return cr.CloseRead()
	}
	return nil
}

// ReadFrom lets net/http send a file with the socket's own ReadFrom
// (sendfile) when it has one.
func (c *conn) ReadFrom(r io.Reader) (int64, error) {
	if c.handed.Load() {
		return 0, errHandedOver
	}
	c.goOn()
	if rf, ok := c.Conn.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(writerOnly{c}, r)
}

// writerOnly hides conn's ReadFrom from io.Copy, which would call it back.
type writerOnly struct{ io.Writer }

// NetConn returns the accepted connection, as *tls.Conn's does, for code
// that looks for the socket under wrappers.
func (c *conn) NetConn() net.Conn { return c.Conn }

// Interface guards
var _ io.ReaderFrom = (*conn)(nil)
