package rebalance

import (
	"bytes"
	"encoding/json"
	"net/http"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/conntrack"
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
// handler, a shed HTTP/1.1 connection (idle, or active once its response
// is done) is closed only once it has stayed idle for the app's
// idle_close_after with no request arriving, so that no request races
// the close (a client that keeps using it keeps it; the app warns at
// start about servers without this handler), and an HTTP/2 one gets a
// GOAWAY from the tracker once it has had no stream for a second (as a
// shed idle one does): an HTTP/2
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

// ServeHTTP hands next a writer that adds "Connection: close" to the
// final response header when the connection was shed, and follows the
// frames of a WebSocket upgrade (conntrack.WrapResponseWriter). A request
// on a connection the tracker does not know (no rebalance app, or a
// server it is not registered with) passes through untouched.
func (CloseHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	return next.ServeHTTP(conntrack.WrapResponseWriter(w, r, shuttingDown), r)
}

// shuttingDown reports whether r's server is shutting down: Caddy's
// {http.shutting_down}, true from the moment a stop or a reload that
// closes the server's listener is scheduled, through shutdown_delay.
// Responses then carry "Connection: close", so that kept-alive clients
// leave at a response boundary while the server still serves, instead of
// racing the close of their idle connections when the delay ends.
func shuttingDown(r *http.Request) bool {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return false
	}
	v, _ := repl.Get("http.shutting_down")
	b, _ := v.(bool)
	return b
}

// warnNoCloseHandler logs one warning naming the HTTP servers of the
// config whose routes have no rebalance_close handler: a shed idle
// HTTP/1.1 connection there gets no "Connection: close" on its next
// response, so it closes only once it has stayed idle for
// idle_close_after, and a shed active one likewise after its response.
// Caddy's own server for automatic HTTPS redirects is left out (its
// routes are not the operator's).
func (a *App) warnNoCloseHandler() {
	if a.httpApp == nil {
		return
	}
	var without []string
	for name, srv := range a.httpApp.Servers {
		if name != autoHTTPSRedirectServer && !hasCloseHandler(srv) {
			without = append(without, name)
		}
	}
	if len(without) == 0 {
		return
	}
	slices.Sort(without)
	a.logger.Warn("these HTTP servers have no rebalance_close handler in their routes: a shed HTTP/1.1 connection there closes only once it has stayed idle for idle_close_after, so shedding there waits for it",
		zap.Strings("servers", without), zap.Stringer("idle_close_after", time.Duration(a.IdleCloseAfter)))
}

// hasCloseHandler reports whether a route of srv (its routes, their
// subroutes, its named routes) has the rebalance_close handler. It reads
// the provisioned handlers, or the handlers' JSON where they are not
// provisioned.
func hasCloseHandler(srv *caddyhttp.Server) bool {
	if routesHaveCloseHandler(srv.Routes) {
		return true
	}
	for _, r := range srv.NamedRoutes {
		if r != nil && routesHaveCloseHandler(caddyhttp.RouteList{*r}) {
			return true
		}
	}
	return false
}

// closeHandlerJSON is how the handler is named in a route's JSON.
var closeHandlerJSON = []byte(`"rebalance_close"`)

// routesHaveCloseHandler reports whether one of routes has the
// rebalance_close handler, looking into subroutes.
func routesHaveCloseHandler(routes caddyhttp.RouteList) bool {
	for _, r := range routes {
		for _, h := range r.Handlers {
			switch h := h.(type) {
			case *CloseHandler:
				return true
			case *caddyhttp.Subroute:
				if routesHaveCloseHandler(h.Routes) {
					return true
				}
			}
		}
		if slices.ContainsFunc(r.HandlersRaw, func(raw json.RawMessage) bool {
			return bytes.Contains(raw, closeHandlerJSON)
		}) {
			return true
		}
	}
	return false
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
)
