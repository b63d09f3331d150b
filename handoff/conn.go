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
//   - when this server closes it having read once and written nothing, and
//     what it read is an HTTP/1 request with a safe method (GET, HEAD,
//     OPTIONS, TRACE): that is net/http dropping a request it read after its
//     shutdown began (it checks between reading a request and calling the
//     handler), and the request goes to the newer server. A server that
//     goes on to run the handler reads again first (net/http's background
//     read, or the body), and from then on the connection stays. The
//     method rule is the one net/http's client follows to send a request
//     again on a connection that closed: it covers a handler that closed
//     the connection unanswered (Caddy's abort) before that read.
type conn struct {
	net.Conn // the accepted connection
	l        *listener
	// prefix is what an earlier server read before it handed the
	// connection over; reads return it first.
	prefix []byte
	// started is set by the first read that returns bytes; only the
	// server's reading goroutine touches it.
	started bool
	// mu guards first, a copy of what that read gave this server, kept
	// until the server reads again (readAgain), for Close to hand over.
	mu    sync.Mutex
	first []byte
	// readAgain is set by any read after the first; wrote by any write.
	readAgain, wrote atomic.Bool
	// handed is set once the connection went to another listener: then
	// this server's Close and half-closes leave it alone.
	handed atomic.Bool
}

// Read reads from the prefix, then from the connection. The first read
// that returns bytes hands the connection over instead, if a newer
// listener has joined the hub since this one took it.
func (c *conn) Read(p []byte) (int, error) {
	if c.handed.Load() {
		return 0, io.EOF
	}
	if c.started {
		if !c.readAgain.Load() {
			c.mu.Lock()
			c.readAgain.Store(true)
			c.first = nil
			c.mu.Unlock()
		}
		return c.read(p)
	}
	n, err := c.read(p)
	if n == 0 {
		return n, err
	}
	if newest, _ := c.l.hub.newest(); newest != nil && newest != c.l && err == nil {
		c.handOver(p[:n])
		return 0, io.EOF
	}
	c.started = true
	c.mu.Lock()
	c.first = append([]byte(nil), p[:n]...)
	c.mu.Unlock()
	return n, err
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

// dropped returns what the server read, if it closes c after reading one
// request it never served while a newer listener exists (see conn).
func (c *conn) dropped() (read []byte, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.first == nil || c.readAgain.Load() || c.wrote.Load() || !safeRequest(c.first) {
		return nil, false
	}
	newest, _ := c.l.hub.newest()
	return c.first, newest != nil && newest != c.l
}

func (c *conn) read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
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
	c.wrote.Store(true)
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
	c.wrote.Store(true)
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
	c.wrote.Store(true)
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
