package handoff

import (
	"bytes"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// conn is a connection a listener gave its server. While a newer config
// listens on the address, it moves to the newer server:
//   - at its first read that returns bytes: the bytes and the socket go to
//     the newer server, and this one sees the connection end before its
//     first byte;
//   - when net/http's Shutdown closes it as idle (closeIdleConns): it is
//     between two requests, or has read part of the next one, which no
//     handler will see (see handIdle). The socket goes to the newer server
//     with what this one read of the next request, whatever its method,
//     and with the bytes that arrive at that instant;
//   - when net/http closes it as its serve loop ends, without a panic,
//     having read a request's headers and nothing after them, and written
//     nothing since: no handler saw that request (see unservedLocked), and
//     it goes to the newer server whatever its method;
//   - when net/http closes it right after a complete response because it
//     is shutting down: Close waits for closeIdleConns, which proves the
//     response complete (see atBoundaryLocked);
//   - when anything else closes it having read the headers of an HTTP/1
//     request with a safe method (GET, HEAD, OPTIONS, TRACE), nothing after
//     them, and written nothing since. A server that goes on to run the
//     handler reads again first (net/http's background read, or the body),
//     and from then on the request stays. The method rule is the one
//     net/http's client follows to send a request again on a connection
//     that closed: it covers a handler that closed the connection
//     unanswered before that read.
//
// To know where requests begin, it follows the framing of the requests it
// reads (headers and Content-Length); a connection it cannot follow (TLS,
// HTTP/2, PROXY protocol, chunked or upgraded requests, pipelining) stays
// with its server from then on.
type conn struct {
	net.Conn // the accepted connection
	l        *listener
	// prefix is what an earlier server read before it handed the
	// connection over; reads return it first. started is set by the first
	// read that returns bytes. Only the reading goroutine touches them
	// (and Close, once that goroutine can no longer read).
	prefix  []byte
	started bool

	// stays is set once the connection can no longer move: then reads,
	// writes and deadlines go straight to the socket.
	stays atomic.Bool
	// handed is set once the connection went to another listener: then
	// this server's reads end, its writes fail, and its Close, half-closes
	// and deadlines leave the socket alone.
	handed atomic.Bool

	// mu guards what follows, and makes a read and a Close that hands the
	// connection over agree on who owns the bytes that arrive then.
	mu   sync.Mutex
	cond *sync.Cond // on mu: a read ended; made by the Close that waits
	// reading is set while a read is in progress; handing once Close has
	// begun to hand the connection over: the read in progress gives what
	// it read to diverted instead of the server.
	reading, handing bool
	diverted         []byte
	// offset counts the bytes this server has read; req is the request they
	// are in (or the last one).
	offset int64
	req    request
	// finished is set when the server set the write deadline after its
	// last write (net/http clears it after a complete response, not after
	// an aborted one); respClose when the last response's headers carry
	// Connection: close.
	finished, respClose bool
	// idleWait is closed when closeIdleConns hands the connection over
	// while a Close waits for it (see atBoundaryLocked).
	idleWait chan struct{}
}

// request is where the server is in the request it reads.
type request struct {
	begun, headDone bool
	// start is the offset of its first byte; end, once the headers are
	// read, that of the byte after its body.
	start, end int64
	// answered is set by a write after its headers; running by a read
	// after them (the handler's, or net/http's background read).
	answered, running bool
	// bytes is what the server read of it, while it is neither answered
	// nor running: what goes to a newer server with the socket.
	bytes []byte
}

// maxHead bounds the request headers a connection keeps a copy of.
// net/http's default limit is 1 MiB, but a request to send again is a
// short one; past this the connection stays with its server.
const maxHead = 16 << 10

// idleCloseWait bounds how long a Close after a complete response waits
// for net/http's closeIdleConns, which polls at least every 500 ms
// (shutdownPollIntervalMax) plus 10% jitter.
const idleCloseWait = time.Second

// headEnd ends an HTTP/1 request's headers.
var headEnd = []byte("\r\n\r\n")

// aLongTimeAgo is a read deadline that ends a read at once.
var aLongTimeAgo = time.Unix(1, 0)

// Read reads from the prefix, then from the connection. The first read
// that returns bytes hands the connection over instead, if a newer
// listener has joined the hub since this one took it. A read that a Close
// handing the connection over cuts short gives what it got to the newer
// server and returns io.EOF.
func (c *conn) Read(p []byte) (int, error) {
	if c.stays.Load() {
		return c.read(p)
	}
	c.mu.Lock()
	if c.handing || c.handed.Load() {
		c.mu.Unlock()
		return 0, io.EOF
	}
	if r := &c.req; r.headDone && !r.running {
		// A read after the headers: the handler runs, or net/http's
		// background read that comes before it.
		r.running = true
		r.bytes = r.bytes[:0]
	}
	c.reading = true
	c.mu.Unlock()

	n, err := c.read(p)

	c.mu.Lock()
	c.reading = false
	if c.handing {
		// Close hands the connection over: what arrived is the newer
		// server's.
		c.diverted = append(c.diverted, p[:n]...)
		c.cond.Broadcast()
		c.mu.Unlock()
		return 0, io.EOF
	}
	if n > 0 && !c.started {
		c.started = true
		if newest, _ := c.l.hub.newest(); newest != nil && newest != c.l && err == nil {
			prefix := c.takeLocked(p[:n])
			c.mu.Unlock()
			c.giveAway(prefix)
			return 0, io.EOF
		}
	}
	if n > 0 {
		c.track(p[:n])
	}
	c.mu.Unlock()
	return n, err
}

func (c *conn) read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// stayLocked marks the connection as staying with this server.
func (c *conn) stayLocked() {
	c.stays.Store(true)
	c.req.bytes = nil
	c.diverted = nil
}

// track follows the requests in b, what the server just read.
func (c *conn) track(b []byte) {
	r := &c.req
	for start := true; len(b) > 0; start = false {
		if !r.begun || r.headDone && c.offset == r.end {
			if !c.beginLocked(b[0], start) {
				return
			}
		}
		if !r.headDone {
			if !c.headLocked(&b) {
				return
			}
			continue
		}
		k := int(min(int64(len(b)), r.end-c.offset))
		if !r.running {
			// Body that came with the headers, in the same read.
			r.bytes = append(r.bytes, b[:k]...)
		}
		c.offset += int64(k)
		b = b[k:]
	}
}

// beginLocked starts a request whose first byte is first; readStart is
// set if it is the first byte of a read.
func (c *conn) beginLocked(first byte, readStart bool) bool {
	if c.offset > 0 && !readStart {
		// Read with the end of the last request, before its response
		// (pipelining, or a body read after the response): the server
		// may hold bytes of it that this connection cannot see. A
		// request that begins a read is one net/http reads after the
		// response (or net/http's background read caught its first
		// byte: then any write before the rest is read makes the
		// connection stay, see wrote).
		c.stayLocked()
		return false
	}
	if first < 'A' || first > 'Z' {
		// Not an HTTP/1 request line: TLS, the PROXY protocol's binary
		// header, ...
		c.stayLocked()
		return false
	}
	keep := c.req.bytes[:0]
	if cap(keep) > 4<<10 {
		keep = nil // after long headers, not kept for the connection's life
	}
	c.req = request{begun: true, start: c.offset, bytes: keep}
	return true
}

// headLocked takes from *b the bytes of the request's headers, up to their
// end.
func (c *conn) headLocked(b *[]byte) bool {
	r := &c.req
	old := len(r.bytes)
	r.bytes = append(r.bytes, *b...)
	from := max(0, old-len(headEnd)+1)
	i := indexHeadEnd(r.bytes[from:])
	if i < 0 {
		if len(r.bytes) > maxHead {
			c.stayLocked()
			return false
		}
		c.offset += int64(len(*b))
		*b = nil
		return true
	}
	headLen := from + i + len(headEnd)
	r.bytes = r.bytes[:headLen]
	c.offset += int64(headLen - old)
	*b = (*b)[headLen-old:]
	length, ok := bodyLength(r.bytes)
	if !ok {
		c.stayLocked()
		return false
	}
	r.headDone = true
	r.end = c.offset + length
	return true
}

// indexHeadEnd returns the index of the first headEnd in b, or -1. It
// looks at each line feed, fewer than bytes.Index's candidates in headers.
func indexHeadEnd(b []byte) int {
	for i := 0; ; {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return -1
		}
		i += j
		if i >= 3 && b[i-3] == '\r' && b[i-2] == '\n' && b[i-1] == '\r' {
			return i - 3
		}
		i++
	}
}

// bodyLength returns the length of the body of the HTTP/1.1 request whose
// headers are head, if it is given by Content-Length (or there is none)
// and the connection stays HTTP/1.1 after it: not CONNECT, not an upgrade,
// not HTTP/2's preface.
func bodyLength(head []byte) (int64, bool) {
	line, rest := cutLine(head[:len(head)-len(headEnd)+2])
	method, _, _ := bytes.Cut(line, []byte(" "))
	if string(method) == "CONNECT" || string(method) == "PRI" || !bytes.HasSuffix(line, []byte(" HTTP/1.1")) {
		// HTTP/1.0 too: net/http closes after its response, unless asked
		// to keep it alive, without saying Connection: close.
		return 0, false
	}
	length := int64(-1)
	for len(rest) > 0 {
		line, rest = cutLine(rest)
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || len(name) == 0 || name[0] == ' ' || name[0] == '\t' {
			return 0, false // folded or malformed: net/http rejects it
		}
		switch {
		case len(name) == len("Content-Length") && bytes.EqualFold(name, []byte("Content-Length")):
			n, ok := parseLength(bytes.TrimSpace(value))
			if !ok || length >= 0 && n != length {
				return 0, false
			}
			length = n
		case bytes.EqualFold(name, []byte("Transfer-Encoding")), bytes.EqualFold(name, []byte("Upgrade")):
			return 0, false
		}
	}
	return max(length, 0), true
}

// cutLine cuts b, headers whose lines end with CRLF, after its first
// line.
func cutLine(b []byte) (line, rest []byte) {
	i := bytes.IndexByte(b, '\n')
	if i < 0 {
		return b, nil
	}
	return bytes.TrimSuffix(b[:i], []byte("\r")), b[i+1:]
}

// parseLength parses a Content-Length value: decimal digits only, as
// net/http takes it.
func parseLength(v []byte) (int64, bool) {
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for _, d := range v {
		if d < '0' || d > '9' {
			return 0, false
		}
		n = n*10 + int64(d-'0')
	}
	return n, true
}

// takeLocked marks the connection as handed over and returns what goes
// with the socket: read (bytes the server read and did not serve), then
// the prefix it has not read yet.
func (c *conn) takeLocked(read []byte) []byte {
	c.handed.Store(true)
	prefix := append(append([]byte(nil), read...), c.prefix...)
	c.prefix = nil
	return prefix
}

// giveAway gives the socket, with prefix to read first, to the newest
// listener.
func (c *conn) giveAway(prefix []byte) {
	// The new server sets the deadlines it wants; it need not clear the
	// old server's (net/http leaves a write deadline alone without a
	// WriteTimeout).
	c.Conn.SetDeadline(time.Time{})
	c.l.hub.put(accepted{conn: c.Conn, prefix: prefix, from: c.l})
}

// unservedLocked returns what the server read of the request it read last,
// if it closes c (by) with no handler having seen that request, and a
// newer server may serve it: the server read the request's headers and
// nothing after them, wrote nothing since, and
//   - net/http closes c as its serve loop ends without a panic: the only
//     way out of that loop between reading a request and calling its
//     handler, without writing, is the check of whether the server is
//     shutting down (a handler that runs ends in a response, a panic, or
//     a hijack, after which net/http does not close the connection), so
//     the request goes, whatever its method;
//   - or the request's method is safe (see conn).
func (c *conn) unservedLocked(by closer) (read []byte, ok bool) {
	r := &c.req
	if !r.headDone || r.running || r.answered || int64(len(r.bytes)) != c.offset-r.start {
		return nil, false
	}
	return r.bytes, by == serveEnd || safeRequest(r.bytes)
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
	if c.stays.Load() {
		return c.Conn.Write(p)
	}
	if !c.wrote(p) {
		return 0, errHandedOver
	}
	return c.Conn.Write(p)
}

// wrote notes that the server writes p, and reports whether it may.
func (c *conn) wrote(p []byte) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.handing || c.handed.Load() {
		return false
	}
	r := &c.req
	if !r.headDone {
		// Before a request or within its headers: an error response, or
		// the rest of a response after net/http's background read caught
		// the first byte of the next request (pipelining).
		c.stayLocked()
		return true
	}
	r.answered = true
	r.bytes = r.bytes[:0]
	c.finished = false
	if bytes.HasPrefix(p, []byte("HTTP/1.")) {
		head := p
		if i := indexHeadEnd(p); i >= 0 {
			head = p[:i+2]
		}
		// net/http writes the header as Connection: close.
		c.respClose = bytes.Contains(head, []byte("\r\nConnection: close\r\n"))
	}
	return true
}

// SetDeadline sets the socket's deadlines, unless it was handed over.
func (c *conn) SetDeadline(t time.Time) error {
	return c.setDeadline(t, true, true)
}

// SetReadDeadline sets the socket's read deadline, unless it was handed
// over.
func (c *conn) SetReadDeadline(t time.Time) error {
	return c.setDeadline(t, true, false)
}

// SetWriteDeadline sets the socket's write deadline, unless it was handed
// over.
func (c *conn) SetWriteDeadline(t time.Time) error {
	return c.setDeadline(t, false, true)
}

func (c *conn) setDeadline(t time.Time, read, write bool) error {
	set := func() error {
		switch {
		case read && write:
			return c.Conn.SetDeadline(t)
		case read:
			return c.Conn.SetReadDeadline(t)
		default:
			return c.Conn.SetWriteDeadline(t)
		}
	}
	if c.stays.Load() {
		return set()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.handing || c.handed.Load() {
		// The socket is the newer server's: the old one's deadlines
		// would cut its reads short.
		return nil
	}
	if write {
		c.finished = true
	}
	return set()
}

// Close closes the connection, unless it was handed over or goes to a
// newer server now.
func (c *conn) Close() error {
	if c.handed.Load() {
		return nil
	}
	if c.stays.Load() {
		return c.Conn.Close()
	}
	if newest, _ := c.l.hub.newest(); newest == nil || newest == c.l {
		return c.Conn.Close()
	}
	by := closedBy()
	c.mu.Lock()
	if c.handing || c.handed.Load() {
		c.mu.Unlock()
		return nil
	}
	if wait := c.idleWait; wait != nil && by != idleCloser {
		// Closed another way while a Close waits at a boundary.
		c.idleWait = nil
		c.stayLocked()
		c.mu.Unlock()
		close(wait)
		return c.Conn.Close()
	}
	if by == idleCloser {
		return c.handIdle()
	}
	if read, ok := c.unservedLocked(by); ok {
		prefix := c.takeLocked(read)
		c.mu.Unlock()
		c.giveAway(prefix)
		return nil
	}
	if by == serveEnd && c.atBoundaryLocked() {
		return c.waitIdle()
	}
	c.stayLocked()
	c.mu.Unlock()
	return c.Conn.Close()
}

// handIdle hands over a connection net/http's Shutdown closes as idle;
// c.mu is held and is released.
//
// closeIdleConns closes only connections in StateIdle (or StateNew for
// over 5 s): net/http sets StateIdle after a complete response that
// leaves the connection open, and StateActive after it reads the next
// request's headers, before it checks whether it is shutting down and
// only then calls the handler. Shutdown marks the server as shutting down
// before it calls closeIdleConns. So a connection it closes had its last
// response complete, and no handler ever sees what the server read of the
// next request: that check comes after StateActive, which comes after the
// StateIdle closeIdleConns saw. The server read nothing of that request
// before the response was done (see beginLocked and wrote: else the
// connection stays), so req.bytes is all it holds of it, and the request
// can go to the newer server whatever its method.
func (c *conn) handIdle() error {
	r := &c.req
	var read []byte
	switch {
	case r.begun && !r.answered:
		// The next request, or part of it.
		if r.running || int64(len(r.bytes)) != c.offset-r.start {
			c.stayLocked()
			c.mu.Unlock()
			return c.Conn.Close()
		}
		read = r.bytes
	case r.begun && c.offset != r.end:
		// Idle with the body not all read: not net/http's idle.
		c.stayLocked()
		c.mu.Unlock()
		return c.Conn.Close()
	}
	c.handing = true
	if c.reading {
		// The server waits for the next request: end its read, and
		// take what arrives in it.
		if c.cond == nil {
			c.cond = sync.NewCond(&c.mu)
		}
		c.Conn.SetReadDeadline(aLongTimeAgo)
		for c.reading {
			c.cond.Wait()
		}
	}
	prefix := c.takeLocked(append(append([]byte(nil), read...), c.diverted...))
	c.diverted = nil
	wait := c.idleWait
	c.idleWait = nil
	c.mu.Unlock()
	c.giveAway(prefix)
	if wait != nil {
		close(wait)
	}
	return nil
}

// atBoundaryLocked reports whether the server closes c right after a
// complete response to the last request it read, with all of it read:
// net/http does when it finishes a response after its shutdown began. But
// it does too after a handler that wrote less than its Content-Length, so
// Close waits for closeIdleConns (see handIdle), which closes the
// connection too if, and only if, net/http saw the response complete.
func (c *conn) atBoundaryLocked() bool {
	r := &c.req
	if !c.finished || c.respClose || c.reading || c.idleWait != nil {
		return false
	}
	if r.answered {
		return c.offset == r.end
	}
	// The first bytes of the next request, that net/http's background
	// read caught after the response: they go with the connection.
	return r.begun && !r.headDone && !r.running && int64(len(r.bytes)) == c.offset-r.start
}

// waitIdle waits up to idleCloseWait for closeIdleConns to hand c over,
// and closes it if it does not; c.mu is held and is released.
func (c *conn) waitIdle() error {
	wait := make(chan struct{})
	c.idleWait = wait
	c.mu.Unlock()
	t := time.NewTimer(idleCloseWait)
	select {
	case <-wait:
		t.Stop()
		return nil
	case <-t.C:
	}
	c.mu.Lock()
	if c.handed.Load() || c.idleWait != wait {
		c.mu.Unlock()
		return nil
	}
	c.idleWait = nil
	c.stayLocked()
	c.mu.Unlock()
	return c.Conn.Close()
}

// closer is who closes a connection, as far as it matters here.
type closer int

const (
	otherCloser closer = iota
	// idleCloser is net/http's closeIdleConns, which Shutdown closes idle
	// connections with (see handIdle).
	idleCloser
	// serveEnd is net/http's serve loop, as it ends without a panic (see
	// unservedLocked).
	serveEnd
)

// closedBy tells who called Close, from its caller's stack (through
// wrappers after lbx_handoff, such as tls.Conn's or rebalance's Close):
// net/http's closeIdleConns; or net/http's conn.close called by the
// function serve defers, as serve returns (not during a panic or
// runtime.Goexit, which run it from their own frames). Functions renamed
// in a later Go make it otherCloser: connections then close as they would
// without lbx_handoff.
func closedBy() closer {
	var pcs [12]uintptr
	n := runtime.Callers(3, pcs[:]) // above Callers, this function and Close
	frames := runtime.CallersFrames(pcs[:n])
	for {
		f, more := frames.Next()
		switch f.Function {
		case "net/http.(*Server).closeIdleConns":
			return idleCloser
		case "net/http.(*conn).close":
			deferred, more := frames.Next()
			serve, _ := frames.Next()
			if more && strings.HasPrefix(deferred.Function, "net/http.(*conn).serve.func") && serve.Function == "net/http.(*conn).serve" {
				return serveEnd
			}
			return otherCloser
		}
		if !more {
			return otherCloser
		}
	}
}

// CloseWrite shuts down the writing side, as *net.TCPConn does (net/http
// calls it before closing a connection).
func (c *conn) CloseWrite() error {
	if c.handed.Load() {
		return nil
	}
	if !c.stays.Load() {
		c.mu.Lock()
		handed := c.handing || c.handed.Load()
		if !handed {
			c.stayLocked()
		}
		c.mu.Unlock()
		if handed {
			return nil
		}
	}
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
	if !c.stays.Load() && !c.wrote(nil) {
		return 0, errHandedOver
	}
	if rf, ok := c.Conn.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(writerOnly{c.Conn}, r)
}

// writerOnly hides a ReadFrom from io.Copy.
type writerOnly struct{ io.Writer }

// NetConn returns the accepted connection, as *tls.Conn's does, for code
// that looks for the socket under wrappers.
func (c *conn) NetConn() net.Conn { return c.Conn }

// Interface guards
var _ io.ReaderFrom = (*conn)(nil)
