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

// Parent is what a combo handler keeps of a client request, when its call
// starts, to make the sub-requests from: the server that accepted it, its
// placeholders and a snapshot of its variables. The sub-requests only read
// it, so that several of them may run at once.
type Parent struct {
	// Server is the server that accepted the client request; nil outside
	// Caddy's server.
	Server *caddyhttp.Server
	// Repl is the client request's replacer, read for the placeholders a
	// sub-request's own does not know (e.g. set by `map` or `vars` before
	// the handler); nil outside Caddy's server.
	Repl *caddy.Replacer
	// Vars is a copy of the client request's variables, taken at the
	// start: reverse_proxy writes variables, and the sub-requests must not
	// share a map.
	Vars map[string]any
}

// Capture takes what the sub-requests of r are made from (see Parent).
func Capture(r *http.Request) Parent {
	var p Parent
	ctx := r.Context()
	p.Server, _ = ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	p.Repl, _ = ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if vars, ok := ctx.Value(caddyhttp.VarsCtxKey).(map[string]any); ok {
		p.Vars = maps.Clone(vars)
	}
	return p
}

// Isolate gives req, a clone of the client request, placeholders and
// variables of its own, as Caddy's server gives a request it accepts:
// Caddy's are not safe for concurrent writers, and reverse_proxy writes
// both. The variables start as a copy of the parent's snapshot, and
// placeholders the new replacer does not know come from the client
// request's. w is the writer the sub-request answers to.
func (p Parent) Isolate(req *http.Request, w http.ResponseWriter) (*http.Request, *caddy.Replacer) {
	repl := caddy.NewReplacer()
	req = caddyhttp.PrepareRequest(req, repl, w, p.Server)
	if own, ok := req.Context().Value(caddyhttp.VarsCtxKey).(map[string]any); ok && p.Vars != nil {
		maps.Copy(own, p.Vars)
	}
	if p.Repl != nil {
		repl.Map(p.Repl.Get)
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
