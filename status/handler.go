package status

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("lbx_status", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("lbx_status", httpcaddyfile.Before, "metrics")
}

// Handler serves the status page and the lbx admin views it reads on an
// HTTP site, for browsers, which Caddy's admin endpoint turns away (see
// adminAPI). A request whose path ends in the name of a view
// (/lbx/upstreams, /lbx/cluster, /lbx/rebalance, /lbx/partitions,
// /lbx/selective: "upstreams", …) gets that view's JSON, as the admin
// endpoint would answer it; any other request gets the page. Mount it on
// a path prefix and open the page under it, e.g.
//
//	handle /lbx/* {
//		lbx_status
//	}
//
// and http://host/lbx/status: the page fetches the views relative to its
// own URL. Only GET (and HEAD, for the page) is allowed.
//
// The views show this process's internal state (members and their
// addresses and tags, upstream addresses and failures, file paths, key
// fingerprints), so by default the handler serves only a client on this
// machine: one whose connection runs from a loopback address to a
// loopback address. Any other client gets 403 with a body that names the
// fix, and a warning is logged (at most one line a minute). Bind the site
// to loopback (`bind 127.0.0.1`: a site address of http://127.0.0.1:P
// alone listens on every interface), or put authentication in front and
// set allow_remote.
type Handler struct {
	// Serve the page and the views to clients that are not on this
	// machine. Set it only where something in front decides who may see
	// them: authentication (basic_auth, forward_auth), a remote_ip
	// matcher, a private network the operator controls. Default: false,
	// only loopback-to-loopback connections are served.
	AllowRemote bool `json:"allow_remote,omitempty"`

	views   map[string]caddy.AdminHandler
	logger  *zap.Logger
	refused *refusals
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (h *Handler) UnmarshalJSON(b []byte) error {
	type plain Handler
	return jsonfield.Decode(b, (*plain)(h))
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.lbx_status",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision finds the views of this binary.
//
// Whether the site listens beyond loopback is not checked here: a
// handler's Provision is not told which server it belongs to (a route can
// be shared, and the server's listeners are set up after its routes), so
// the check is made on each request's connection instead.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.views = viewRoutes()
	h.logger = ctx.Logger()
	h.refused = new(refusals)
	return nil
}

// ServeHTTP serves a view or the page, to a client on this machine or,
// with allow_remote, to any.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	if !h.AllowRemote && !fromLoopback(r) {
		h.refuse(w, r)
		return nil
	}
	// Read-only, whatever a route under /lbx/ accepts on the admin
	// endpoint: the operations there (POST /lbx/drain, …) are the
	// operator's, never a site's clients'.
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		return caddyhttp.Error(http.StatusMethodNotAllowed, fmt.Errorf("method %s not allowed", r.Method))
	}
	if view, ok := h.views[viewName(r.URL.Path)]; ok {
		err := view.ServeHTTP(w, r)
		var apiErr caddy.APIError
		if errors.As(err, &apiErr) {
			return caddyhttp.Error(apiErr.HTTPStatus, apiErr.Err)
		}
		return err
	}
	servePage(w, r)
	return nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	lbx_status [{
//		allow_remote
//	}]
//
// allow_remote serves clients that are not on this machine (put
// authentication or a remote_ip matcher in front).
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return caddyopt.Block(d, "lbx_status", func(opt string) error {
		if opt != "allow_remote" {
			return caddyopt.Unknown(d, "lbx_status", "allow_remote")
		}
		h.AllowRemote = true
		return caddyopt.NoArgs(d, "lbx_status")
	})
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(Handler)
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return m, err
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddyfile.Unmarshaler       = (*Handler)(nil)
)
