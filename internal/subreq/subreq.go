// Package subreq makes the requests a combo handler (partition, selective)
// sends on behalf of a client request, so that several of them can run at
// once through Caddy's handlers.
package subreq

import (
	"bytes"
	"io"
	"maps"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Isolate gives req, a clone of a client request, placeholders and
// variables of its own, as Caddy's server gives a request it accepts:
// Caddy's are not safe for concurrent writers, and reverse_proxy writes
// both. The variables start as a copy of vars (a snapshot of the client
// request's), and placeholders the new replacer does not know come from
// parent's (the client request's; nil for none). w is the writer the
// sub-request answers to.
func Isolate(req *http.Request, w http.ResponseWriter, server *caddyhttp.Server, vars map[string]any, parent *caddy.Replacer) (*http.Request, *caddy.Replacer) {
	repl := caddy.NewReplacer()
	req = caddyhttp.PrepareRequest(req, repl, w, server)
	if own, ok := req.Context().Value(caddyhttp.VarsCtxKey).(map[string]any); ok && vars != nil {
		maps.Copy(own, vars)
	}
	if parent != nil {
		repl.Map(parent.Get)
	}
	return req, repl
}

// ReplayBody makes body, read whole beforehand, req's body, one that the
// transport may read again (GetBody); an empty body is none.
func ReplayBody(req *http.Request, body []byte) {
	if len(body) == 0 {
		req.Body, req.ContentLength, req.GetBody = http.NoBody, 0, nil
		return
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}
