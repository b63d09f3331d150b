package rebalance

import (
	"bufio"
	"io"
	"net"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(CloseHandler{})
	httpcaddyfile.RegisterHandlerDirective("rebalance_close", parseCloseHandler)
	// First of all: every response of the route, whichever handler
	// writes it, passes through the wrapper.
	httpcaddyfile.RegisterDirectiveOrder("rebalance_close", httpcaddyfile.Before, "tracing")
}

// CloseHandler makes shedding graceful at the HTTP layer. When the
// rebalance app has shed the connection a request arrived on (marked it
// to close at its next response boundary), the response carries
// "Connection: close": an HTTP/1.1 client then opens a new connection,
// through the outer load balancer, for its next request instead of racing
// the close, and Go's HTTP/2 server (Caddy's) turns the header into a
// graceful GOAWAY: streams in flight finish, new ones go to a new
// connection.
//
// The mark is checked when the response's header is written, so a
// connection shed while its handler runs (a slow upstream, a long
// download) still closes cleanly after that response. Without this
// handler, a shed active connection is closed when it next becomes idle
// (after its response), which an HTTP/1.1 client sees as an ordinary
// keep-alive close, and an HTTP/2 one gets a GOAWAY from the tracker once
// it has had no stream for a second (as a shed idle one does): an HTTP/2
// connection whose requests come closer together than that, such as a
// busy gRPC channel, is shed only through this handler. Put it in every
// site that holds long-lived client connections; it costs one context
// lookup per response.
//
// It also makes shedding an upgraded WebSocket graceful. When a handler
// (reverse_proxy) answers an HTTP/1.1 WebSocket upgrade with 101 and
// hijacks the connection, the connection it gets follows the frames it
// writes to the client, and a shed sends a Close frame (1001, going away)
// at the next frame boundary, drops what the proxy writes after it, and
// closes the connection 1 s later or as soon as the client closes its
// end; a stream still inside a frame 1 s after the shed is closed without
// one. Other upgrades, HTTP/2 WebSockets (extended CONNECT: a stream, not
// a hijacked connection) and routes without this handler are closed as
// before.
type CloseHandler struct{}

// CaddyModule returns the Caddy module information.
func (CloseHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rebalance_close",
		New: func() caddy.Module { return new(CloseHandler) },
	}
}

// ServeHTTP wraps the response writer so that the final response header
// says "Connection: close" when the connection was shed.
func (CloseHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	tc, ok := r.Context().Value(connCtxKey{}).(*trackedConn)
	if !ok {
		// Not a connection the tracker knows (no rebalance app, or a
		// server it is not registered with).
		return next.ServeHTTP(w, r)
	}
	if r.ProtoMajor >= 2 && !tc.h2.Load() {
		// The tracker then gives the server time to flush a shed
		// connection's last frames before closing it.
		tc.h2.Store(true)
	}
	return next.ServeHTTP(&closeWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, tc: tc, req: r}, r)
}

// closeWriter adds "Connection: close" to the final response header when
// its connection is marked for closing at that moment, and follows the
// frames of a WebSocket it hands over to a hijacking handler.
type closeWriter struct {
	*caddyhttp.ResponseWriterWrapper
	tc          *trackedConn
	req         *http.Request
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
		if cw.tc.closeAtBoundary() {
			cw.Header().Set("Connection", "close")
			if cw.req.ProtoMajor >= 2 {
				cw.tc.noteServerGoAway()
			}
		}
	}
	cw.ResponseWriterWrapper.WriteHeader(status)
}

// Hijack hands the connection to the handler (reverse_proxy does, after
// a 101 response). For a WebSocket upgrade answered 101 through this
// writer, the connection (and the buffered writer returned with it)
// follows the frames written to the client, and is registered with the
// tracker so that a shed closes it with a close frame. Anything else
// gets the connection as it is: the tracker closes it when shed.
func (cw *closeWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, brw, err := http.NewResponseController(cw.ResponseWriterWrapper).Hijack()
	// net/http flushes a 101 written before Hijack and hands back an
	// empty buffered writer; bytes already in it would have bypassed
	// the frame count, so such a stream is left alone.
	if err != nil || !cw.switched || !isWebSocketUpgrade(cw.req) || brw == nil || brw.Writer.Buffered() > 0 {
		return conn, brw, err
	}
	ws := newWSConn(conn)
	brw.Writer.Reset(ws)
	// A shed in the instant between net/http's StateHijacked and this
	// store closes the socket, as without this handler.
	cw.tc.ws.Store(ws)
	return ws, brw, nil
}

// Write writes the header first, as net/http does implicitly.
func (cw *closeWriter) Write(p []byte) (int, error) {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	return cw.ResponseWriterWrapper.Write(p)
}

// ReadFrom writes the header first; the wrapper's ReadFrom would pass
// the body to the underlying writer without it.
func (cw *closeWriter) ReadFrom(r io.Reader) (int64, error) {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	return cw.ResponseWriterWrapper.ReadFrom(r)
}

// Flush writes the header first, then flushes.
func (cw *closeWriter) Flush() {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	_ = http.NewResponseController(cw.ResponseWriterWrapper).Flush()
}

// parseCloseHandler parses the `rebalance_close` directive.
func parseCloseHandler(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	ch := new(CloseHandler)
	if err := ch.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return ch, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rebalance_close [<matcher>]
//
// It takes no arguments and no block.
func (*CloseHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return noOptions(d, "rebalance_close")
}

// Interface guards
var (
	_ caddyhttp.MiddlewareHandler = (*CloseHandler)(nil)
	_ caddyfile.Unmarshaler       = (*CloseHandler)(nil)
	_ http.Flusher                = (*closeWriter)(nil)
	_ http.Hijacker               = (*closeWriter)(nil)
	_ io.ReaderFrom               = (*closeWriter)(nil)
)
