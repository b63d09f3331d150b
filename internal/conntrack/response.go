package conntrack

import (
	"bufio"
	"io"
	"net"
	"net/http"
)

// WrapResponseWriter returns the writer a handler should write r's
// response to, so that shedding r's connection is graceful at the HTTP
// layer: w itself when no Tracker tracks the connection (its ConnContext
// is not registered with r's server).
//
// When the connection has been shed (marked to close at its next response
// boundary) by the time the final response header is written, the
// response carries "Connection: close": an HTTP/1.1 client then opens a
// new connection for its next request instead of racing the close, and
// Go's HTTP/2 server turns the header into a graceful GOAWAY (streams in
// flight finish, new ones go to a new connection). An HTTP/1.1 WebSocket
// upgrade answered 101 through the writer hands the hijacking handler a
// connection that follows the frames written to the client, so that a
// shed sends a close frame (1001, going away) at the next frame boundary
// instead of cutting the stream (wsclose.go).
//
// The check costs one context lookup per request.
//
// draining, when not nil, is asked too: while it returns true the
// response carries "Connection: close" whether or not the connection was
// shed (a server in its shutdown delay, moving its clients off before it
// closes their idle connections). On a tracked connection it is asked as
// the final header is written; on another, once, here: w itself is
// returned unless the server is draining already (a client that sends a
// request during the delay gets the header on it).
func WrapResponseWriter(w http.ResponseWriter, r *http.Request, draining func(*http.Request) bool) http.ResponseWriter {
	tc, ok := r.Context().Value(connCtxKey{}).(*trackedConn)
	if !ok {
		if draining == nil || !draining(r) {
			return w
		}
		return &closeWriter{ResponseWriter: w, req: r, draining: draining}
	}
	if r.ProtoMajor >= 2 && !tc.h2.Load() {
		// The tracker then gives the server time to flush a shed
		// connection's last frames before closing it.
		tc.h2.Store(true)
	}
	return &closeWriter{ResponseWriter: w, tc: tc, req: r, draining: draining}
}

// closeWriter adds "Connection: close" to the final response header when
// its connection is marked for closing at that moment, and follows the
// frames of a WebSocket it hands over to a hijacking handler.
type closeWriter struct {
	http.ResponseWriter
	tc          *trackedConn // nil when no tracker follows the connection
	req         *http.Request
	draining    func(*http.Request) bool // see WrapResponseWriter; may be nil
	wroteHeader bool
	switched    bool // a 101 Switching Protocols response went through
}

// WriteHeader adds the header to a final (non-1xx) response on a shed
// connection. A 101 Switching Protocols response is left alone: the
// connection is being upgraded and is shed as a hijacked one.
func (cw *closeWriter) WriteHeader(status int) {
	if status == http.StatusSwitchingProtocols {
		cw.switched = true
	}
	if !cw.wroteHeader && status >= 200 {
		cw.wroteHeader = true
		if cw.tc != nil && cw.tc.closeAtBoundary() || cw.draining != nil && cw.draining(cw.req) {
			cw.Header().Set("Connection", "close")
			if cw.tc != nil && cw.req.ProtoMajor >= 2 {
				cw.tc.noteServerGoAway()
			}
		}
	}
	cw.ResponseWriter.WriteHeader(status)
}

// Hijack hands the connection to the handler (reverse_proxy does, after
// a 101 response). For a WebSocket upgrade answered 101 through this
// writer, the connection (and the buffered writer returned with it)
// follows the frames written to the client, and is registered with the
// tracker so that a shed closes it with a close frame. Anything else
// gets the connection as it is: the tracker closes it when shed.
func (cw *closeWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, brw, err := http.NewResponseController(cw.ResponseWriter).Hijack()
	// net/http flushes a 101 written before Hijack and hands back an
	// empty buffered writer; bytes already in it would have bypassed
	// the frame count, so such a stream is left alone.
	if err != nil || cw.tc == nil || !cw.switched || !isWebSocketUpgrade(cw.req) || brw == nil || brw.Writer.Buffered() > 0 {
		return conn, brw, err
	}
	ws := newWSConn(conn)
	brw.Writer.Reset(ws)
	// A shed in the instant between net/http's StateHijacked and this
	// store closes the socket, as without the wrapper.
	cw.tc.ws.Store(ws)
	return ws, brw, nil
}

// Write writes the header first, as net/http does implicitly.
func (cw *closeWriter) Write(p []byte) (int, error) {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	return cw.ResponseWriter.Write(p)
}

// ReadFrom writes the header first, then hands r to the underlying
// writer's ReadFrom (net/http's sendfile path) or copies it.
func (cw *closeWriter) ReadFrom(r io.Reader) (int64, error) {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	if rf, ok := cw.ResponseWriter.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(cw.ResponseWriter, r)
}

// Flush writes the header first, then flushes.
func (cw *closeWriter) Flush() {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	_ = http.NewResponseController(cw.ResponseWriter).Flush()
}

// Push passes an HTTP/2 server push on to the underlying writer.
func (cw *closeWriter) Push(target string, opts *http.PushOptions) error {
	if p, ok := cw.ResponseWriter.(http.Pusher); ok {
		return p.Push(target, opts)
	}
	return http.ErrNotSupported
}

// Unwrap returns the underlying writer, for http.ResponseController.
func (cw *closeWriter) Unwrap() http.ResponseWriter { return cw.ResponseWriter }

// Interface guards
var (
	_ http.Flusher  = (*closeWriter)(nil)
	_ http.Hijacker = (*closeWriter)(nil)
	_ http.Pusher   = (*closeWriter)(nil)
	_ io.ReaderFrom = (*closeWriter)(nil)
)
