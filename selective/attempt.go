package selective

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/subreq"
	"github.com/caddy-lbx/lbx/lbpolicy"
)

// attemptKind says why an attempt was made.
type attemptKind uint8

const (
	kindFirst attemptKind = iota
	kindRetry
	kindBackup
	numKinds
)

var kindNames = [numKinds]string{"first", "retry", "backup"}

// failure classifies how an attempt failed, for retry_on.
type failure uint8

const (
	failNone    failure = iota
	failDial            // no connection was made
	failTimeout         // a timeout (504 from the group)
	failError           // any other error of the group
	failStatus          // a response with a status retry_on lists
	failCancel          // cancelled: another attempt won, or the call ended
)

// attempt is one sending of the request to a group.
type attempt struct {
	c      *call
	g      int
	group  *group
	kind   attemptKind
	req    *http.Request
	repl   *caddy.Replacer
	cancel context.CancelFunc
	w      attemptWriter
	start  int64 // monoclock, for the estimator

	// answered is set when response headers arrived (a status, any):
	// the call no longer waits for this attempt's first answer.
	answered atomic.Bool
	// observed: the estimator was told of this attempt's outcome.
	observed bool

	// What happened, set before the attempt is handed back on done.
	finished bool // under c.mu
	lost     bool // it answered, but another attempt had won
	err      error
	panicked any
	failure  failure
	status   int
	held     *heldResponse
}

// heldResponse is a failure response kept in memory while another
// attempt may still answer in its place.
type heldResponse struct {
	header http.Header
	body   bytes.Buffer
}

// maxHeld is the largest failure response body kept; a longer one fails
// the attempt as an error instead (its answer cannot be replayed whole).
const maxHeld = 64 << 10

// errLost is returned to an attempt's writes once another attempt won.
var errLost = errors.New("another attempt answered first")

// errHeldTooLarge is returned to a failure response's writes beyond maxHeld.
var errHeldTooLarge = fmt.Errorf("failure response larger than %d bytes", maxHeld)

// errNoAnswer is a group's failure when its routes wrote no response.
var errNoAnswer = caddyhttp.Error(http.StatusBadGateway, errors.New("the group's routes wrote no response"))

// launch starts an attempt of kind on group g; avoid lists the upstreams
// its group's policy must leave out (a backup's, see group.spare).
func (c *call) launch(ctx context.Context, g int, kind attemptKind, avoid []string) {
	grp := c.h.groups[g]
	actx, cancel := context.WithCancel(ctx)
	a := &attempt{c: c, g: g, group: grp, kind: kind, cancel: cancel}
	a.w = attemptWriter{a: a}
	a.req, a.repl = c.newRequest(actx, &a.w)
	// A backup on a group that is already trying the request goes to
	// another replica, one with spare capacity: the group's policy leaves
	// out the others (when it tracks what requests tried, as lb_policy
	// least_time and panic do under a selective that hedges).
	lbpolicy.AvoidAll(a.req, avoid)
	c.mu.Lock()
	c.attempts = append(c.attempts, a)
	c.mu.Unlock()

	st := grp.state
	st.inFlight.Add(1)
	st.attempts.Add(1)
	if kind == kindBackup {
		st.backupSent.Add(1)
	}
	a.start = st.stats.Begin()
	go a.run()
}

// newRequest makes an attempt's request: a copy of the client's, with the
// body replayed from memory, and placeholders and variables of its own
// (subreq.Parent.Isolate); placeholders it does not know come from the
// client request's.
func (c *call) newRequest(ctx context.Context, w http.ResponseWriter) (*http.Request, *caddy.Replacer) {
	req := c.r.Clone(ctx)
	if c.replay {
		subreq.ReplayBody(req, c.body)
	} else {
		req.Body = c.r.Body // too large to keep: one attempt only
	}
	return c.parent.Isolate(req, w)
}

// run sends the attempt through the group's routes, then judges it and
// hands it back to the call.
func (a *attempt) run() {
	defer func() {
		if v := recover(); v != nil {
			a.panicked = v
			if v != http.ErrAbortHandler {
				a.c.h.logger.Error("selective attempt panicked", zap.String("group", a.group.name), zap.Any("panic", v), zap.Stack("stack"))
			}
		}
		a.judge()
		a.cancel()
		a.c.mu.Lock()
		a.finished = true
		a.c.mu.Unlock()
		a.c.done <- a
	}()
	a.err = a.group.sub.ServeHTTP(&a.w, a.req, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		return errNoAnswer
	}))
}

// judge classifies the finished attempt and records it in the group's
// state and metrics.
func (a *attempt) judge() {
	won := a.w.state == writerWon
	a.status = a.w.status
	switch {
	case won && a.panicked != nil:
		a.failure = failError // cut off mid-body; the call re-raises it
	case won && a.c.h.retryOn.status(a.status):
		a.failure = failStatus // the answer, and a failure of the group
	case won:
		a.failure = failNone
	case a.w.state == writerLost:
		a.lost = true
		a.failure = failCancel
	case a.w.state == writerHeld && a.w.overflow:
		a.failure, a.err = failError, fmt.Errorf("status %d: %w", a.status, errHeldTooLarge)
	case a.w.state == writerHeld && a.panicked == nil:
		a.failure, a.held = failStatus, &a.w.held
	case a.req.Context().Err() != nil:
		a.failure = failCancel
		if a.err == nil {
			a.err = a.req.Context().Err()
		}
	case a.panicked != nil:
		a.failure, a.err = failError, fmt.Errorf("aborted: %v", a.panicked)
	case a.err == nil:
		// The routes returned without an error and without writing.
		a.failure, a.err = failError, errNoAnswer
	default:
		a.failure = classify(a.err)
	}

	st := a.group.state
	st.inFlight.Add(-1)
	now := monoclock.Now()
	switch a.failure {
	case failNone:
		st.answers.Add(1)
		a.group.noteSuccess(a.c.h)
	case failCancel:
		if a.lost {
			st.answers.Add(1)
		}
	default:
		st.failures.Add(1)
		a.group.noteFailure(a.c.h, now)
	}
	if !a.observed {
		// No headers arrived: the estimator hears of a failure, or of an
		// attempt given up (a lower bound on the latency).
		outcome := hoststate.Failure
		if a.failure == failCancel {
			outcome = hoststate.Abandoned
			// a lower bound on its latency: a hedged stall still
			// counts in the distribution the auto delay follows
			st.lat.Observe(now, now-a.start)
		}
		a.c.h.table.ObserveAt(st.stats, a.start, now, outcome)
		a.observed = true
	}
	a.group.metrics.count(a.kind, a.failure, a.lost)
	if a.failure != failNone && a.failure != failCancel && a.c.h.logger != nil {
		if ce := a.c.h.logger.Check(zap.DebugLevel, "selective attempt failed"); ce != nil {
			ce.Write(zap.String("group", a.group.name), zap.String("kind", kindNames[a.kind]), zap.Int("status", a.status), zap.Error(a.err))
		}
	}
}

// headers tells the estimator that the attempt's response headers arrived
// now, as a success or (a failure status) a failure.
func (a *attempt) headers(failed bool) {
	a.answered.Store(true)
	if a.observed {
		return
	}
	a.observed = true
	outcome := hoststate.Success
	if failed {
		outcome = hoststate.Failure
	}
	now := monoclock.Now()
	if !failed {
		a.group.state.lat.Observe(now, now-a.start)
	}
	a.c.h.table.ObserveAt(a.group.state.stats, a.start, now, outcome)
}

// classify tells a group's error apart for retry_on: a dial error, a
// timeout (reverse_proxy answers 504), or any other.
func classify(err error) failure {
	if err == nil {
		return failNone
	}
	var dial reverseproxy.DialError
	if errors.As(err, &dial) {
		return failDial
	}
	var herr caddyhttp.HandlerError
	if errors.As(err, &herr) && herr.StatusCode == http.StatusGatewayTimeout {
		return failTimeout
	}
	var nerr net.Error
	if errors.As(err, &nerr) && nerr.Timeout() {
		return failTimeout
	}
	return failError
}

// noteFailure counts a failed attempt toward the group's failure streak.
func (g *group) noteFailure(h *Handler, now int64) {
	st := g.state
	st.lastFailureNs.Store(now)
	if st.consecutive.Add(1) >= failingStreak && st.failing.CompareAndSwap(false, true) {
		h.logger.Warn("selective group failing; other groups are preferred", zap.String("group", g.name), zap.Int("failures_in_a_row", failingStreak), zap.Stringer("cooldown", failingCooldown))
		h.events.Emit("selective_group_failing", map[string]any{"group": g.name})
	}
}

// noteSuccess ends the group's failure streak.
func (g *group) noteSuccess(h *Handler) {
	st := g.state
	if st.consecutive.Load() != 0 {
		st.consecutive.Store(0)
	}
	if st.failing.CompareAndSwap(true, false) {
		h.logger.Info("selective group answers again", zap.String("group", g.name))
		h.events.Emit("selective_group_recovered", map[string]any{"group": g.name})
	}
}

// The states of an attempt's writer.
const (
	writerPending = iota // nothing written yet
	writerWon            // it claimed the client's response and writes to it
	writerLost           // another attempt won; writes fail
	writerHeld           // a failure response, held in memory
)

// attemptWriter is the response writer of one attempt. Until the attempt
// has an answer it keeps headers of its own. An answer that is not a
// failure claims the client's response, once for the whole call, and
// then writes through; a failure status that another attempt may still
// replace is held in memory; everything after another attempt won is
// refused, which makes reverse_proxy stop reading the backend.
type attemptWriter struct {
	a        *attempt
	header   http.Header
	status   int
	state    int
	held     heldResponse
	overflow bool
}

// Header returns the attempt's own headers until it won, then the
// client's (reverse_proxy sets trailers after the body).
func (w *attemptWriter) Header() http.Header {
	if w.state == writerWon {
		return w.a.c.w.Header()
	}
	if w.header == nil {
		w.header = make(http.Header)
	}
	return w.header
}

// WriteHeader decides what the attempt's answer is: see attemptWriter.
func (w *attemptWriter) WriteHeader(code int) {
	c := w.a.c
	switch w.state {
	case writerWon:
		c.w.WriteHeader(code)
		return
	case writerLost, writerHeld:
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		return // interim responses of an attempt that has not won are dropped
	}
	if code == 499 && c.r.Context().Err() != nil {
		// reverse_proxy's record that the client request was cancelled
		// (the client left, or its body's read timed out), not an answer:
		// the call answers for itself (answerFailure).
		return
	}
	w.status = code
	if c.h.retryOn.status(code) && c.mayNotBeFinal(w.a) {
		w.state = writerHeld
		w.held.header = w.Header()
		w.a.headers(true)
		return
	}
	w.a.headers(c.h.retryOn.status(code))
	if !c.claim(w.a) {
		w.state = writerLost
		return
	}
	w.state = writerWon
	c.writeHead(w.a, w.header, code)
}

// Write writes body bytes as the state says.
func (w *attemptWriter) Write(p []byte) (int, error) {
	if w.state == writerPending {
		w.WriteHeader(http.StatusOK)
	}
	switch w.state {
	case writerWon:
		return w.a.c.w.Write(p)
	case writerHeld:
		if w.held.body.Len()+len(p) > maxHeld {
			w.overflow = true
			return 0, errHeldTooLarge
		}
		return w.held.body.Write(p)
	}
	return 0, errLost
}

// FlushError flushes the client's response once the attempt won.
func (w *attemptWriter) FlushError() error {
	if w.state != writerWon {
		return nil
	}
	err := http.NewResponseController(w.a.c.w).Flush()
	if errors.Is(err, http.ErrNotSupported) {
		return nil
	}
	return err
}

// Flush is FlushError for callers that use http.Flusher.
func (w *attemptWriter) Flush() { _ = w.FlushError() }

// Hijack takes over the client's connection, for a protocol upgrade the
// attempt won (its 101 claimed the response).
func (w *attemptWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	if w.state != writerWon {
		return nil, nil, errLost
	}
	return http.NewResponseController(w.a.c.w).Hijack()
}

// EnableFullDuplex passes through: it is a property of the client's
// connection, harmless to ask for from any attempt.
func (w *attemptWriter) EnableFullDuplex() error {
	return http.NewResponseController(w.a.c.w).EnableFullDuplex()
}

// SetWriteDeadline applies to the client's connection once the attempt won.
func (w *attemptWriter) SetWriteDeadline(t time.Time) error {
	if w.state != writerWon {
		return nil
	}
	return http.NewResponseController(w.a.c.w).SetWriteDeadline(t)
}

// SetReadDeadline applies to the client's connection once the attempt won.
func (w *attemptWriter) SetReadDeadline(t time.Time) error {
	if w.state != writerWon {
		return nil
	}
	return http.NewResponseController(w.a.c.w).SetReadDeadline(t)
}

// retrySet is a parsed retry_on list.
type retrySet struct {
	dial, timeout, err bool
	statuses           []int
}

var defaultRetryOn = []string{"dial", "timeout", "error", "502", "503", "504"}

// retryOnWant describes the valid retry_on values, for error messages.
const retryOnWant = `"dial", "timeout", "error" or a status code from 100 to 599`

// parseRetryOn parses a retry_on list.
func parseRetryOn(list []string) (retrySet, error) {
	var s retrySet
	for _, v := range list {
		switch v {
		case "dial":
			s.dial = true
		case "timeout":
			s.timeout = true
		case "error":
			s.err = true
		default:
			n, err := strconv.Atoi(v)
			if err != nil || n < 100 || n > 599 {
				return retrySet{}, fmt.Errorf("retry_on %q: want %s", v, retryOnWant)
			}
			if !slices.Contains(s.statuses, n) {
				s.statuses = append(s.statuses, n)
			}
		}
	}
	return s, nil
}

// status reports whether a response with code is a failure to retry.
func (s retrySet) status(code int) bool { return slices.Contains(s.statuses, code) }

// has reports whether an attempt that failed as f (with status, for a
// failure status) may be retried.
func (s retrySet) has(f failure, status int) bool {
	switch f {
	case failDial:
		return s.dial
	case failTimeout:
		return s.timeout
	case failError:
		return s.err
	case failStatus:
		return s.status(status)
	}
	return false
}
