package status

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("lbx_status", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("lbx_status", httpcaddyfile.Before, "metrics")
}

// Handler serves the status page and the lbx admin views it reads on an
// HTTP site, for browsers, which Caddy's admin endpoint turns away (see
// AdminAPI). A request whose path ends in the name of a view
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
// own URL. The views show this process's internal state: serve them only
// on a loopback address or behind authentication. Only GET (and HEAD, for
// the page) is allowed.
type Handler struct {
	views map[string]caddy.AdminHandler
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.lbx_status",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision finds the views of this binary.
func (h *Handler) Provision(caddy.Context) error {
	h.views = viewRoutes()
	return nil
}

// ServeHTTP serves a view or the page.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	if view, ok := h.views[viewName(r.URL.Path)]; ok {
		err := view.ServeHTTP(w, r)
		var apiErr caddy.APIError
		if errors.As(err, &apiErr) {
			return caddyhttp.Error(apiErr.HTTPStatus, apiErr.Err)
		}
		return err
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		return caddyhttp.Error(http.StatusMethodNotAllowed, fmt.Errorf("method %s not allowed", r.Method))
	}
	servePage(w, r)
	return nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	lbx_status
//
// It takes no arguments.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(0) {
		return d.Errf("lbx_status takes no options, got %q", d.Val())
	}
	return nil
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
