package selective

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
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

// call is one client request's way through the handler: its attempts,
// which of them won the client's response, and what the client gets when
// none did.
type call struct {
	h *Handler
	w http.ResponseWriter // the client's
	r *http.Request       // the client's
	// parent is what attempts are made from: the client request's
	// server, placeholders (nil outside Caddy's server) and a snapshot
	// of its variables.
	parent subreq.Parent

	// body is the request body kept in memory; replay says attempts may
	// be repeated (the body is kept, or there is none).
	body   []byte
	replay bool
	// stream is the body when it is too large to keep and streams to
	// one attempt.
	stream *calldeadline.Stream
	// deadline is the call's; zero: none.
	deadline time.Time
	hedge    bool // a backup request may be sent
	key      string
	keyed    bool

	// done receives each attempt when it has finished.
	done chan *attempt

	mu       sync.Mutex // guards what follows
	attempts []*attempt
	winner   *attempt
	closed   bool // the call answered by itself: nobody may claim any more
	backup   string
}

// The states of the backup request, for placeholders and the header.
const (
	backupNone    = "none"
	backupSent    = "sent"
	backupWon     = "won"
	backupRefused = "refused"
	backupBusy    = "busy"
	backupQueued  = "queued"
)

// maxAttempts bounds one call's attempts: the first, every retry, and one
// backup request.
func (h *Handler) maxAttempts() int { return 2 + h.maxRetry }

// ServeHTTP implements caddyhttp.MiddlewareHandler. The handler answers
// every request itself: next is not called.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	h.calls.Add(1)
	h.budget.deposit()
	c := &call{
		h:      h,
		w:      w,
		r:      r,
		done:   make(chan *attempt, h.maxAttempts()),
		backup: backupNone,
	}
	c.parent = subreq.Capture(r)
	// The call's deadline starts here: reading the request body counts
	// against it as much as the attempts do.
	deadline, _ := calldeadline.Start(r.Context(), time.Duration(h.Timeout))
	if err := c.readBody(deadline); err != nil {
		return err
	}
	c.hedge = h.hedges() && c.replay && h.hedgeable(r)

	c.deadline = deadline
	ctx, cancel := calldeadline.Bound(r.Context(), deadline, nil)
	defer cancel()
	return c.run(ctx)
}

// hedgeable reports whether r may be sent twice: it matches backup_match
// (by default GET or HEAD), and it is not a protocol upgrade, which
// cannot be answered twice whatever the matchers say.
func (h *Handler) hedgeable(r *http.Request) bool {
	if r.Header.Get("Upgrade") != "" {
		return false
	}
	if h.backupMatch != nil {
		return h.backupMatch.AnyMatch(r)
	}
	return r.Method == http.MethodGet || r.Method == http.MethodHead
}

// readBody keeps the request body in memory, up to max_replay_body, so
// that attempts can be repeated; a larger body is left to stream to a
// single attempt. The body must arrive before deadline (zero: none), or
// the call ends with 408.
func (c *call) readBody(deadline time.Time) error {
	r := c.r
	if r.Body == nil || r.Body == http.NoBody {
		c.replay = true
		return nil
	}
	limit := c.h.MaxReplayBody
	if limit == 0 {
		limit = defaultMaxReplayBody
	}
	if r.ContentLength > limit {
		c.stream = calldeadline.StreamBody(c.w, r, deadline)
		return nil
	}
	buf, err := calldeadline.ReadBody(c.w, r, limit, deadline)
	if err != nil {
		if errors.Is(err, calldeadline.ErrBodyTimeout) {
			return caddyhttp.Error(http.StatusRequestTimeout, fmt.Errorf("selective: %w", err))
		}
		if r.Context().Err() != nil {
			return caddyhttp.Error(499, err)
		}
		return caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("selective: reading the request body: %v", err))
	}
	if int64(len(buf)) > limit {
		// Too large to keep: what was read goes first, the rest streams.
		c.stream = calldeadline.StreamBody(c.w, r, deadline)
		r.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), c.stream), c.stream}
		return nil
	}
	c.body, c.replay = buf, true
	return nil
}

// run makes the attempts and waits for all of them to finish: the first,
// a backup request when the first has not answered within the delay, and
// a retry on another group after a failure, while none is running.
func (c *call) run(ctx context.Context) error {
	h := c.h
	now := monoclock.Now()
	var delay time.Duration
	if g := h.pick(c, now, func(int) bool { return false }); g >= 0 {
		c.launch(ctx, g, kindFirst, nil)
		if c.hedge {
			delay = h.backupDelay(h.groups[g], now)
		}
	}
	var hedgeC <-chan time.Time
	var hedgeT *time.Timer
	if c.hedge && delay > 0 {
		hedgeT = time.NewTimer(delay)
		defer hedgeT.Stop()
		hedgeC = hedgeT.C
	}
	running := len(c.attempts)
	var last *attempt
	for running > 0 {
		select {
		case <-hedgeC:
			hedgeC = nil
			switch c.sendBackup(ctx, delay) {
			case hedgeSent:
				running++
			case hedgeLater:
				// Queued, not stuck: look again, as a replica that
				// is making progress may yet freeze.
				hedgeT.Reset(max(delay/2, minBackupRequest))
				hedgeC = hedgeT.C
			}
		case a := <-c.done:
			running--
			if c.winnerIs(a) {
				// The answer is complete: send it now rather than when
				// the cancelled attempts have unwound.
				if a.panicked == nil {
					_ = http.NewResponseController(c.w).Flush()
				}
				continue
			}
			if a.lost {
				continue
			}
			last = a
			if running > 0 || c.retriesLeft() == 0 || ctx.Err() != nil || !c.retryable(a) {
				continue
			}
			if g := h.pick(c, monoclock.Now(), c.retryExcluded(a.g)); g >= 0 {
				c.launch(ctx, g, kindRetry, nil)
				running++
			}
		}
	}
	c.mu.Lock()
	c.closed = true
	winner := c.winner
	c.mu.Unlock()
	if winner != nil {
		c.finish(winner, nil)
		if winner.panicked != nil {
			// The response was cut off (the client left, or the
			// backend's body broke): let the server abort it, as
			// reverse_proxy would.
			panic(winner.panicked)
		}
		return nil
	}
	return c.answerFailure(ctx, last)
}

// What sendBackup did.
const (
	hedgeNone  = iota // no backup, and none to come
	hedgeSent         // a backup request was sent
	hedgeLater        // the call is queued, not stuck: look again later
)

// sendBackup sends the backup request, if the call still waits for its
// first answer and looks stuck rather than queued (see queued), to a
// replica with spare capacity that no attempt of the call is using (see
// backupTarget), within the budget.
func (c *call) sendBackup(ctx context.Context, delay time.Duration) int {
	c.mu.Lock()
	waiting := c.winner == nil
	for _, a := range c.attempts {
		if a.answered.Load() {
			waiting = false
		}
	}
	c.mu.Unlock()
	if !waiting || ctx.Err() != nil {
		return hedgeNone
	}
	now := monoclock.Now()
	if c.queued(now, delay) {
		c.mu.Lock()
		first := c.backup == backupNone
		if first {
			c.backup = backupQueued
		}
		c.mu.Unlock()
		if first {
			c.h.backupQueued.Add(1)
			backupRefusedTotal.WithLabelValues(refusedQueued).Inc()
		}
		return hedgeLater
	}
	g, avoid := c.backupTarget(now, delay)
	if g < 0 {
		c.setBackup(backupBusy)
		c.h.backupBusy.Add(1)
		backupRefusedTotal.WithLabelValues(refusedBusy).Inc()
		return hedgeNone
	}
	if !c.h.budget.take() {
		c.setBackup(backupRefused)
		backupRefusedTotal.WithLabelValues(refusedBudget).Inc()
		return hedgeNone
	}
	c.setBackup(backupSent)
	c.launch(ctx, g, kindBackup, avoid)
	return hedgeSent
}

// queued reports whether a running attempt of the call waits where work
// is moving: its replica finished something (another request's answer)
// within the last half delay. Such an attempt is merely queued: a backup
// would add load where the queue is, and the answer is on its way. An
// attempt whose replica has finished nothing for half the delay or more
// while busy is stuck (a freeze, a slow request): that includes a replica
// busy with this request alone, which was idle when it got it, since its
// busy period began with the attempt, a whole delay ago.
//
// The replica's state is the one lbx's policies keep for every upstream
// (least_time, the default in a group, and panic record it); for an upstream
// no lbx policy observes, and for groups that are not one reverse_proxy
// with static upstreams, the group's own state stands in: whether any
// attempt of this handler on the group got an answer lately.
func (c *call) queued(now int64, delay time.Duration) bool {
	half := float64(delay) / 2
	base := c.h.table.Baseline()
	c.mu.Lock()
	running := make([]*attempt, 0, 2)
	for _, a := range c.attempts {
		if !a.finished {
			running = append(running, a)
		}
	}
	c.mu.Unlock()
	for _, a := range running {
		if a.stalled(now, base) < half {
			return true
		}
	}
	return false
}

// stalled returns how long (ns) the replica a went to has finished
// nothing while busy; see queued.
func (a *attempt) stalled(now int64, base float64) float64 {
	g := a.group
	if g.static != nil {
		if dial, ok := a.repl.GetString("http.reverse_proxy.upstream.hostport"); ok {
			for i, u := range g.static {
				if u.Dial != dial {
					continue
				}
				if _, busy := g.hosts.Judge(g.upStats[i], now, base); busy > 0 {
					return busy
				}
				break
			}
		}
	}
	_, busy := a.c.h.table.Judge(g.state.stats, now, base)
	return busy
}

// backupTarget returns the group a backup request goes to and the
// upstreams its policy must leave out, or -1 when no group has a spare
// replica the call is not already using. A spare replica must be expected
// to answer within the delay or twice the groups' typical latency,
// whichever is longer: one expected to be slower than the attempt it
// backs up is no backup.
func (c *call) backupTarget(now int64, delay time.Duration) (int, []string) {
	h := c.h
	base := h.table.Baseline()
	limit := max(float64(delay), 2*base)
	if g := h.pick(c, now, c.runningExcluded); g >= 0 {
		if ok, avoid := h.groups[g].spare(now, nil, limit, base); ok {
			return g, avoid
		}
	}
	for g := range h.groups {
		if !c.runningExcluded(g) {
			continue
		}
		if ok, avoid := h.groups[g].spare(now, c.runningDials(g), limit, base); ok {
			return g, avoid
		}
	}
	return -1, nil
}

// runningDials returns the upstreams the call's running attempts on
// group g went to.
func (c *call) runningDials(g int) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var dials []string
	for _, o := range c.attempts {
		if o.g == g && !o.finished {
			if dial, ok := o.repl.GetString("http.reverse_proxy.upstream.hostport"); ok {
				dials = append(dials, dial)
			}
		}
	}
	return dials
}

func (c *call) setBackup(state string) {
	c.mu.Lock()
	c.backup = state
	c.mu.Unlock()
}

// runningExcluded leaves out the groups with an attempt of this call
// running.
func (c *call) runningExcluded(i int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, a := range c.attempts {
		if a.g == i && !a.finished {
			return true
		}
	}
	return false
}

// retryExcluded returns the exclusion for a retry after an attempt on
// group failed: every group this call tried, or, once every group was
// tried, the failed one alone (unless it is the only group).
func (c *call) retryExcluded(failed int) func(int) bool {
	c.mu.Lock()
	tried := make([]bool, len(c.h.groups))
	for _, a := range c.attempts {
		tried[a.g] = true
	}
	c.mu.Unlock()
	for _, t := range tried {
		if !t {
			return func(i int) bool { return tried[i] }
		}
	}
	if len(tried) == 1 {
		return func(int) bool { return false }
	}
	return func(i int) bool { return i == failed }
}

// winnerIs reports whether a won the client's response.
func (c *call) winnerIs(a *attempt) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.winner == a
}

// claim makes a the winner unless another attempt won already or the call
// answered by itself, and cancels every other attempt.
func (c *call) claim(a *attempt) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.winner != nil || c.closed {
		return false
	}
	c.winner = a
	if a.kind == kindBackup {
		c.backup = backupWon
		a.group.state.backupWon.Add(1)
		a.group.metrics.backupWon.Inc()
	}
	for _, o := range c.attempts {
		if o != a {
			o.cancel()
		}
	}
	return true
}

// mayNotBeFinal reports whether a failure status from a may yet be
// replaced by another answer: another attempt is running, or a retry may
// follow it. When not, the failure is the answer and streams at once.
func (c *call) mayNotBeFinal(a *attempt) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, o := range c.attempts {
		if o != a && !o.finished {
			return true
		}
	}
	return c.retriesLeftLocked() > 0 && c.replay && c.methodRetryable(failStatus)
}

// retriesLeft returns how many more retries the call may make.
func (c *call) retriesLeft() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.retriesLeftLocked()
}

// retriesLeftLocked is retriesLeft with c.mu held.
func (c *call) retriesLeftLocked() int {
	n := c.h.maxRetry
	for _, o := range c.attempts {
		if o.kind == kindRetry {
			n--
		}
	}
	return n
}

// retryable reports whether the failure of a may be retried.
func (c *call) retryable(a *attempt) bool {
	return c.replay && c.h.retryOn.has(a.failure, a.status) && c.methodRetryable(a.failure)
}

// methodRetryable applies Caddy's rule for methods: a request that may
// have reached a backend is retried only when its method is safe (GET,
// HEAD, OPTIONS, TRACE), unless retry_any_method is set; one that never
// left (a dial error) always may be.
func (c *call) methodRetryable(f failure) bool {
	if f == failDial || c.h.RetryAnyMethod {
		return true
	}
	switch c.r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// hashKey returns the hash policy's key for this request, evaluated once.
func (c *call) hashKey() string {
	if !c.keyed {
		c.keyed = true
		if c.parent.Repl != nil {
			c.key = c.parent.Repl.ReplaceAll(c.h.Policy.Key, "")
		} else {
			c.key = c.h.Policy.Key
		}
	}
	return c.key
}

// answerFailure answers the client when no attempt won: with the call's
// timeout, or the last failure — the response the group gave (held in
// memory), or the group's error.
func (c *call) answerFailure(ctx context.Context, last *attempt) error {
	c.finish(last, func() string {
		switch {
		case last == nil:
			return "no group to send the request to"
		case last.err != nil:
			return last.err.Error()
		}
		return "status " + strconv.Itoa(last.status)
	})
	switch {
	case c.stream != nil && c.stream.Late(c.deadline):
		// The client, not the group, held the call up: the group never
		// had the whole request. (On HTTP/1 the body's read timeout has
		// also cancelled the client request's context.)
		calldeadline.CloseAfter(c.w, c.r)
		return caddyhttp.Error(http.StatusRequestTimeout, fmt.Errorf("selective: %w (streamed to one group)", calldeadline.ErrBodyTimeout))
	case c.r.Context().Err() != nil:
		return caddyhttp.Error(499, c.r.Context().Err())
	case ctx.Err() != nil:
		return caddyhttp.Error(http.StatusGatewayTimeout, fmt.Errorf("selective: no answer before the deadline (%d attempts)", len(c.attempts)))
	case last == nil:
		return caddyhttp.Error(http.StatusBadGateway, errors.New("selective: no group to send the request to"))
	case last.held != nil:
		c.writeHeld(last)
		return nil
	}
	var herr caddyhttp.HandlerError
	if errors.As(last.err, &herr) {
		return caddyhttp.Error(herr.StatusCode, fmt.Errorf("selective: group %s: %w", last.group.name, herr.Err))
	}
	return caddyhttp.Error(http.StatusBadGateway, fmt.Errorf("selective: group %s: %w", last.group.name, last.err))
}

// writeHeld sends the failure response a held to the client.
func (c *call) writeHeld(a *attempt) {
	c.writeHead(a, a.held.header, a.status)
	if _, err := c.w.Write(a.held.body.Bytes()); err != nil && c.h.logger != nil {
		c.h.logger.Debug("writing a group's failure response", zap.Error(err))
	}
}

// writeHead starts the client's response with the answer of a: its
// header, the status header when configured, and status; the call's
// placeholders are set first, for handlers that read them as the
// response starts (header ops).
func (c *call) writeHead(a *attempt, header http.Header, status int) {
	s := c.summarize()
	dst := c.w.Header()
	maps.Copy(dst, header)
	if c.h.StatusHeader != "" {
		dst.Set(c.h.StatusHeader, fmt.Sprintf("%s; attempts=%d; tried=%s; backup=%s", a.group.name, s.attempts, s.tried, s.backup))
	}
	c.setPlaceholders(a, s)
	c.w.WriteHeader(status)
}

// finish sets the call's placeholders and access-log field: the group
// that answered (a, nil when none was tried), the attempts, the groups
// tried, the backup request and, when errText is not nil, the error.
// The answering attempt's reverse_proxy placeholders (the upstream it
// used) are copied to the client request's.
func (c *call) finish(a *attempt, errText func() string) {
	if a != nil && c.parent.Repl != nil {
		copyProxyPlaceholders(c.parent.Repl, a.repl, a.w.header)
	}
	c.setPlaceholders(a, c.summarize())
	if errText != nil && c.parent.Repl != nil {
		c.parent.Repl.Set("http.selective.error", errText())
	}
	if a == nil {
		return
	}
	if extra, ok := c.r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields); ok {
		extra.Set(zap.String("selective_group", a.group.name))
	}
}

// setPlaceholders sets the call's placeholders from s.
func (c *call) setPlaceholders(a *attempt, s summary) {
	if c.parent.Repl == nil {
		return
	}
	if a != nil {
		c.parent.Repl.Set("http.selective.group", a.group.name)
	}
	c.parent.Repl.Set("http.selective.attempts", s.attempts)
	c.parent.Repl.Set("http.selective.tried", s.tried)
	c.parent.Repl.Set("http.selective.backup", s.backup)
}

// summary is what a call has done so far: its attempts, the groups tried
// in order (comma-separated, each once) and the backup request's state.
type summary struct {
	attempts      int
	tried, backup string
}

func (c *call) summarize() summary {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	var seen [maxGroups]bool
	for _, a := range c.attempts {
		if seen[a.g] {
			continue
		}
		seen[a.g] = true
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(a.group.name)
	}
	return summary{attempts: len(c.attempts), tried: b.String(), backup: c.backup}
}

// proxyPlaceholders are the placeholders reverse_proxy sets on a request
// it proxied (besides one per response header).
var proxyPlaceholders = []string{
	"http.reverse_proxy.duration", "http.reverse_proxy.duration_ms",
	"http.reverse_proxy.is_transport_error", "http.reverse_proxy.retries",
	"http.reverse_proxy.status_code", "http.reverse_proxy.status_text",
	"http.reverse_proxy.upstream.address", "http.reverse_proxy.upstream.host",
	"http.reverse_proxy.upstream.hostport", "http.reverse_proxy.upstream.port",
	"http.reverse_proxy.upstream.requests", "http.reverse_proxy.upstream.max_requests",
	"http.reverse_proxy.upstream.fails", "http.reverse_proxy.upstream.latency",
	"http.reverse_proxy.upstream.latency_ms", "http.reverse_proxy.upstream.duration",
	"http.reverse_proxy.upstream.duration_ms",
}

// copyProxyPlaceholders copies the reverse_proxy placeholders of an
// attempt's replacer (src, whose response had header) to the client
// request's (dst). They are copied, not looked up through src: src falls
// back to dst for what it does not know, and a lookup each way would
// never end for a placeholder neither knows.
func copyProxyPlaceholders(dst, src *caddy.Replacer, header http.Header) {
	for _, k := range proxyPlaceholders {
		if v, ok := src.Get(k); ok {
			dst.Set(k, v)
		}
	}
	for name := range header {
		k := "http.reverse_proxy.header." + name
		if v, ok := src.Get(k); ok {
			dst.Set(k, v)
		}
	}
}
