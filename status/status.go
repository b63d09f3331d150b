// Package status serves lbx's status page: one self-contained HTML page
// (inline CSS and script, no external assets) that reads lbx's JSON admin
// views every 2 seconds and shows them as tables — pools and upstreams,
// partitions, cluster members, the last rebalance decision and shed
// totals, selective groups.
//
// The page is served on Caddy's admin endpoint and, because Caddy's admin
// endpoint refuses a browser's navigation to it (see adminAPI), by an HTTP
// handler that also serves the JSON views it reads. This package knows the
// views only by their admin routes: it imports none of lbx's module
// packages, and a view added to /lbx/ is served with no change here.
package status

import (
	_ "embed"
	"mime"
	"net/http"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// page is the status page. Its script fetches the views by paths relative
// to its own URL ("upstreams", "cluster", …), so it works wherever it is
// served next to them: /lbx/status next to /lbx/upstreams.
//
//go:embed status.html
var page []byte

// prefix is where lbx's admin views live.
const prefix = "/lbx/"

// selfID is this package's admin module, left out of the views it serves.
const selfID = "admin.api.lbx_status"

// viewRoutes returns lbx's JSON admin views by name ("upstreams" for
// /lbx/upstreams): the routes under /lbx/ of every admin.api module
// registered in this binary, but this package's. Read at request or
// provision time, when every package's init has registered its modules.
func viewRoutes() map[string]caddy.AdminHandler {
	out := map[string]caddy.AdminHandler{}
	for _, m := range caddy.GetModules("admin.api") {
		if string(m.ID) == selfID {
			continue
		}
		router, ok := m.New().(caddy.AdminRouter)
		if !ok {
			continue
		}
		for _, r := range router.Routes() {
			name, ok := strings.CutPrefix(r.Pattern, prefix)
			if ok && name != "" && !strings.Contains(name, "/") {
				out[name] = r.Handler
			}
		}
	}
	return out
}

// servePage writes the page. The Content-Security-Policy lets it load
// nothing but its own inline code and fetch only its own origin, so the
// browser enforces that it stays self-contained.
func servePage(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "+
		"connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	h.Set("Content-Length", strconv.Itoa(len(page)))
	if r.Method == http.MethodHead {
		return
	}
	_, _ = w.Write(page)
}

// prefersHTML reports whether the request's Accept header prefers
// text/html to JSON: text/html (or text/*) is accepted with a quality at
// least that of application/json (or application/*, */*). A browser's
// navigation does; curl's "*/*" and an API client's "application/json" do
// not.
func prefersHTML(r *http.Request) bool {
	html, json := 0.0, 0.0
	for _, part := range strings.Split(r.Header.Get("Accept"), ",") {
		mt, params, err := mime.ParseMediaType(strings.TrimSpace(part))
		if err != nil {
			continue
		}
		q := 1.0
		if s, ok := params["q"]; ok {
			if v, err := strconv.ParseFloat(s, 64); err == nil {
				q = v
			}
		}
		switch mt {
		case "text/html", "text/*":
			html = max(html, q)
		case "application/json", "application/*", "*/*":
			json = max(json, q)
		}
	}
	return html > 0 && html >= json
}

// index is the answer to GET /lbx/ for a client that does not prefer HTML:
// the views there are.
type index struct {
	Endpoints []string `json:"endpoints"`
}

// newIndex lists the views of this binary and the page.
func newIndex() index {
	ix := index{Endpoints: []string{prefix + "status"}}
	for name := range viewRoutes() {
		ix.Endpoints = append(ix.Endpoints, prefix+name)
	}
	sort.Strings(ix.Endpoints)
	return ix
}

// viewName returns the view a request path names, by its last element
// ("/lbx/upstreams" and "/status/upstreams" name "upstreams").
func viewName(p string) string { return path.Base(p) }
