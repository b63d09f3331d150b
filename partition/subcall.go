package partition

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/subreq"
)

// subParent is what every sub-request of one fan-out is made from. The
// sub-requests only read it.
type subParent struct {
	subreq.Parent
	req  *http.Request
	body []byte
	// bodies are the partitions' own bodies (split_body), nil entries
	// for partitions that are skipped; nil: every partition gets body.
	bodies [][]byte
	budget *budget // the bytes the sub-responses may hold together
}

// budget is what one fan-out's sub-responses may hold together
// (max_merged_body). Once spent, it stays spent: the request fails.
type budget struct {
	limit int64
	used  atomic.Int64
}

// take reserves n bytes and reports whether the budget still holds.
func (b *budget) take(n int64) bool { return b.used.Add(n) <= b.limit }

// subCall is one part's sub-request.
type subCall struct {
	index int
	req   *http.Request
	// via serves the sub-request: partition's internal reverse_proxy, or
	// a parallel branch's routes.
	via   caddyhttp.MiddlewareHandler
	rec   *recorder
	state *subState // partition's upstream source; nil in a branch
	start time.Time
}

// subStateKey is the context key of a sub-request's *subState.
type subStateKey struct{}

// subState is what the upstream source knows about a sub-request: its
// partition's replicas, and the upstreams it handed reverse_proxy for
// each attempt. It is used by one goroutine at a time.
type subState struct {
	replicas []*replica
	// sample is, for a partition of more than aperture replicas, its
	// audit's random sample of usable replicas: the candidates when
	// random draws find none.
	sample []*replica
	given  []givenUpstream
	tried  []string // hostports of earlier attempts
	// skipEjected: leave replicas ejected by lbx's outlier detection out
	// while others are left (for policies that do not know ejection).
	skipEjected bool
}

type givenUpstream struct {
	rep *replica
	up  *reverseproxy.Upstream
}

// newSubCall makes partition i's sub-request (newCall), through the
// internal reverse_proxy with the partition's replicas as its upstreams,
// and the partition placeholders.
func (h *Handler) newSubCall(ctx context.Context, p subParent, sc *scheme, i int) *subCall {
	state := &subState{replicas: sc.parts[i], sample: sc.sample(i), skipEjected: h.skipEjected}
	c, repl := h.newCall(context.WithValue(ctx, subStateKey{}, state), p, i, h.proxy)
	c.state = state
	repl.Set("partition.index", i)
	repl.Set("partition.count", sc.count)
	repl.Set("partition.scheme", sc.count)
	repl.Set("partition.tag", Tag{Index: i, Count: sc.count}.String())
	return c
}

// newCall makes part i's sub-request, served by via: a clone of the
// client request with the buffered body, its own replacer (returned, for
// the part's placeholders) and vars map (subreq.Parent.Isolate;
// placeholders it does not know, e.g. set by `map` or `vars` before this
// handler, come from the client request's).
func (h *FanOut) newCall(ctx context.Context, p subParent, i int, via caddyhttp.MiddlewareHandler) (*subCall, *caddy.Replacer) {
	c := &subCall{
		index: i,
		via:   via,
		rec:   &recorder{header: make(http.Header), limit: h.MaxResponseBody, budget: p.budget},
		start: time.Now(),
	}
	req := p.req.Clone(ctx)
	// The body is complete and its length known; nothing is negotiated
	// with the client any more, and fan-out is not for protocol upgrades.
	// Sub-responses are merged, so they must come whole and decoded: no
	// content coding from the client's Accept-Encoding (the transport
	// negotiates and decodes its own), no ranges, and no conditional
	// requests, whose 304 or 412 would be a partition's alone.
	req.TransferEncoding = nil
	for _, k := range subRequestDrop {
		req.Header.Del(k)
	}
	body := p.bodyFor(i)
	subreq.ReplayBody(req, body)
	if len(body) > 0 {
		req.Header.Set("Content-Length", strconv.Itoa(len(body)))
	} else {
		req.Header.Del("Content-Length")
	}

	req, repl := p.Isolate(req, c.rec)
	c.req = req
	return c, repl
}

// subRequestDrop are the client request headers sub-requests do not carry.
var subRequestDrop = []string{
	"Expect", "Upgrade", "Accept-Encoding", "Range", "If-Range",
	"If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since",
}

// runSubCall sends the sub-request through its handler (partition's
// internal reverse_proxy, a branch's routes) and judges the result.
func (h *FanOut) runSubCall(ctx context.Context, c *subCall) *outcome {
	o := &outcome{index: c.index}
	err, panicked := h.serveSub(c)
	o.latency = time.Since(c.start)
	if c.state != nil {
		c.state.publish()
	}
	if repl, ok := c.req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		o.dial, _ = repl.GetString("http.reverse_proxy.upstream.hostport")
	}
	o.status = c.rec.status

	switch {
	case c.rec.overflow == errMergedTooLarge:
		o.err, o.overBudget = fmt.Errorf("sub-responses together larger than max_merged_body (%d bytes)", h.MaxMergedBody), true
	case c.rec.overflow != nil:
		o.err = fmt.Errorf("response larger than max_response_body (%d bytes)", h.MaxResponseBody)
	case panicked != nil:
		if ctx.Err() != nil {
			o.err = ctxReason(ctx)
		} else {
			o.err = fmt.Errorf("response aborted: %v", panicked)
		}
	case err != nil:
		var herr caddyhttp.HandlerError
		if errors.As(err, &herr) {
			o.status = herr.StatusCode
			if herr.Err != nil {
				err = herr.Err
			}
		}
		o.err = shortReason(ctx, err)
	case o.status == 499 || ctx.Err() != nil:
		o.err = ctxReason(ctx)
	case o.status == 0:
		// A parallel branch whose routes wrote nothing.
		o.err = errors.New("no response")
	case o.status < 200 || o.status > 299:
		o.err = fmt.Errorf("status %d", o.status)
	}
	if o.err != nil {
		c.rec.release()
		if l := h.logger.Check(zap.DebugLevel, h.kind.noun+" failed"); l != nil {
			l.Write(zap.Int(h.kind.noun, o.index), zap.String("upstream", o.dial), zap.Int("status", o.status), zap.Error(o.err))
		}
		return o
	}
	part := &Part{Index: c.index, Status: o.status, Header: c.rec.header, Body: c.rec.bytes()}
	if err := h.merger.Prepare(part); err != nil {
		c.rec.release()
		o.err = err
		return o
	}
	o.part = part
	return o
}

// serveSub calls the sub-request's handler. reverse_proxy panics with
// http.ErrAbortHandler when it cannot finish copying a response (here:
// the recorder refused a body over the limit, or the sub-request was
// cancelled mid-body); that panic is the sub-request's failure, not the
// server's.
func (h *FanOut) serveSub(c *subCall) (err error, panicked any) {
	defer func() {
		if v := recover(); v != nil {
			panicked = v
			if v != http.ErrAbortHandler {
				h.logger.Error(h.kind.name+" sub-request panicked", zap.Int(h.kind.noun, c.index), zap.Any("panic", v), zap.Stack("stack"))
			}
		}
	}()
	return c.via.ServeHTTP(c.rec, c.req, noNext), nil
}

var noNext = caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })

// publish records, for each replica used, the Upstream value reverse_proxy
// filled in, so its health can be read later (see replica.usable). It runs
// after the sub-request finished: reverse_proxy no longer writes to it.
func (st *subState) publish() {
	for _, g := range st.given {
		if g.up.Host != nil {
			g.rep.last.Store(g.up)
		}
	}
}

func ctxReason(ctx context.Context) error {
	if errors.Is(context.Cause(ctx), errTimeout) {
		return errors.New("timeout")
	}
	return errors.New("canceled")
}

// shortReason turns a proxy error into the few words the error answer
// shows for a partition: "timeout", "connection refused", …
func shortReason(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctxReason(ctx)
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return errors.New("timeout")
	}
	msg := err.Error()
	if i := strings.LastIndex(msg, ": "); i >= 0 && i+2 < len(msg) {
		msg = msg[i+2:]
	}
	return errors.New(msg)
}

// source is the internal reverse_proxy's upstream source: the replicas of
// the partition whose sub-request is being proxied. A retry gets the
// replicas not tried yet (all of them, when every one was). When the
// selection policy does not know lbx's outlier ejection, replicas ejected
// by it are left out as long as others remain. Each call returns new
// Upstream values, as Caddy's own dynamic sources do, since reverse_proxy
// fills them in per request.
type source struct{}

// GetUpstreams implements reverseproxy.UpstreamSource.
func (source) GetUpstreams(r *http.Request) ([]*reverseproxy.Upstream, error) {
	st, ok := r.Context().Value(subStateKey{}).(*subState)
	if !ok {
		return nil, errors.New("partition upstream source used outside a partition sub-request")
	}
	if len(st.given) > 0 {
		if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
			if hp, ok := repl.GetString("http.reverse_proxy.upstream.hostport"); ok && hp != "" {
				st.tried = append(st.tried, hp)
			}
		}
	}
	if len(st.replicas) > aperture {
		return st.drawUpstreams(), nil
	}
	// Passes, from the most to the least preferred: replicas not tried
	// and not ejected; not tried; any.
	pass := 1
	var now int64
	if st.skipEjected {
		pass, now = 0, monoclock.Now()
	}
	pool := make([]*reverseproxy.Upstream, 0, len(st.replicas))
	for ; pass < 3 && len(pool) == 0; pass++ {
		for _, rep := range st.replicas {
			if pass < 2 && slices.Contains(st.tried, rep.hostport) {
				continue
			}
			if pass == 0 && rep.ejected(now) {
				continue
			}
			u := &reverseproxy.Upstream{Dial: rep.dial}
			pool = append(pool, u)
			st.given = append(st.given, givenUpstream{rep: rep, up: u})
		}
	}
	return pool, nil
}

// drawUpstreams hands reverse_proxy at most aperture replicas of a large
// partition, so that neither this source nor the selection policy scans
// all of them. Preferred, in turn: random draws of usable replicas not
// tried yet; the audit's sample of usable replicas not tried yet (when
// few of the partition's replicas are usable, draws miss them); random
// draws of replicas not tried; random draws of any. The policy then
// picks among the candidates (power of d choices).
//
// Above stableAbove replicas the audit's sample comes first: random
// draws over a list that large miss the CPU caches on every candidate,
// while the sample stays the same, and in cache, until the next audit
// (capRefresh) draws another. Over time every usable replica is in the
// sample equally often.
func (st *subState) drawUpstreams() []*reverseproxy.Upstream {
	now := monoclock.Now()
	pool := make([]*reverseproxy.Upstream, 0, aperture)
	var picked [aperture]*replica
	n := 0
	add := func(r *replica) {
		if slices.Contains(picked[:n], r) {
			return
		}
		picked[n] = r
		n++
		u := &reverseproxy.Upstream{Dial: r.dial}
		pool = append(pool, u)
		st.given = append(st.given, givenUpstream{rep: r, up: u})
	}
	tried := func(r *replica) bool { return slices.Contains(st.tried, r.hostport) }
	draw := func(ok func(*replica) bool) {
		for range 2 * aperture {
			if n == aperture {
				return
			}
			if r := st.replicas[rand.IntN(len(st.replicas))]; ok(r) {
				add(r)
			}
		}
	}
	fromSample := func() {
		for _, r := range st.sample {
			if r.usable(now) && !tried(r) {
				add(r)
			}
		}
	}
	if len(st.replicas) > stableAbove {
		fromSample()
	}
	if n == 0 {
		draw(func(r *replica) bool { return r.usable(now) && !tried(r) })
	}
	if n == 0 {
		fromSample()
	}
	if n == 0 {
		draw(func(r *replica) bool { return !tried(r) })
	}
	if n == 0 {
		draw(func(*replica) bool { return true })
	}
	return pool
}

// recorder is the ResponseWriter of a sub-request: it keeps the status,
// headers and the body of a 2xx response, up to limit bytes and what the
// fan-out's budget allows, and refuses more. Other bodies are dropped, as
// nothing reads them. A body of known length is read into one slice of
// that size; one of unknown length into chunks joined once at the end,
// so the memory it holds stays close to its length.
type recorder struct {
	header   http.Header
	status   int
	limit    int64
	budget   *budget
	started  bool     // the first Write has been seen
	discard  bool     // not a 2xx response: the body is not kept
	body     []byte   // the body, or its last chunk
	chunks   [][]byte // earlier chunks of a body of unknown length
	size     int64    // bytes kept
	reserved bool     // the budget holds the whole declared length
	overflow error    // errResponseTooLarge or errMergedTooLarge
}

// Chunks of a body of unknown length start small and double up to
// maxChunk, so that small bodies stay small and large ones take few
// chunks.
const (
	minChunk = 4 << 10
	maxChunk = 1 << 20
)

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.status != 0 || code < 200 {
		return // informational responses are not the answer
	}
	r.status = code
}

var (
	errResponseTooLarge = errors.New("sub-response larger than max_response_body")
	errMergedTooLarge   = errors.New("sub-responses together larger than max_merged_body")
)

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	if r.overflow != nil {
		return 0, r.overflow
	}
	if !r.started {
		r.start()
		if r.overflow != nil {
			return 0, r.overflow
		}
	}
	if r.discard {
		return len(p), nil
	}
	n := int64(len(p))
	switch {
	case r.size+n > r.limit:
		r.overflow = errResponseTooLarge
	case !r.reserved || r.size+n > int64(cap(r.body)):
		// Beyond the declared length (or none declared): count as it
		// comes.
		if !r.budget.take(n) {
			r.overflow = errMergedTooLarge
		}
	}
	if r.overflow != nil {
		r.release()
		return 0, r.overflow
	}
	r.size += n
	if r.reserved && len(r.body)+len(p) <= cap(r.body) {
		r.body = append(r.body, p...)
		return len(p), nil
	}
	r.reserved = false
	for len(p) > 0 {
		if len(r.body) == cap(r.body) {
			if r.body != nil {
				r.chunks = append(r.chunks, r.body)
			}
			r.body = make([]byte, 0, min(max(2*cap(r.body), minChunk), maxChunk))
		}
		k := min(len(p), cap(r.body)-len(r.body))
		r.body = append(r.body, p[:k]...)
		p = p[k:]
	}
	return int(n), nil
}

// start sizes the body from its declared length, if any, on the first
// Write, when the headers are final.
func (r *recorder) start() {
	r.started = true
	if r.status < 200 || r.status > 299 {
		r.discard = true
		return
	}
	cl, err := strconv.ParseInt(r.header.Get("Content-Length"), 10, 64)
	if err != nil || cl <= 0 {
		return
	}
	switch {
	case cl > r.limit:
		r.overflow = errResponseTooLarge
	case !r.budget.take(cl):
		r.overflow = errMergedTooLarge
	default:
		r.body, r.reserved = make([]byte, 0, cl), true
	}
}

// bytes returns the body kept, in one slice.
func (r *recorder) bytes() []byte {
	if len(r.chunks) == 0 {
		return r.body
	}
	b := make([]byte, 0, r.size)
	for _, c := range r.chunks {
		b = append(b, c...)
	}
	b = append(b, r.body...)
	r.chunks, r.body = nil, b
	return b
}

// release drops the body, which nobody will read.
func (r *recorder) release() { r.body, r.chunks = nil, nil }

// Flush is a no-op: nothing is streamed.
func (r *recorder) Flush() {}

// Interface guards
var (
	_ reverseproxy.UpstreamSource = source{}
	_ http.Flusher                = (*recorder)(nil)
)
