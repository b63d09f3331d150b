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
// with the request the upstream it chose, and on the next call leaves out
// every upstream recorded, as long as one that was not tried is usable. Only when every usable upstream was tried does it choose
// among them as on a first attempt: a single upstream still gets every
// retry.
//
// Upstreams are compared by dial address, not by pointer: dynamic
// upstreams are new Upstream values on every call.

// Where the record is kept. A first attempt stores the
// *reverseproxy.Upstream it chose in the request's variables (triedVar):
// a pointer in the map does not allocate, and nothing else of the request
// runs yet. From the first retry on, the list (a Tried) goes to the
// request's replacer (triedKey) instead: reverse_proxy's transport may
// still be dialing for an earlier attempt in the background, and its dial
// function reads the variables (a Go map, which a concurrent write
// crashes), while the replacer is guarded by a lock.
const (
	triedVar = "lbx.tried_first"
	triedKey = "lbx.tried"
)

// Tried is the dial addresses of the upstreams a request was already sent
// to. A nil *Tried is a first attempt: a pointer keeps the choosing
// algorithms' candidates, copied for every call, one word larger only.
// Never changed once stored.
type Tried struct{ dials []string }

// Attempt is where one request's record of what it tried is kept.
type Attempt struct {
	r    *http.Request
	vars map[string]any // nil: the request carries no variables
}

// LoadTried returns where r's record is kept and, when r is a retry, the
// upstreams it already tried (nil on a first attempt, and for a request
// without variables, which Caddy's server did not hand over).
func LoadTried(r *http.Request) (Attempt, *Tried) {
	if r == nil {
		return Attempt{}, nil
	}
	vars, _ := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	if vars == nil {
		return Attempt{}, nil
	}
	a := Attempt{r: r, vars: vars}
	first, _ := vars[triedVar].(*reverseproxy.Upstream)
	if first == nil {
		return a, nil
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		if v, ok := repl.Get(triedKey); ok {
			if t, ok := v.(*Tried); ok && t != nil {
				return a, t
			}
		}
	}
	return a, &Tried{dials: []string{first.Dial}}
}

// RecordTried notes that u was chosen for the attempt a (from LoadTried,
// with t). A retry stores a new list, never appending in place: a copy
// of the request's state (a partition's sub-requests start from one) may
// share the old one. Without a replacer only the first attempt is
// recorded.
func RecordTried(a Attempt, t *Tried, u *reverseproxy.Upstream) {
	switch {
	case a.vars == nil || u == nil:
	case t == nil:
		a.vars[triedVar] = u
	case !t.Has(u.Dial):
		if repl, ok := a.r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
			n := len(t.dials)
			repl.Set(triedKey, &Tried{dials: append(t.dials[:n:n], u.Dial)})
		}
	}
}

// Has reports whether dial was tried; never on a first attempt (nil).
func (t *Tried) Has(dial string) bool { return t != nil && slices.Contains(t.dials, dial) }

// without returns the members of ups that were not tried, in a new slice
// (nil when none is left). It is only called on retries.
func (t *Tried) without(ups []*reverseproxy.Upstream) []*reverseproxy.Upstream {
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

// Avoid records dial as tried by r before r's first attempt: a policy
// that tracks what a request tried leaves it out of r's choice while
// another upstream is usable. The selective handler gives a backup
// request the upstream its first attempt went to, so that with one group
// the backup goes to another replica.
func Avoid(r *http.Request, dial string) {
	if vars, ok := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any); ok && dial != "" {
		vars[triedVar] = &reverseproxy.Upstream{Dial: dial}
	}
}

// AvoidAll is Avoid for several upstreams at once: every dial in dials
// counts as tried by r before its first attempt, so a policy that tracks
// what a request tried chooses among the others while one is usable.
// The selective handler gives a backup request in the same group every
// replica it must not use — those its running attempts went to, and those
// without spare capacity — so that the backup lands on an idle one. The
// list is kept in r's replacer (see triedKey), which r must carry, as
// every request Caddy's server prepared does; without one only the first
// dial is recorded.
func AvoidAll(r *http.Request, dials []string) {
	if len(dials) == 0 {
		return
	}
	vars, ok := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	if !ok {
		return
	}
	vars[triedVar] = &reverseproxy.Upstream{Dial: dials[0]}
	if len(dials) == 1 {
		return
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(triedKey, &Tried{dials: slices.Clone(dials)})
	}
}

// backupSender is a handler that may send a request twice through the
// routes below it, marking with Avoid what the first attempt used (the
// selective handler with backup requests).
type backupSender interface {
	SendsBackupRequests() bool
}

// TracksTried reports whether a policy being provisioned in ctx needs to
// record what each request tried: only when its reverse_proxy handler can
// retry (lb_retries or lb_try_duration), or a handler above it sends
// backup requests (see Avoid). Without retries Select is called
// once per request and the record would never be read, so a first attempt
// pays nothing. Outside a reverse_proxy handler it cannot tell, and
// records.
func TracksTried(ctx caddy.Context) bool {
	for _, m := range ctx.Modules() {
		if b, ok := m.(backupSender); ok && b.SendsBackupRequests() {
			return true
		}
	}
	h := parentProxy(ctx)
	if h == nil {
		return true
	}
	lb := h.LoadBalancing
	return lb != nil && (lb.Retries > 0 || lb.TryDuration > 0)
}
