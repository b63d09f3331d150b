package fleet

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"syscall"
	"time"
)

// IDHeader carries every no-retry request's own id, which IDCounter counts
// at the backend.
const IDHeader = "X-Lbx-Request-Id"

// The kinds of failure a client that never retries sees (FailureKind).
const (
	// KindEOF: the connection closed before any byte of the response
	// (Go's io.EOF).
	KindEOF = "EOF"
	// KindReset: the peer reset the connection, or a write found it
	// closed (ECONNRESET, EPIPE; Python's ConnectionResetError and
	// BrokenPipeError).
	KindReset = "reset"
	// KindRemoteDisconnected is Python http.client's EOF before the
	// status line.
	KindRemoteDisconnected = "RemoteDisconnected"
	// KindTimeout: no full response within the client's timeout.
	KindTimeout = "timeout"
	// KindShort: the connection closed within the response.
	KindShort = "short"
	// KindConnect: no connection could be opened; nothing was sent.
	KindConnect = "connect"
	// KindStatus: a response other than 200 "ok".
	KindStatus = "status"
	// KindOther is any other error.
	KindOther = "other"
)

// FailureKinds lists the kinds in the order reports show them.
var FailureKinds = []string{KindEOF, KindReset, KindRemoteDisconnected, KindTimeout, KindShort, KindConnect, KindStatus, KindOther}

// FailureKind names err as one of FailureKinds.
func FailureKind(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF):
		return KindShort
	case errors.Is(err, io.EOF):
		return KindEOF
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return KindReset
	case errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return KindTimeout
	case errors.Is(err, syscall.ECONNREFUSED):
		return KindConnect
	}
	return KindOther
}

// RawClient is an HTTP/1.1 keep-alive client that never retries: it
// writes each request on its one connection, reads the response with
// http.ReadResponse, and reuses the connection for the next. Any error is
// the request's failure, on a reused connection too (Go's http.Transport
// would write an idempotent request again on a new connection). A
// response with "Connection: close" closes the connection gracefully:
// the next request opens a new one. Not safe for concurrent use.
type RawClient struct {
	// Addr is the host:port to connect to.
	Addr string
	// Timeout bounds each request, from the dial to the response's last
	// byte.
	Timeout time.Duration
	// BodyDelay, when set, parts a request with a body: the client writes
	// its headers, waits BodyDelay, then writes the body, as a slow
	// upload does.
	BodyDelay time.Duration

	conn   net.Conn
	br     *bufio.Reader
	opened int
}

// RawResult is one request's outcome.
type RawResult struct {
	// Reused is true when the request went out on a connection that had
	// served an earlier one.
	Reused bool
	// Sent is true when the connection was open, so that some or all of
	// the request may have reached the server.
	Sent bool
	// Err is nil for a 200 "ok"; Kind is FailureKind's name for it, or
	// KindStatus for another response.
	Err  error
	Kind string
	// Closed is true when the response said "Connection: close".
	Closed bool
	// Stale is true when the reused connection had already closed (its
	// EOF or reset, or stray bytes, were waiting) before the request was
	// written: a client that looks before reusing a connection, as Go's
	// http.Transport does, would have opened a new one. A failure that is
	// not Stale is the true race: the close crossed the request.
	Stale bool
}

// Do sends one request with method (GET or POST; a POST carries body),
// the id in IDHeader, and reads the response.
func (c *RawClient) Do(method, id string, body []byte) RawResult {
	var r RawResult
	deadline := time.Now().Add(c.Timeout)
	if c.conn == nil {
		conn, err := net.DialTimeout("tcp", c.Addr, c.Timeout)
		if err != nil {
			r.Err, r.Kind = err, FailureKind(err)
			if r.Kind != KindTimeout {
				r.Kind = KindConnect
			}
			return r
		}
		c.conn, c.br = conn, bufio.NewReader(conn)
		c.opened++
	} else {
		r.Reused = true
		r.Stale = c.stale()
	}
	r.Sent = true
	r.Err = c.roundTrip(method, id, body, deadline, &r)
	switch {
	case r.Err == nil:
	case r.Kind == "":
		r.Kind = FailureKind(r.Err)
		fallthrough
	default:
		c.Close()
	}
	return r
}

// roundTrip writes the request and reads the whole response; it closes
// the connection after a "Connection: close" response.
func (c *RawClient) roundTrip(method, id string, body []byte, deadline time.Time, r *RawResult) error {
	if err := c.conn.SetDeadline(deadline); err != nil {
		return err
	}
	req := fmt.Appendf(nil, "%s / HTTP/1.1\r\nHost: %s\r\n%s: %s\r\n", method, c.Addr, IDHeader, id)
	if method != http.MethodGet {
		req = fmt.Appendf(req, "Content-Type: application/octet-stream\r\nContent-Length: %d\r\n", len(body))
	}
	req = append(req, "\r\n"...)
	if c.BodyDelay > 0 && len(body) > 0 {
		if _, err := c.conn.Write(req); err != nil {
			return err
		}
		time.Sleep(c.BodyDelay)
		req = nil
	}
	if _, err := c.conn.Write(append(req, body...)); err != nil {
		return err
	}
	// http.ReadResponse calls a close before the status line an
	// unexpected EOF; a close before any byte is the plain EOF of the
	// keep-alive race.
	if _, err := c.br.Peek(1); err != nil {
		return err
	}
	res, err := http.ReadResponse(c.br, nil)
	if err != nil {
		return err
	}
	data, err := io.ReadAll(res.Body)
	res.Body.Close()
	if err != nil {
		return err
	}
	if res.Close {
		r.Closed = true
		c.Close()
	}
	if res.StatusCode != http.StatusOK || string(data) != "ok" {
		r.Kind = KindStatus
		return fmt.Errorf("status %d, body %.40q", res.StatusCode, data)
	}
	return nil
}

// stale reports whether anything (an EOF, a reset, bytes) is waiting on
// the idle connection, without consuming it: the request is written
// anyway, as a client that does not look would.
func (c *RawClient) stale() bool {
	// A deadline already past fails the read before it is tried: give
	// the read one try, and a millisecond.
	if err := c.conn.SetReadDeadline(time.Now().Add(time.Millisecond)); err != nil {
		return true
	}
	_, err := c.br.Peek(1)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// Opened returns the connections the client has opened.
func (c *RawClient) Opened() int { return c.opened }

// Close closes the client's connection, if any.
func (c *RawClient) Close() {
	if c.conn != nil {
		c.conn.Close()
		c.conn, c.br = nil, nil
	}
}
