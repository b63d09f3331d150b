// Package partition is a Caddy HTTP handler that fans one request out to
// one replica of every partition of a data set and merges the answers —
// brpc's PartitionChannel and DynamicPartitionChannel for Caddy.
//
// Upstreams carry a tag "N/M" (partition N of a scheme of M partitions),
// statically or in a naming file in brpc's format that is reloaded when it
// changes. Each request picks one scheme, with probability proportional
// to the scheme's capacity, sends one sub-request per partition through an
// internal reverse_proxy handler (so replica choice, retries, transports,
// header handling and health are Caddy's and lbx's own), and merges the
// sub-responses with a merger module.
//
// The package also holds parallel, brpc's ParallelChannel: the same
// fan-out over a list of branches, each a list of routes, rather than over
// the partitions of a scheme. Both handlers run on one engine (FanOut).
package partition

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/calldeadline"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/subreq"
)

// StatusHeader is the response header that reports each partition's
// outcome, e.g. "p0=200;12ms, p1=502;3ms;failed, p2=skipped".
const StatusHeader = "X-Partition-Status"

// Capacity reports how much of the fan-out is usable, for a selective
// group that holds it: the sum over its partition schemes of the least
// number of usable replicas any of a scheme's partitions has, and the
// same with every replica counted.
func (h *Handler) Capacity() (usable, total float64) {
	l := h.current.Load()
	if l == nil {
		return 0, 0
	}
	u, t := l.capacity(monoclock.Now())
	return float64(u), float64(t)
}

// ServeHTTP fans the request out and writes the merged response. The
// call's deadline starts here: reading the request body counts against
// Timeout as much as the sub-requests do.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	end, _ := calldeadline.Start(r.Context(), time.Duration(h.Timeout))
	body, ok := h.requestBody(w, r, end)
	if !ok {
		return nil
	}
	if h.rejected(w, r, body) {
		return nil
	}
	l := h.current.Load()
	sc := l.choose(rand.IntN, monoclock.Now())
	if sc == nil {
		h.answer(w, r, http.StatusServiceUnavailable, "no partition scheme has capacity: "+l.describe(monoclock.Now()))
		return nil
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.partition.scheme", sc.count)
	}
	bodies, ok := h.splitBodies(w, r, sc.count, body)
	if !ok {
		return nil
	}
	h.fanOut(w, r, h.round(sc, bodies), body, end)
	return nil
}

// round is sc's fan-out: one sub-request per partition, with bodies (see
// round.bodies).
func (h *Handler) round(sc *scheme, bodies [][]byte) round {
	return round{
		count:  sc.count,
		bodies: bodies,
		newCall: func(ctx context.Context, p subParent, i int) *subCall {
			return h.newSubCall(ctx, p, sc, i)
		},
	}
}

// requestBody reads the request body whole, by end, the call's deadline
// (zero: none); ok is false when it has answered the request itself: a
// body over max_request_body (413), not received by the deadline (408),
// or broken (400).
func (h *FanOut) requestBody(w http.ResponseWriter, r *http.Request, end time.Time) (body []byte, ok bool) {
	body, err := readBody(w, r, h.MaxRequestBody, end)
	if err != nil {
		switch {
		case errors.Is(err, errBodyTooLarge):
			h.answer(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body larger than max_request_body (%d bytes)", h.MaxRequestBody))
		case errors.Is(err, calldeadline.ErrBodyTimeout):
			h.answer(w, r, http.StatusRequestTimeout, err.Error()+h.deadlineName(r))
		default:
			h.answer(w, r, http.StatusBadRequest, "reading request body: "+err.Error())
		}
		return nil, false
	}
	return body, true
}

// rejected checks the reject rules against r, whose body was read whole
// (body), and answers 400 when one matches or fails; it reports whether it
// answered.
func (h *Handler) rejected(w http.ResponseWriter, r *http.Request, body []byte) bool {
	if len(h.Reject) == 0 {
		return false
	}
	if r.Body != nil && r.Body != http.NoBody {
		// The body was consumed; matchers that read it
		// ({http.request.body}) see the buffered copy.
		r.Body = io.NopCloser(bytes.NewReader(body))
	}
	for i, rule := range h.Reject {
		match, err := rule.match.MatchWithError(r)
		if err != nil {
			h.answer(w, r, http.StatusBadRequest, fmt.Sprintf("evaluating reject[%d]: %v", i, err))
			return true
		}
		if match {
			msg := rule.Message
			if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok && !rule.literal {
				msg = repl.ReplaceKnown(msg, "")
			}
			h.answer(w, r, http.StatusBadRequest, "request rejected: "+msg)
			return true
		}
	}
	return false
}

// deadlineName says which deadline a 408 answer is about: this
// handler's timeout, or the one of a selective (or parallel) it is nested
// in.
func (h *FanOut) deadlineName(r *http.Request) string {
	if _, outer := calldeadline.From(r.Context()); outer {
		return " (the enclosing selective's or parallel's timeout)"
	}
	return fmt.Sprintf(" (timeout %v)", time.Duration(h.Timeout))
}

var errBodyTooLarge = errors.New("request body too large")

// readBody reads the request body whole, before end (zero: no deadline).
func readBody(w http.ResponseWriter, r *http.Request, limit int64, end time.Time) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > limit {
		return nil, errBodyTooLarge
	}
	data, err := calldeadline.ReadBody(w, r, limit, end)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, errBodyTooLarge
		}
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, errBodyTooLarge
	}
	return data, nil
}

// answer writes a short plain-text response and exposes its text as
// {http.partition.error} ({http.parallel.error}).
func (h *FanOut) answer(w http.ResponseWriter, r *http.Request, status int, msg string) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(h.kind.ns+".error", msg)
	}
	hdr := w.Header()
	hdr.Set("Content-Type", "text/plain; charset=utf-8")
	hdr.Set("X-Content-Type-Options", "nosniff")
	hdr.Set("Content-Length", strconv.Itoa(len(msg)+1))
	w.WriteHeader(status)
	_, _ = io.WriteString(w, msg+"\n")
}

// errTimeout is the cancellation cause when the overall timeout expires,
// errDecided when the outcome is known before every partition answered.
var (
	errTimeout = errors.New("partition timeout")
	errDecided = errors.New("partition fan-out decided")
)

// outcome is what became of one partition.
type outcome struct {
	index   int
	skipped bool
	done    bool // the sub-request finished before the outcome was decided
	status  int  // sub-response status, or the status reverse_proxy chose for its error
	latency time.Duration
	err     error // nil: success
	// canceled: the sub-request was cancelled because the outcome was
	// decided without it; not a failure.
	canceled bool
	// overBudget: the sub-responses went over max_merged_body together
	// while this one was read; the request fails whatever fail_limit says.
	overBudget bool
	part       *Part
	dial       string // the replica of the last attempt
}

// fanOut runs one sub-request per part of rd and answers, by end, the
// call's deadline (zero: none).
func (h *FanOut) fanOut(w http.ResponseWriter, r *http.Request, rd round, body []byte, end time.Time) {
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	ctx, stop := calldeadline.Bound(ctx, end, errTimeout)
	defer stop()

	parent := subParent{Parent: subreq.Capture(r), req: r, body: body, bodies: rd.bodies, budget: &budget{limit: h.MaxMergedBody}}
	outcomes := make([]*outcome, rd.count)
	calls, ok := h.subCalls(ctx, w, r, rd, parent, outcomes)
	if !ok {
		return
	}
	// The fan-out's worst case, reserved before any sub-request and
	// released after the answer is written (a panic included).
	need := h.reservation(len(calls), parent.bodyBytes(calls))
	if !h.reserve(ctx, w, r, need) {
		return
	}
	defer mergeMemory.release(need)

	limit := h.FailLimit
	if limit <= 0 || limit > len(calls) {
		limit = len(calls)
	}
	results, wg := h.start(ctx, calls)
	t := h.collect(ctx, end, results, outcomes, len(calls), limit)
	cancel(errDecided)
	wg.Wait()

	if errors.Is(r.Context().Err(), context.Canceled) {
		// The client went away (or, inside a selective, another
		// attempt answered); nobody will read an answer. An outer
		// deadline that passed is answered as a timeout below.
		w.WriteHeader(499)
		return
	}
	t.settle(calls, outcomes)
	switch {
	case t.overBudget:
		h.report(w, r, rd, outcomes)
		h.tooLarge(w, r, "the sub-responses together are")
	case t.failed >= limit:
		h.failed(w, r, rd, outcomes, t, limit)
	default:
		h.merge(w, r, rd, outcomes, t.succeeded)
	}
}

// subCalls makes the sub-requests of rd's parts, but for those the skip
// matchers skip or split_body leaves without elements, whose outcomes it
// sets; ok is false when it has answered the request itself: a skip
// matcher failed, or every part was skipped.
func (h *FanOut) subCalls(ctx context.Context, w http.ResponseWriter, r *http.Request, rd round, parent subParent, outcomes []*outcome) (calls []*subCall, ok bool) {
	calls = make([]*subCall, 0, rd.count)
	for i := range rd.count {
		if parent.noBody(i) {
			outcomes[i] = &outcome{index: i, skipped: true}
			continue
		}
		c := rd.newCall(ctx, parent, i)
		if len(h.skip) > 0 {
			skip, err := h.skip.AnyMatchWithError(c.req)
			if err != nil {
				h.answer(w, r, http.StatusBadRequest, fmt.Sprintf("evaluating skip for %s %s: %v", h.kind.noun, rd.key(i), err))
				return nil, false
			}
			if skip {
				outcomes[i] = &outcome{index: i, skipped: true}
				continue
			}
		}
		calls = append(calls, c)
	}
	if len(calls) == 0 {
		h.report(w, r, rd, outcomes)
		h.answer(w, r, http.StatusBadRequest, fmt.Sprintf("all %d %s skipped", rd.count, h.kind.nouns))
		return nil, false
	}
	return calls, true
}

// reserve takes need bytes of max_merge_memory for the fan-out, waiting
// for room until ctx ends; ok is false when it has answered the request
// itself.
func (h *FanOut) reserve(ctx context.Context, w http.ResponseWriter, r *http.Request, need int64) (ok bool) {
	err := mergeMemory.acquire(ctx, need)
	if err == nil {
		return true
	}
	if r.Context().Err() != nil {
		w.WriteHeader(499)
		return false
	}
	h.noMergeMemory(w, r, need, err)
	return false
}

// start runs each sub-request in a goroutine of its own, which sends its
// outcome, a panic's included, on results (room for all); wg is done when
// every one has.
func (h *FanOut) start(ctx context.Context, calls []*subCall) (results <-chan *outcome, wg *sync.WaitGroup) {
	ch := make(chan *outcome, len(calls))
	wg = new(sync.WaitGroup)
	for _, c := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if v := recover(); v != nil {
					h.logger.Error(h.kind.name+" sub-request panicked", zap.Int(h.kind.noun, c.index), zap.Any("panic", v), zap.Stack("stack"))
					ch <- &outcome{index: c.index, status: http.StatusBadGateway, err: fmt.Errorf("panic: %v", v)}
				}
			}()
			ch <- h.runSubCall(ctx, c)
		}()
	}
	return ch, wg
}

// tally is what a fan-out's outcomes add up to once it is decided.
type tally struct {
	failed, succeeded int
	// deadline: the call's deadline passed before the outcome was
	// decided.
	deadline bool
	// overBudget: the sub-responses went over max_merged_body together.
	overBudget bool
}

// collect takes n outcomes from results into outcomes as they come, and
// stops as soon as the fan-out is decided: limit partitions failed, the
// sub-responses went over max_merged_body, the merger has enough (a
// Sufficer), or ctx ended (the deadline, or the client went away).
//
// A part that fails once end (the call's deadline) has passed timed out,
// whatever it says: a handler nested in it holds the same deadline and
// may answer it a moment before this one's timer fires, and the answer
// must not depend on which of the two was first.
func (h *FanOut) collect(ctx context.Context, end time.Time, results <-chan *outcome, outcomes []*outcome, n, limit int) (t tally) {
	for range n {
		select {
		case o := <-results:
			o.done = true
			outcomes[o.index] = o
			if o.err == nil {
				t.succeeded++
				if h.enough != nil && h.enough.Enough(t.succeeded) {
					return t
				}
				continue
			}
			if !end.IsZero() && !time.Now().Before(end) && !o.overBudget {
				o.status, o.err = http.StatusGatewayTimeout, errors.New("timeout")
				t.deadline = true
			}
			t.failed++
			if o.overBudget {
				t.overBudget = true
				return t
			}
			if t.failed >= limit {
				return t
			}
		case <-ctx.Done():
			t.deadline = errors.Is(context.Cause(ctx), errTimeout) || errors.Is(ctx.Err(), context.DeadlineExceeded)
			return t
		}
	}
	return t
}

// settle gives the partitions still running when the outcome was decided
// theirs: the deadline makes them failures; otherwise they were cancelled
// because they no longer mattered.
func (t *tally) settle(calls []*subCall, outcomes []*outcome) {
	for _, c := range calls {
		if outcomes[c.index] != nil {
			continue
		}
		o := &outcome{index: c.index, latency: time.Since(c.start)}
		if t.deadline {
			o.status, o.err = http.StatusGatewayTimeout, errors.New("timeout")
			t.failed++
		} else {
			o.err, o.canceled = errors.New("canceled"), true
		}
		outcomes[c.index] = o
	}
}

// failed answers a fan-out in which limit parts failed: 502, or 504 when
// the deadline passed, naming the failed parts.
func (h *FanOut) failed(w http.ResponseWriter, r *http.Request, rd round, outcomes []*outcome, t tally, limit int) {
	status := http.StatusBadGateway
	if t.deadline {
		status = http.StatusGatewayTimeout
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d/%d %s failed, fail_limit=%d", t.failed, rd.count, h.kind.nouns, limit)
	for _, o := range outcomes {
		if o != nil && o.err != nil && (o.done || t.deadline) {
			fmt.Fprintf(&b, " [%s]%s", rd.label(o.index), o.err)
		}
	}
	h.report(w, r, rd, outcomes)
	h.answer(w, r, status, b.String())
}

// merge answers with the merged responses of the succeeded parts.
func (h *FanOut) merge(w http.ResponseWriter, r *http.Request, rd round, outcomes []*outcome, succeeded int) {
	parts := make([]*Part, 0, succeeded)
	for _, o := range outcomes {
		if o != nil && o.done && o.err == nil {
			parts = append(parts, o.part)
		}
	}
	missing := missingParts(outcomes)
	merged, err := mergeParts(h.merger, parts, missing)
	h.report(w, r, rd, outcomes)
	if err != nil {
		h.answer(w, r, http.StatusBadGateway, "merging "+h.kind.noun+" responses: "+err.Error())
		return
	}
	if int64(len(merged.Body)) > h.MaxMergedBody {
		h.tooLarge(w, r, "the merged response is")
		return
	}
	hdr := w.Header()
	for k, v := range merged.Header {
		if k == "Content-Length" {
			continue
		}
		hdr[k] = v
	}
	hdr.Set("Content-Length", strconv.Itoa(len(merged.Body)))
	if len(missing) > 0 {
		hdr.Set(h.kind.missing, missingHeader(rd, missing))
	}
	status := merged.Status
	if status == 0 {
		status = http.StatusOK
	}
	w.WriteHeader(status)
	_, _ = w.Write(merged.Body)
}

// noMergeMemory answers 503 for a fan-out that could not reserve need
// bytes of max_merge_memory: it never fits (err is errNeverFits), or no
// room came before its deadline.
func (h *FanOut) noMergeMemory(w http.ResponseWriter, r *http.Request, need int64, err error) {
	v := mergeMemory.view()
	msg := fmt.Sprintf("merge memory full: this fan-out needs %d bytes, and max_merge_memory is %d with %d in use by %d fan-outs (%d waiting); no room before the deadline", need, v.Limit, v.InUse, v.FanOuts, v.Waiting)
	if errors.Is(err, errNeverFits) {
		msg = fmt.Sprintf("merge memory: this fan-out needs %d bytes (twice its merge bound, and the request bodies it sends), more than max_merge_memory %d", need, v.Limit)
	}
	w.Header().Set("Retry-After", "1")
	h.answer(w, r, http.StatusServiceUnavailable, msg)
}

// tooLarge answers 502 for a request that went over max_merged_body, and
// logs it: the limit is the operator's to raise.
func (h *FanOut) tooLarge(w http.ResponseWriter, r *http.Request, what string) {
	msg := fmt.Sprintf("%s larger than max_merged_body (%d bytes)", what, h.MaxMergedBody)
	if c := h.logger.Check(zap.WarnLevel, h.kind.name+" merge over max_merged_body"); c != nil {
		c.Write(zap.String("uri", r.RequestURI), zap.Int64("max_merged_body", h.MaxMergedBody), zap.String("error", msg))
	}
	h.answer(w, r, http.StatusBadGateway, msg)
}

// report sets the status header (X-Partition-Status, X-Parallel-Status)
// and the placeholders {http.partition.*} ({http.parallel.*}) for logs.
func (h *FanOut) report(w http.ResponseWriter, r *http.Request, rd round, outcomes []*outcome) {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	var b strings.Builder
	failed := 0
	for i, o := range outcomes {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=", rd.label(i))
		if o == nil || o.skipped {
			b.WriteString("skipped")
			continue
		}
		ms := o.latency.Milliseconds()
		fmt.Fprintf(&b, "%d;%dms", o.status, ms)
		if o.err != nil {
			if o.canceled {
				b.WriteString(";canceled")
			} else {
				b.WriteString(";failed")
				failed++
			}
		}
		if repl != nil {
			prefix := h.kind.ns + "." + rd.key(i) + "."
			repl.Set(prefix+"status", o.status)
			repl.Set(prefix+"latency", o.latency)
			repl.Set(prefix+"latency_ms", o.latency.Seconds()*1e3)
			repl.Set(prefix+"upstream", o.dial)
			if o.err != nil {
				repl.Set(prefix+"error", o.err.Error())
			}
		}
	}
	status := b.String()
	w.Header().Set(h.kind.header, status)
	if repl != nil {
		repl.Set(h.kind.ns+".count", rd.count)
		repl.Set(h.kind.ns+".failed", failed)
		repl.Set(h.kind.ns+".status", status)
	}
}

// Interface guards
var _ caddyhttp.MiddlewareHandler = (*Handler)(nil)
