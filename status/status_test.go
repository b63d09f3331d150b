package status_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	// Every lbx module, so that the views the page reads are registered.
	_ "github.com/caddy-lbx/lbx"
	"github.com/caddy-lbx/lbx/status"
)

const browserAccept = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"

// adminMux routes requests to the admin module's routes as Caddy's admin
// endpoint does: a ServeMux, with an error answered with its status.
func adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	info, err := caddy.GetModule("admin.api.lbx_status")
	if err != nil {
		panic(err)
	}
	for _, r := range info.New().(caddy.AdminRouter).Routes() {
		mux.Handle(r.Pattern, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			if err := r.Handler.ServeHTTP(w, req); err != nil {
				code := http.StatusInternalServerError
				var apiErr caddy.APIError
				if errors.As(err, &apiErr) {
					code = apiErr.HTTPStatus
				}
				http.Error(w, err.Error(), code)
			}
		}))
	}
	return mux
}

// get sends h a request as from a client on this machine: over a
// connection from 127.0.0.1 to 127.0.0.1.
func get(h http.Handler, method, path, accept string) *httptest.ResponseRecorder {
	return getFrom(h, method, path, accept, "127.0.0.1:50000", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 2020})
}

// getFrom sends h a request as over a connection from remote to local.
// The addresses are data: nothing is sent anywhere.
func getFrom(h http.Handler, method, path, accept, remote string, local net.Addr) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, nil)
	req.RemoteAddr = remote
	req = req.WithContext(context.WithValue(req.Context(), http.LocalAddrContextKey, local))
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

func readPage(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("status.html")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// isPage checks that rec is the page, served as HTML.
func isPage(t *testing.T, what string, rec *httptest.ResponseRecorder, page string) {
	t.Helper()
	if rec.Code != http.StatusOK {
		t.Fatalf("%s: status %d: %s", what, rec.Code, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/html") {
		t.Errorf("%s: Content-Type %q, want text/html", what, ct)
	}
	if csp := rec.Header().Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "connect-src 'self'") {
		t.Errorf("%s: Content-Security-Policy %q does not confine the page to its origin", what, csp)
	}
	if rec.Body.String() != page {
		t.Errorf("%s: body is not status.html (%d bytes)", what, rec.Body.Len())
	}
}

// TestPageSelfContained: the page loads nothing from elsewhere and puts
// no data in the page as HTML.
func TestPageSelfContained(t *testing.T) {
	page := readPage(t)
	external := regexp.MustCompile(`(?i)(src|href|action)\s*=\s*["']?\s*(https?:)?//|//cdn|@import|url\(|<link\b|<script\s+src`)
	if m := external.FindString(page); m != "" {
		t.Errorf("the page refers to an external asset: %q", m)
	}
	if m := regexp.MustCompile(`https?://`).FindString(page); m != "" {
		t.Errorf("the page holds an absolute URL: %q", m)
	}
	for _, sink := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("} {
		if strings.Contains(page, sink) {
			t.Errorf("the page's script uses %s: text must be added as text", sink)
		}
	}
	// It reads every view by a relative path, and refreshes itself.
	for _, want := range []string{`"upstreams"`, `"partitions"`, `"cluster"`, `"rebalance"`, `"selective"`, "setTimeout(refresh"} {
		if !strings.Contains(page, want) {
			t.Errorf("the page's script lacks %s", want)
		}
	}
}

// TestAdminRoutes: /lbx/status is the page; /lbx/ is the page for a
// browser and the list of views for anyone else.
func TestAdminRoutes(t *testing.T) {
	page := readPage(t)
	mux := adminMux()

	isPage(t, "GET /lbx/status", get(mux, http.MethodGet, "/lbx/status", ""), page)
	isPage(t, "GET /lbx/ from a browser", get(mux, http.MethodGet, "/lbx/", browserAccept), page)
	isPage(t, "GET /lbx/ text/html", get(mux, http.MethodGet, "/lbx/", "text/html"), page)

	for _, accept := range []string{"application/json", "*/*", "", "text/html;q=0.5, application/json"} {
		rec := get(mux, http.MethodGet, "/lbx/", accept)
		if rec.Code != http.StatusOK || !strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") {
			t.Fatalf("GET /lbx/ Accept %q: status %d, Content-Type %q", accept, rec.Code, rec.Header().Get("Content-Type"))
		}
		var ix struct{ Endpoints []string }
		if err := json.Unmarshal(rec.Body.Bytes(), &ix); err != nil {
			t.Fatalf("GET /lbx/ Accept %q: %v: %s", accept, err, rec.Body)
		}
		for _, want := range []string{"/lbx/status", "/lbx/upstreams", "/lbx/partitions", "/lbx/cluster", "/lbx/rebalance", "/lbx/selective"} {
			if !slices.Contains(ix.Endpoints, want) {
				t.Errorf("GET /lbx/ Accept %q lists %v, without %s", accept, ix.Endpoints, want)
			}
		}
	}

	if rec := get(mux, http.MethodGet, "/lbx/nope", browserAccept); rec.Code != http.StatusNotFound {
		t.Errorf("GET /lbx/nope: status %d, want 404", rec.Code)
	}
	if rec := get(mux, http.MethodPost, "/lbx/status", ""); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST /lbx/status: status %d, want 405", rec.Code)
	}
	if rec := get(mux, http.MethodHead, "/lbx/status", ""); rec.Code != http.StatusOK || rec.Body.Len() != 0 {
		t.Errorf("HEAD /lbx/status: status %d, %d bytes", rec.Code, rec.Body.Len())
	}
}

// TestHandler: the HTTP handler serves the views by the last element of
// the path, and the page for any other path.
func TestHandler(t *testing.T) {
	page := readPage(t)
	serve := handler(t, new(status.Handler))

	isPage(t, "GET /lbx/status", get(serve, http.MethodGet, "/lbx/status", browserAccept), page)
	isPage(t, "GET /", get(serve, http.MethodGet, "/", browserAccept), page)
	for path, key := range map[string]string{
		"/lbx/upstreams":     "upstreams",
		"/status/partitions": "handlers",
		"/lbx/cluster":       "nodes",
		"/lbx/rebalance":     "nodes",
		"/lbx/selective":     "handlers",
	} {
		rec := get(serve, http.MethodGet, path, "application/json")
		var v map[string]json.RawMessage
		if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &v) != nil || v[key] == nil {
			t.Errorf("GET %s: status %d, body %.200s; want JSON with %q", path, rec.Code, rec.Body, key)
		}
	}
	if rec := get(serve, http.MethodPost, "/lbx/upstreams", ""); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST /lbx/upstreams: status %d, want 405", rec.Code)
	}
	if rec := get(serve, http.MethodPost, "/lbx/status", ""); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST /lbx/status: status %d, want 405", rec.Code)
	}
	// The site serves read-only views: the admin endpoint's keyring
	// operations (POST /lbx/cluster/keys/install, …) must not be reachable
	// through it, whatever the method. Their paths get the page.
	for _, path := range []string{"/lbx/cluster/keys", "/lbx/cluster/keys/install", "/lbx/cluster/keys/use", "/lbx/cluster/keys/remove"} {
		rec := get(serve, http.MethodPost, path, "application/json")
		if rec.Code != http.StatusMethodNotAllowed {
			t.Errorf("POST %s through the site: status %d, body %.200s; want 405 (the page's answer to a POST)", path, rec.Code, rec.Body)
		}
		if rec := get(serve, http.MethodGet, path, "application/json"); strings.Contains(rec.Body.String(), "fingerprint") {
			t.Errorf("GET %s through the site answered the keyring: %.200s", path, rec.Body)
		}
	}
}

// handler provisions h and serves it as Caddy would, an error answered
// with its status.
func handler(t *testing.T, h *status.Handler) http.Handler {
	t.Helper()
	if err := h.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := h.ServeHTTP(w, r, nil); err != nil {
			var he caddyhttp.HandlerError
			if !errors.As(err, &he) {
				t.Errorf("%s %s: error %v is not a caddyhttp.HandlerError", r.Method, r.URL.Path, err)
				return
			}
			http.Error(w, err.Error(), he.StatusCode)
		}
	})
}

// TestHandlerPrivateByDefault: a client not on this machine gets 403 and
// the fix for every path and method, whatever Host it sends; with
// allow_remote it gets the views.
func TestHandlerPrivateByDefault(t *testing.T) {
	page := readPage(t)
	private := handler(t, new(status.Handler))
	public := handler(t, &status.Handler{AllowRemote: true})
	type conn struct {
		remote string
		local  net.Addr
	}
	remotes := map[string]conn{
		"remote peer, loopback listener": {"192.0.2.7:40000", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 2020}},
		"remote peer, public listener":   {"192.0.2.7:40000", &net.TCPAddr{IP: net.IPv4(192, 0, 2, 10), Port: 2020}},
		"private-network peer":           {"10.1.2.3:40000", &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 2020}},
		"loopback peer, public listener": {"127.0.0.1:40000", &net.TCPAddr{IP: net.IPv4(192, 0, 2, 10), Port: 2020}},
	}
	for name, c := range remotes {
		for _, path := range []string{"/lbx/status", "/lbx/upstreams", "/lbx/cluster", "/lbx/rebalance", "/lbx/partitions", "/lbx/selective", "/lbx/"} {
			for _, method := range []string{http.MethodGet, http.MethodHead, http.MethodPost} {
				req := httptest.NewRequest(method, "http://127.0.0.1:2020"+path, nil)
				req.RemoteAddr = c.remote
				req.Host = "127.0.0.1:2020" // the spoofed Host of the finding
				req.Header.Set("X-Forwarded-For", "127.0.0.1")
				req = req.WithContext(context.WithValue(req.Context(), http.LocalAddrContextKey, c.local))
				rec := httptest.NewRecorder()
				private.ServeHTTP(rec, req)
				if rec.Code != http.StatusForbidden {
					t.Errorf("%s: %s %s: status %d, want 403", name, method, path, rec.Code)
				}
				if method != http.MethodHead && (!strings.Contains(rec.Body.String(), "allow_remote") || !strings.Contains(rec.Body.String(), "bind 127.0.0.1")) {
					t.Errorf("%s: %s %s: body %q does not name the fix", name, method, path, rec.Body)
				}
				for _, leak := range []string{`"upstreams"`, `"nodes"`, `"handlers"`, "<html", "<!doctype"} {
					if strings.Contains(strings.ToLower(rec.Body.String()), strings.ToLower(leak)) {
						t.Errorf("%s: %s %s: the refusal holds %s", name, method, path, leak)
					}
				}
			}
		}
		// allow_remote: the operator put something in front that decides.
		isPage(t, name+", allow_remote: GET /lbx/status", getFrom(public, http.MethodGet, "/lbx/status", browserAccept, c.remote, c.local), page)
		rec := getFrom(public, http.MethodGet, "/lbx/upstreams", "application/json", c.remote, c.local)
		var v map[string]json.RawMessage
		if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &v) != nil || v["upstreams"] == nil {
			t.Errorf("%s, allow_remote: GET /lbx/upstreams: status %d, body %.200s", name, rec.Code, rec.Body)
		}
	}
	// The same handler serves a client on this machine.
	isPage(t, "loopback: GET /lbx/status", get(private, http.MethodGet, "/lbx/status", browserAccept), page)
	v6 := getFrom(private, http.MethodGet, "/lbx/upstreams", "application/json", "[::1]:40000", &net.TCPAddr{IP: net.IPv6loopback, Port: 2020})
	if v6.Code != http.StatusOK {
		t.Errorf("::1 to ::1: GET /lbx/upstreams: status %d, body %.200s", v6.Code, v6.Body)
	}
}

func TestCaddyfile(t *testing.T) {
	for in, want := range map[string]bool{"lbx_status": false, "lbx_status {\n}": false, "lbx_status {\n\tallow_remote\n}": true} {
		h := new(status.Handler)
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
			t.Errorf("%q: %v", in, err)
		} else if h.AllowRemote != want {
			t.Errorf("%q: allow_remote %v, want %v", in, h.AllowRemote, want)
		}
	}
	for bad, want := range map[string]string{
		"lbx_status x":                                    `unexpected argument "x"`,
		"lbx_status {\n\tfoo\n}":                          `unknown option "foo" (want allow_remote)`,
		"lbx_status {\n\tallow_remote yes\n}":             `unexpected argument "yes"`,
		"lbx_status {\n\tallow_remote\n\tallow_remote\n}": "allow_remote specified more than once",
	} {
		err := new(status.Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(bad))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one containing %q", bad, err, want)
		}
	}
}

// TestJSON: allow_remote decodes, and a bad value or an unknown option is
// an error that names it.
func TestJSON(t *testing.T) {
	var h status.Handler
	if err := json.Unmarshal([]byte(`{"allow_remote": true}`), &h); err != nil || !h.AllowRemote {
		t.Fatalf("allow_remote true: %v, %+v", err, h)
	}
	for in, want := range map[string]string{
		`{"allow_remote": "yes"}`:  "allow_remote",
		`{"allow_remote_x": true}`: "allow_remote_x",
	} {
		if err := json.Unmarshal([]byte(in), new(status.Handler)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want one naming %s", in, err, want)
		}
	}
}
