package lbpolicy

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/choose"
	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/randpick"
)

func init() {
	caddy.RegisterModule(new(LeastTimeSelection))
}

// LeastTimeSelection is the least_time selection policy: latency-aware,
// like least_conn with the time an answer is expected to take weighed in.
// Each request goes to the upstream with the lowest expected cost,
//
//	cost = (requests in flight + 1) × expected latency / weight
//
// where the expected latency is the median time to response headers of
// the upstream's last 16 answers within `decay`, raised live when it has gone
// without answering for longer than that while requests are in flight (a
// stall is seen as it happens), and doubled for each failed attempt in a
// row (a transport error, or a 502, 503 or 504: an instant failure never
// looks fast). An upstream that fails part of its attempts has its cost
// multiplied by 1/(1−f)², f being the share of its attempts of the last
// few seconds that failed, so it draws about its success-weighted share
// rather than more than a healthy one. A fresh ORCA load report that says
// the upstream is past its capacity (a utilization above 1) multiplies the
// expected latency by that load, up to 32, fading over load_reports'
// max_age; below capacity a report changes nothing. The first 1.5× of a difference
// in expected latency does not count: upstreams within it are compared by
// load alone, exactly as least_conn would, and only the excess of a clear
// difference in speed is weighed against the load. An upstream not tried
// for `decay`, with nothing in flight, is expected at the pool's typical
// latency, so one request tells whether it has recovered; a new upstream
// starts there too, neither starved nor stampeded.
//
// Latency is observed at the round trip: in Provision the policy wraps the
// reverse_proxy handler's transport (the configured one, or Caddy's
// default) in a transport that measures each attempt and forwards
// everything else unchanged, so no other configuration is needed. State is
// kept per dial address, shared by all handlers and kept across config
// reloads.
//
// When fewer than panic_threshold percent of the upstreams are available
// (per Caddy's health checks, passive failures and max_requests), the policy
// chooses among all upstreams that are not full, ignoring health.
//
// The expected latency is a median, not an exponentially weighted moving
// average: the policy's earlier name, ewma, is still accepted (see
// EWMASelection) and behaves the same.
type LeastTimeSelection struct {
	// How many upstreams to compare per request: a number of random
	// candidates (2 or more), "all" for a full scan, or "auto" (the
	// default): all for pools of up to 32 upstreams, 2 above.
	Choices Choices `json:"choices,omitempty"`

	// How long an answer counts toward an upstream's latency estimate,
	// and how long an upstream goes untried before one request is let
	// through to see whether it changed: a host that recovered regains its
	// share within about this long, and a host still slow costs one slow
	// request per period. Default: 1s.
	Decay caddy.Duration `json:"decay,omitempty"`

	// The weights of the upstreams, in the order they are configured; each at
	// least 1. A weight divides the cost, so an upstream of weight 2 is
	// expected to serve twice the concurrent requests at the same latency.
	// Upstreams beyond the list have weight 1. Default: all 1.
	Weights []int `json:"weights,omitempty"`

	// Percentage of upstreams that must be available for health to be
	// respected; below it, the pool is in panic mode. 0 disables panic
	// mode. Default: 50.
	PanicThreshold *float64 `json:"panic_threshold,omitempty"`

	// Ejection of outliers, judged on live traffic; off when absent. An ejected
	// upstream is not chosen (unless the pool is in panic mode) and counts
	// as unavailable for the panic threshold.
	Outlier *Outlier `json:"outlier,omitempty"`

	// A slow start: an upstream that joins the pool, or returns to it after
	// an ejection or after failing Caddy's health checks, gets a share
	// that ramps up over a window instead of a full share at once. Off
	// when absent.
	SlowStart *SlowStart `json:"slow_start,omitempty"`

	// A budget for reverse_proxy's retries: a retry (a second selection
	// for the same request) is refused while too many retries are in
	// flight, so a brown-out does not turn into a retry storm. Off when
	// absent.
	RetryBudget *RetryBudget `json:"retry_budget,omitempty"`

	// How the ORCA load reports backends send in the
	// Endpoint-Load-Metrics response header are taken in. They are
	// read, and the header removed from responses, also when this is
	// absent (with its defaults), and a fresh report that says an upstream
	// is past its capacity raises the latency expected of it. Its probe block, when
	// present, has the policy ask upstreams for reports itself.
	LoadReports *LoadReports `json:"load_reports,omitempty"`

	// name is the policy's name as configured, "least_time" or "ewma": it
	// names the policy in logs, events, errors, metrics and admin views,
	// so that a config written with ewma reads as it always did.
	name     string
	table    *hoststate.Table
	observer *observingTransport
	views    views
	// prober sends load probes; nil when load_reports has no probe.
	prober *loadProber
	panic  panicMode
	logger *zap.Logger
	// trackTried: the handler can retry, so each request records what it
	// tried and a retry avoids it (see tried.go)
	trackTried bool
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *LeastTimeSelection) UnmarshalJSON(b []byte) error {
	type plain LeastTimeSelection
	return jsonfield.Decode(b, (*plain)(x))
}

// CaddyModule returns the Caddy module information.
func (*LeastTimeSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies." + leastTimeName,
		New: func() caddy.Module { return new(LeastTimeSelection) },
	}
}

// leastTimeName is the policy's name; ewmaName is its earlier one.
const (
	leastTimeName = "least_time"
	ewmaName      = "ewma"
)

// policyName is the name the policy was configured under.
func (s *LeastTimeSelection) policyName() string {
	if s.name == "" {
		return leastTimeName
	}
	return s.name
}

// leastTime returns the policy itself, under either of its names: the
// ewma module embeds it, and code that needs the policy's state asks for
// a leastTimer rather than one of the two types.
func (s *LeastTimeSelection) leastTime() *LeastTimeSelection { return s }

// leastTimer is the least_time policy under either of its names.
type leastTimer interface{ leastTime() *LeastTimeSelection }

// Provision sets up the policy and instruments the parent reverse_proxy's
// transport so latency is observed.
func (s *LeastTimeSelection) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger()
	emitter := events.New(ctx)
	s.panic = newPanicMode(s.PanicThreshold, s.policyName(), s.logger, emitter)
	s.table = hoststate.NewTable(hoststate.Config{Horizon: time.Duration(s.Decay)})
	s.trackTried = TracksTried(ctx)

	if s.Outlier != nil {
		s.Outlier.provision(s.logger, emitter)
	}
	if s.SlowStart != nil {
		s.SlowStart.provision()
	}
	if s.RetryBudget != nil {
		s.RetryBudget.provision(s.logger)
	}
	s.LoadReports = loadReportsOrDefault(s.LoadReports)
	// Caddy validates after provisioning, but install starts the outlier
	// sweep loop: a bad value must be refused before it (a negative
	// interval panicked in NewTicker and took the process down).
	if err := s.Validate(); err != nil {
		return err
	}
	h, observer, err := observeTraffic(ctx, s.table, s.Outlier, s.LoadReports,
		s.policyName()+" policy is not inside a reverse_proxy handler; latency is not observed, selecting by requests in flight only")
	if err != nil {
		return err
	}
	if h != nil {
		s.observer = observer
		s.views.rel = newReleaser(s.table, h, s.linger())
		if s.observer != nil && s.RetryBudget != nil {
			s.observer.budget = s.RetryBudget
		}
		if s.observer != nil && s.LoadReports.Probe != nil {
			// through the handler's own transport, inside the observing
			// one: a probe is neither traffic nor a health check
			s.prober, err = newLoadProber(ctx, s.LoadReports.Probe, s.observer.inner, s.table, s.LoadReports, s.Outlier, s.logger)
			if err != nil {
				return fmt.Errorf("%s: %v", s.policyName(), err)
			}
		}
		if err := checkWeightCount(s.policyName(), s.Weights, h); err != nil {
			return err
		}
	}
	if s.views.rel == nil {
		s.views.rel = newReleaser(s.table, nil, s.linger())
	}
	if s.LoadReports.Probe != nil && s.prober == nil {
		s.logger.Warn(s.policyName() + " policy has no reverse_proxy transport to probe through; load_reports probe is off")
	}
	if err := registerMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	s.views.startReleasing(ctx.Done(), s.logger)
	registerPool(s)
	return nil
}

// linger is how long the policy keeps the view and the state of an
// address its pools no longer offer (see lingerFor): twice its longest
// window of per-upstream state, at least a minute.
func (s *LeastTimeSelection) linger() time.Duration {
	return lingerOf(s.Outlier, s.SlowStart, time.Duration(s.Decay))
}

// Validate checks the configuration.
func (s *LeastTimeSelection) Validate() error {
	if err := s.Choices.validate(); err != nil {
		return fmt.Errorf("%s: %v", s.policyName(), err)
	}
	if s.Decay != 0 {
		if err := checkDecay(time.Duration(s.Decay)); err != nil {
			return fmt.Errorf("%s: %v", s.policyName(), err)
		}
	}
	for i, w := range s.Weights {
		if err := checkWeight(w); err != nil {
			return fmt.Errorf("%s: weights[%d]: %v", s.policyName(), i, err)
		}
	}
	if s.PanicThreshold != nil {
		if err := bounds.Percent("panic_threshold", *s.PanicThreshold); err != nil {
			return fmt.Errorf("%s: %v", s.policyName(), err)
		}
	}
	if s.Outlier != nil {
		if err := s.Outlier.validate(); err != nil {
			return err
		}
	}
	if s.SlowStart != nil {
		if err := s.SlowStart.validate(); err != nil {
			return err
		}
	}
	if s.RetryBudget != nil {
		if err := s.RetryBudget.validate(); err != nil {
			return err
		}
	}
	if s.LoadReports != nil {
		if err := s.LoadReports.validate(); err != nil {
			return fmt.Errorf("%s: %v", s.policyName(), err)
		}
	}
	return nil
}

// Bounds of the least_time options. A decay below a millisecond forgets every
// answer before the next one arrives; one of days never tries a slow
// host again. A weight is a ratio between upstreams: beyond a million it can
// only be a typo.
const (
	minDecay  = time.Millisecond
	maxDecay  = 24 * time.Hour
	maxWeight = 1_000_000
)

// checkDecay is the rule for decay, shared with the Caddyfile parser.
func checkDecay(d time.Duration) error { return bounds.Duration("decay", d, minDecay, maxDecay) }

// checkWeight is the rule for one weight, shared with the Caddyfile parser.
func checkWeight(w int) error { return bounds.Int("weight", w, 1, maxWeight) }

// checkWeightCount is the rule that a policy's weights, when given for a
// handler's static upstreams, are one per upstream; dynamic upstreams
// are not known at provisioning. policy names the policy in the error.
func checkWeightCount(policy string, weights []int, h *reverseproxy.Handler) error {
	if len(weights) > 0 && h.DynamicUpstreamsRaw == nil && len(h.Upstreams) > 0 && len(weights) != len(h.Upstreams) {
		return fmt.Errorf("%s: %d weights given for %d upstreams; give one weight per upstream, in order", policy, len(weights), len(h.Upstreams))
	}
	return nil
}

// Cleanup releases the policy's references to shared upstream state.
func (s *LeastTimeSelection) Cleanup() error {
	unregisterPool(s)
	if s.prober != nil {
		s.prober.close()
	}
	if s.table != nil {
		s.table.Release()
	}
	if s.observer != nil {
		return s.observer.Cleanup()
	}
	return nil
}

// Select returns the upstream with the lowest expected cost among the
// candidates, or nil if none can be used.
func (s *LeastTimeSelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	if len(pool) == 0 {
		return nil
	}
	if s.RetryBudget != nil && !s.RetryBudget.admit(pool, r) {
		return nil
	}
	var (
		attempt Attempt
		tried   *Tried
	)
	if s.trackTried {
		attempt, tried = LoadTried(r)
	}
	v := s.viewFor(pool)
	now := monoclock.Latest()
	if s.observer == nil && rand.Uint32()%clockRefresh == 0 {
		now = monoclock.Now()
	}
	if s.prober != nil {
		s.prober.maybe(pool, v, now)
	}
	c := leastTimeCandidates{
		pool:  pool,
		view:  v,
		table: s.table,
		now:   now,
		base:  s.table.Baseline(),
		panic: s.panic.check(v, pool, now),
		ramp:  s.SlowStart,
		tried: tried,
		drain: v.drainMask(),
	}
	if c.drain != nil && c.drain.weighted {
		c.wdraw = rand.Float64()
	}
	if c.ramp != nil {
		c.admit = rand.Float64()
		if s.panic.threshold <= 0 {
			// the recount is also what notices hosts coming back
			// from Caddy-unhealthy; panic mode does it otherwise
			v.availability(pool, now)
		}
	}
	k := s.Choices.forPool(len(pool))
	i := c.choose(k)
	if i < 0 && c.admit > 0 {
		// Only ramping upstreams are left and this draw admitted none
		// of them: a ramp shapes shares, it must never refuse a request.
		c.admit = 0
		i = c.choose(k)
	}
	if i < 0 && c.tried != nil {
		// Every usable upstream was already tried by this request:
		// choose among them, as on a first attempt.
		c.tried = nil
		i = c.choose(k)
	}
	if i < 0 && !c.panic {
		// Nothing is available, yet the cached count said the pool was
		// not in panic. The shared clock only moves with round trips, and
		// none happens while nothing is chosen, so read the real clock
		// and decide again rather than trust a stale count.
		if c.panic = s.panic.check(v, pool, monoclock.Now()); c.panic {
			c.admit = 0
			i = choose.Cheapest(c)
		}
	}
	if i < 0 && c.drain != nil {
		i = c.withoutDrains(&s.panic, k)
	}
	if i < 0 {
		return nil
	}
	if s.trackTried {
		RecordTried(attempt, tried, pool[i])
	}
	return pool[i]
}

// SkipsEjected reports true: Select leaves out the upstreams its outlier
// detection ejected (unless the pool is in panic mode), so a handler that
// builds the pool (partition) must hand it every upstream, ejected ones
// included, for the panic threshold to count them.
func (*LeastTimeSelection) SkipsEjected() bool { return true }

// choose runs the configured algorithm: a scan, or the best of k draws.
func (c leastTimeCandidates) choose(k int) int {
	switch {
	case k == 0, k >= len(c.pool):
		return choose.Cheapest(c)
	case k == 2:
		i, ci, ok := c.bestOfTwo()
		if !ok {
			i, ci = choose.BestOfK(c, 2)
			return choose.SecondLook(c, 2, i, ci, c.base)
		}
		if ci.ClearlySlow(c.base) {
			// secondLook, with the inlined draw
			if j, cj, ok := c.bestOfTwo(); ok && cj.Beats(ci) {
				return j
			}
		}
		return i
	default:
		i, ci := choose.BestOfK(c, k)
		return choose.SecondLook(c, k, i, ci, c.base)
	}
}

func (s *LeastTimeSelection) viewFor(pool reverseproxy.UpstreamPool) *poolView {
	return s.views.get(pool, s.buildView)
}

// buildView builds the view of a pool the policy has not served yet.
func (s *LeastTimeSelection) buildView(pool reverseproxy.UpstreamPool) *poolView {
	v := newView(pool)
	v.members = make([]member, len(pool))
	for i, u := range pool {
		m := &v.members[i]
		m.stats, m.invWeight = s.table.Stats(u.Dial), 1
		if i < len(s.Weights) && s.Weights[i] > 0 {
			m.invWeight = 1 / float64(s.Weights[i])
		}
	}
	if s.SlowStart != nil {
		s.SlowStart.watch(v, s.logger)
	}
	return v
}

// clockRefresh: without an observing transport (outside reverse_proxy),
// one selection in this many reads the real clock, so the shared clock
// keeps moving even where no round trip is observed.
const clockRefresh = 32

// leastTimeCandidates presents a pool to the choosing algorithms.
type leastTimeCandidates struct {
	pool  reverseproxy.UpstreamPool
	view  *poolView
	table *hoststate.Table
	now   int64
	base  float64
	panic bool
	// ramp is the slow start, nil when off. A ramping member is usable
	// only when admit, drawn once per selection, is below its weight
	// factor, so its share follows the factor even when loads are
	// equal (a cost-weighted factor would starve it at light load).
	ramp  *SlowStart
	admit float64
	// tried is what this request already tried, nil on a first attempt:
	// a retry leaves those out while another upstream is usable.
	tried *Tried
	// drain is the operator's drains and reweights of the pool, nil when
	// none; wdraw is this selection's weight draw (see drainMask.admits).
	drain *drainMask
	wdraw float64
}

func (c leastTimeCandidates) Len() int { return len(c.pool) }

// Usable is Caddy's availability and not ejected, or in panic mode just
// "not full": panic ignores health, not max_requests. On a retry, an
// upstream the request already tried is not usable either.
func (c leastTimeCandidates) Usable(i int) bool {
	if c.panic {
		if c.pool[i].Full() {
			return false
		}
	} else if !c.pool[i].Available() || c.view.members[i].stats.Ejected(c.now) {
		return false
	}
	if c.tried != nil && c.tried.Has(c.pool[i].Dial) {
		return false
	}
	if c.drain != nil && !c.drain.admits(i, c.wdraw) {
		return false
	}
	if c.ramp == nil {
		return true
	}
	start := c.view.members[i].stats.RampStart(c.now)
	return !c.ramp.ramping(start, c.now) || c.admit < c.ramp.factor(start, c.now)
}

func (c leastTimeCandidates) Cost(i int) choose.Cost {
	m := &c.view.members[i]
	latency, busy := c.table.Judge(m.stats, c.now, c.base)
	if c.ramp != nil {
		// With slow start, ties between equal queues stay random: a
		// ramping member serves rarely and looks far into its work, so
		// it would win most of them and rise above its ramp
		// (TestSlowStartRampAfterEjection), and leaving it out of the
		// tie-break alone biases the rest of the choice either way.
		busy = 0
	}
	cost := choose.CostOf(c.pool[i].NumRequests(), m.invWeight, latency, busy)
	// Partial failures: the queue is charged for the share of recent
	// attempts that failed (hoststate's QueueCharge: its price, or the
	// share cap), so a host failing fast draws at most about its
	// success-weighted share instead of more than a healthy one. On the
	// queue rather than the latency, because the tie band would swallow a
	// latency factor below 1.5 (20% failures).
	cost.Queue *= c.table.QueueCharge(m.stats, c.now, m.invWeight, c.shareReference)
	return cost
}

// shareReference is the view's share reference, for QueueCharge.
func (c leastTimeCandidates) shareReference() float64 { return c.view.shareReference(c.now) }

// bestOfTwo is the common case of two random choices, written out so the
// hot path makes direct, inlinable calls: both draws come from one random
// word, and if both land on usable upstreams the cheaper wins (near-ties go
// to the first draw, which is random). It reports
// false when a draw hit an unusable upstream, for choose.BestOfK to retry. It also
// returns the cost of its choice.
func (c leastTimeCandidates) bestOfTwo() (int, choose.Cost, bool) {
	i, j := randpick.TwoDistinct(rand.Uint64(), len(c.pool))
	if !c.Usable(i) || !c.Usable(j) {
		return -1, choose.Cost{}, false
	}
	ci, cj := c.Cost(i), c.Cost(j)
	if cj.Beats(ci) {
		return j, cj, true
	}
	return i, ci, true // i is the cheaper or a tie; it was drawn at random
}

// poolStatuses implements poolStatusSource.
func (s *LeastTimeSelection) poolStatuses() []poolStatus {
	var pools []poolStatus
	last := s.views.last.Load()
	for _, v := range s.views.all() {
		pools = append(pools, s.statusOf(v, v == last))
	}
	return pools
}

// statusOf describes the pool of v; withBudget adds the retry budget, which
// is the policy's, to one of its pools' statuses.
func (s *LeastTimeSelection) statusOf(v *poolView, withBudget bool) poolStatus {
	now := monoclock.Now()
	base := s.table.Baseline()
	status := poolStatus{
		Policy:         s.policyName(),
		Available:      v.availableNow(),
		PanicThreshold: s.panic.percent(),
		Panic:          v.panic.on.Load(),
		PanicEntered:   v.panic.entered.Load(),
	}
	if s.SlowStart != nil {
		status.SlowStart = time.Duration(s.SlowStart.Window).String()
	}
	if b := s.RetryBudget; b != nil && withBudget {
		status.RetryBudget = &retryBudgetStatus{
			Percent: *b.Percent, MinConcurrent: *b.MinConcurrent, InFlight: b.inFlight.Load(), Refused: b.refused.Load(),
		}
	}
	for i, u := range v.ups {
		st := v.members[i].stats
		est := s.table.Expected(st, now, base) / 1e6
		m := poolMember{
			Dial:       u.Dial,
			Weight:     1 / v.members[i].invWeight,
			Healthy:    u.Healthy(),
			Available:  u.Available() && !st.Ejected(now),
			EstimateMs: &est,
		}
		if s.SlowStart != nil {
			m.SlowStartPercent = s.SlowStart.percent(st, now)
		}
		status.Upstreams = append(status.Upstreams, m)
	}
	return status
}

// Interface guards
var (
	_ reverseproxy.Selector = (*LeastTimeSelection)(nil)
	_ caddy.Provisioner     = (*LeastTimeSelection)(nil)
	_ caddy.Validator       = (*LeastTimeSelection)(nil)
	_ caddy.CleanerUpper    = (*LeastTimeSelection)(nil)
	_ poolStatusSource      = (*LeastTimeSelection)(nil)
	_ leastTimer            = (*LeastTimeSelection)(nil)
)
