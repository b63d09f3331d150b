package lbpolicy

import (
	"net/http"
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// A retry avoids the upstreams its request already tried, whatever the
// policy (Envoy's previous-hosts retry predicate): reverse_proxy calls
// Select again for each retry with the same request, so a policy records
// in the request's variables the upstream it chose, and on the next call
// leaves out every upstream recorded, as long as one that was not tried
// is usable. Only when every usable upstream was tried does it choose
// among them as on a first attempt: a single upstream still gets every
// retry.
//
// Upstreams are compared by dial address, not by pointer: dynamic
// upstreams are new Upstream values on every call.

// triedVar is the request variable holding what was tried: the
// *reverseproxy.Upstream chosen first (storing a pointer in the map does
// not allocate, so a first attempt costs a lookup and a store), then, from
// the first retry on, a Tried.
const triedVar = "lbx.tried"

// Tried is the dial addresses of the upstreams a request was already sent
// to; nil on a first attempt.
type Tried []string

// LoadTried returns the variables of r and, when r is a retry, the
// upstreams it already tried. Both are nil when r carries no variables (a
// request not served by Caddy); the Tried is nil on a first attempt.
func LoadTried(r *http.Request) (map[string]any, Tried) {
	if r == nil {
		return nil, nil
	}
	vars, _ := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	if vars == nil {
		return nil, nil
	}
	switch v := vars[triedVar].(type) {
	case *reverseproxy.Upstream:
		return vars, Tried{v.Dial}
	case Tried:
		return vars, v
	}
	return vars, nil
}

// RecordTried notes in vars (from LoadTried, with t) that u was chosen. A
// first attempt stores u itself; a retry stores a new list, never
// appending in place: a copy of the variables (a partition's
// sub-requests start from one) may share the old one.
func RecordTried(vars map[string]any, t Tried, u *reverseproxy.Upstream) {
	switch {
	case vars == nil || u == nil:
	case t == nil:
		vars[triedVar] = u
	case !t.Has(u.Dial):
		vars[triedVar] = append(t[:len(t):len(t)], u.Dial)
	}
}

// Has reports whether dial was tried.
func (t Tried) Has(dial string) bool { return slices.Contains(t, dial) }

// Without returns the members of ups that were not tried, in a new slice
// (nil when none is left). It is only called on retries.
func (t Tried) Without(ups []*reverseproxy.Upstream) []*reverseproxy.Upstream {
	var out []*reverseproxy.Upstream
	for i, u := range ups {
		if t.Has(u.Dial) {
			continue
		}
		if out == nil {
			out = make([]*reverseproxy.Upstream, 0, len(ups)-i)
		}
		out = append(out, u)
	}
	return out
}

// TracksTried reports whether a policy being provisioned in ctx needs to
// record what each request tried: only when its reverse_proxy handler can
// retry (lb_retries or lb_try_duration). Without retries Select is called
// once per request and the record would never be read, so a first attempt
// pays nothing. Outside a reverse_proxy handler it cannot tell, and
// records.
func TracksTried(ctx caddy.Context) bool {
	mods := ctx.Modules()
	for i := len(mods) - 1; i >= 0; i-- {
		if h, ok := mods[i].(*reverseproxy.Handler); ok {
			lb := h.LoadBalancing
			return lb != nil && (lb.Retries > 0 || lb.TryDuration > 0)
		}
	}
	return true
}
