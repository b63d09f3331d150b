package status

import (
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/adminjson"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the status page on Caddy's admin endpoint:
//
//	GET /lbx/status
//	GET /lbx/            (with an Accept header that prefers text/html)
//
// GET /lbx/ without one returns the list of lbx's admin views as JSON.
//
// Caddy's admin endpoint refuses a request that carries Sec-Fetch-Mode
// unless its Origin or Referer is the admin address, and a browser's
// navigation to a loopback or HTTPS address carries Sec-Fetch-Mode and,
// typed in, neither header: a browser opening
// http://localhost:2019/lbx/status gets 403, "client is not allowed to
// access from origin" with an empty origin. Once loaded (curl, or an
// admin address a browser sends no Sec-Fetch-Mode to), the page's own
// requests pass: they carry its URL as Referer. To open the page in a
// browser, serve it with the lbx_status handler (Handler) on a site of
// its own.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  selfID,
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	listing := adminjson.Handler(newIndex)
	return []caddy.AdminRoute{
		{Pattern: prefix + "status", Handler: caddy.AdminHandlerFunc(adminPage)},
		{Pattern: prefix, Handler: caddy.AdminHandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			// The pattern matches every path under /lbx/ that no other
			// route has.
			if r.URL.Path != prefix {
				return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no lbx admin view at %s; GET %s lists them", r.URL.Path, prefix)}
			}
			if prefersHTML(r) {
				return adminPage(w, r)
			}
			return listing(w, r)
		})},
	}
}

// adminPage serves the page to GET and HEAD.
func adminPage(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	servePage(w, r)
	return nil
}

// Interface guards
var _ caddy.AdminRouter = adminAPI{}
