// Package calldeadline is the deadline of a combo handler's call
// (selective, partition): it starts when the handler starts, bounds the
// reading of the request body as well as the sub-requests, and is carried
// to the combo handlers nested in it, which take it instead of their own
// timeout (brpc's rule that a combo channel's timeout overrides its
// sub-channels').
package calldeadline

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

type key struct{}

// With returns ctx carrying deadline for the handlers nested below.
func With(ctx context.Context, deadline time.Time) context.Context {
	return context.WithValue(ctx, key{}, deadline)
}

// From returns the deadline an outer handler set, if any.
func From(ctx context.Context) (time.Time, bool) {
	d, ok := ctx.Value(key{}).(time.Time)
	return d, ok
}

// Start returns the deadline of a call that starts now: the one an outer
// handler set, which overrides timeout, else now plus timeout when it is
// positive; ok is false when the call has none. A handler calls it first,
// so that the deadline covers the whole call, the request body included.
func Start(ctx context.Context, timeout time.Duration) (deadline time.Time, ok bool) {
	if d, ok := From(ctx); ok {
		return d, true
	}
	if timeout > 0 {
		return time.Now().Add(timeout), true
	}
	return time.Time{}, false
}

// Bound returns ctx ending at deadline, the call's from Start (zero: none,
// and ctx is returned as it is), and carrying it to the combo handlers
// nested below (With), so that an outer handler's deadline bounds every
// level alike. When the deadline passes, context.Cause(ctx) is cause (nil:
// context.DeadlineExceeded). The caller must call the CancelFunc.
func Bound(ctx context.Context, deadline time.Time, cause error) (context.Context, context.CancelFunc) {
	if deadline.IsZero() {
		return ctx, func() {}
	}
	ctx, cancel := context.WithDeadlineCause(ctx, deadline, cause)
	return With(ctx, deadline), cancel
}

// ErrBodyTimeout is ReadBody's error when the deadline passed before the
// body was read. Handlers answer it 408 Request Timeout: the client, not
// an upstream, was too slow (RFC 9110 §15.5.9), and no upstream has seen
// the request yet.
var ErrBodyTimeout = errors.New("request body not received before the deadline")

// ReadBody reads r's body, at most limit bytes (limit+1 tells the caller
// the body is larger than limit), before deadline (zero: none). The
// deadline is set on the client connection through w's
// http.ResponseController, so a read that stalls is interrupted at the
// deadline; Caddy's own read timeouts (read_body, read_idle_timeout) still
// apply, as Caddy takes a handler's read deadline as a ceiling. When the
// body was read to its end the deadline must not stay on the connection
// (on HTTP/1, net/http's background read would cancel the request when it
// passes): Caddy's body reader clears it at the end of the body, and
// without one (read_idle_timeout negative) ReadBody lifts it. When the body
// was not read to its end, it stays, and also bounds what the caller
// streams of the rest. A writer that
// cannot set a read deadline (one not from net/http's server) leaves the
// read unbounded, and a body finished after the deadline is still
// ErrBodyTimeout.
//
// On ErrBodyTimeout the response is marked Connection: close on HTTP/1,
// as the rest of the body will not be read (RFC 9110 §15.5.9). Other
// errors are the body's own (the client went away, a malformed chunk,
// *http.MaxBytesError).
func ReadBody(w http.ResponseWriter, r *http.Request, limit int64, deadline time.Time) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	rc := http.NewResponseController(w)
	set := !deadline.IsZero() && rc.SetReadDeadline(deadline) == nil
	buf, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	late := !deadline.IsZero() && !time.Now().Before(deadline)
	if errors.Is(err, os.ErrDeadlineExceeded) || (late && (err == nil || isTimeout(err))) {
		CloseAfter(w, r)
		return nil, ErrBodyTimeout
	}
	if idle, _ := caddyhttp.IdleTimeoutsFromContext(r.Context()); set && idle == nil && err == nil && int64(len(buf)) <= limit {
		_ = rc.SetReadDeadline(time.Time{})
	}
	return buf, err
}

// CloseAfter marks the response to r Connection: close on HTTP/1, for an
// answer given before the request body was read (RFC 9110 §15.5.9); on
// HTTP/2 and HTTP/3 the server resets the stream's unread body itself.
func CloseAfter(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 {
		w.Header().Set("Connection", "close")
	}
}

// Stream is a request body that a handler streams to an upstream rather
// than reading it first, bounded by the call's deadline (see StreamBody).
type Stream struct {
	io.ReadCloser
	done     atomic.Bool
	timedOut atomic.Bool
}

// StreamBody bounds the reading of r's body, which the caller leaves to
// stream to an upstream, by deadline (zero: none), as ReadBody does, and
// makes r's body a Stream that tells whether it was read to its end: a
// call that ends at its deadline with the body incomplete was held up by
// the client (408), not by an upstream (504). What net/http's server
// drains of an unread body after the handler is bounded by the deadline
// too.
func StreamBody(w http.ResponseWriter, r *http.Request, deadline time.Time) *Stream {
	if !deadline.IsZero() {
		_ = http.NewResponseController(w).SetReadDeadline(deadline)
	}
	s := &Stream{ReadCloser: r.Body}
	r.Body = s
	return s
}

// Read reads the body and notes its end.
func (s *Stream) Read(p []byte) (int, error) {
	n, err := s.ReadCloser.Read(p)
	switch {
	case err == io.EOF:
		s.done.Store(true)
	case errors.Is(err, os.ErrDeadlineExceeded):
		s.timedOut.Store(true)
	}
	return n, err
}

// Complete reports whether the body was read to its end.
func (s *Stream) Complete() bool { return s.done.Load() }

// TimedOut reports whether a read of the body failed at a read deadline:
// the call's, or one of the server's read timeouts.
func (s *Stream) TimedOut() bool { return s.timedOut.Load() }

// Late reports whether the call ended for the client's body: a read of
// it timed out, or deadline (zero: none) has passed with the body not
// read to its end.
func (s *Stream) Late(deadline time.Time) bool {
	if s.TimedOut() {
		return true
	}
	return !s.Complete() && !deadline.IsZero() && !time.Now().Before(deadline)
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}
