package lbpolicy

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/pickrate"
)

func init() {
	caddy.RegisterModule(new(PanicSelection))
}

// PanicSelection gives any selection policy panic mode. While at least
// `threshold` percent of the upstreams are available, it simply delegates to
// the wrapped policy. Below that, too much of the pool looks down for the
// health checks to be believed (a busy day makes every probe time out;
// ejecting the whole pool would turn slowness into an outage), so the
// wrapped policy chooses among all upstreams that are not full, as if they
// were healthy. Entering and leaving panic mode is logged once each.
type PanicSelection struct {
	// Percentage of upstreams that must be available for health to be
	// respected. 0 disables panic mode. Default: 50.
	Threshold *float64 `json:"threshold,omitempty"`

	// The wrapped selection policy. Default: random (Caddy's default).
	PolicyRaw json.RawMessage `json:"selection_policy,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`

	// Ejection of outliers, judged on live traffic, for the wrapped
	// policy; off when absent. Ejected upstreams are hidden from the wrapped policy (unless
	// the pool is in panic mode) and count as unavailable for the
	// threshold. Not allowed around least_time (or ewma), which takes its
	// own outlier block.
	Outlier *Outlier `json:"outlier,omitempty"`

	// How the ORCA load reports backends send in the
	// Endpoint-Load-Metrics response header are taken in, when the
	// panic policy observes the traffic itself: only with an outlier
	// block. They are then read, and the header removed, also when this
	// is absent. Around least_time (or ewma), set it on the wrapped
	// policy instead. The wrapped stock policy does not use the reports.
	LoadReports *LoadReports `json:"load_reports,omitempty"`

	// Slow start for the wrapped policy: an upstream that joins a pool
	// already serving, comes back healthy after Caddy's active or passive
	// health checks marked it unhealthy, or comes back from an outlier
	// ejection gets a share that ramps up over the window instead of its
	// full share at once. Off when absent. While the pool is in panic
	// mode no ramp is applied. Not allowed around least_time (or ewma),
	// which takes its own slow_start.
	SlowStart *SlowStart `json:"slow_start,omitempty"`

	inner     reverseproxy.Selector
	innerName string
	views     views
	panic     panicMode
	table     *hoststate.Table // nil without outlier ejection and slow start
	logger    *zap.Logger
	observer  *observingTransport
	// trackTried: the handler can retry, and the wrapped policy does not
	// avoid the upstreams a request tried by itself, so the wrapper
	// does (see tried.go)
	trackTried bool
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *PanicSelection) UnmarshalJSON(b []byte) error {
	type plain PanicSelection
	return jsonfield.Decode(b, (*plain)(x))
}

// CaddyModule returns the Caddy module information.
func (*PanicSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.panic",
		New: func() caddy.Module { return new(PanicSelection) },
	}
}

// Provision loads the wrapped policy.
func (p *PanicSelection) Provision(ctx caddy.Context) error {
	p.inner, p.innerName = reverseproxy.RandomSelection{}, "random"
	if p.PolicyRaw != nil {
		mod, err := ctx.LoadModule(p, "PolicyRaw")
		if err != nil {
			return fmt.Errorf("loading selection_policy: %v", err)
		}
		sel, ok := mod.(reverseproxy.Selector)
		if !ok {
			return fmt.Errorf("wrapped module %T is not a selection policy", mod)
		}
		p.inner = sel
		p.innerName = string(mod.(caddy.Module).CaddyModule().ID.Name())
	}
	_, leastTime := p.inner.(leastTimer)
	if _, avoids := p.inner.(triedAvoider); !leastTime && !avoids {
		// least_time and consistent_hash record and avoid what a request
		// tried themselves, over the pool they are handed: filtered
		// copies would give them a view (a ring) per subset
		p.trackTried = TracksTried(ctx)
	}
	if err := p.misplaced(true); err != nil {
		return err
	}
	emitter := events.New(ctx)
	p.logger = ctx.Logger()
	p.panic = newPanicMode(p.Threshold, "panic("+p.innerName+")", ctx.Logger(), emitter)
	if p.SlowStart != nil {
		p.SlowStart.provision()
	}
	if p.Outlier != nil {
		p.Outlier.provision(ctx.Logger(), emitter)
		p.LoadReports = loadReportsOrDefault(p.LoadReports)
	}
	if p.observes() {
		// Validated before install starts the sweep loop (see least_time).
		if err := p.Validate(); err != nil {
			return err
		}
		// Slow start needs the table too, with outlier ejection or not:
		// it is where an upstream's ramp start and the end of its
		// ejection are kept, and the observed traffic is what tells an
		// upstream new to a serving pool (it has served nothing) from
		// one that served before a reload.
		p.table = hoststate.NewTable(hoststate.Config{})
		h, observer, err := observeTraffic(ctx, p.table, p.Outlier, p.LoadReports,
			"panic policy is not inside a reverse_proxy handler; outlier ejection and slow start have no traffic to observe")
		if err != nil {
			return err
		}
		if h != nil {
			p.observer = observer
			p.views.rel = newReleaser(p.table, h, p.linger())
		}
	}
	if p.views.rel == nil {
		p.views.rel = newReleaser(p.table, parentProxy(ctx), p.linger())
	}
	if err := registerMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	p.views.startReleasing(ctx.Done(), ctx.Logger())
	registerPool(p)
	return nil
}

// linger is how long the policy keeps the view of a pool no longer
// offered, and the state of its addresses (see lingerFor).
func (p *PanicSelection) linger() time.Duration {
	return lingerOf(p.Outlier, p.SlowStart)
}

// misplaced is the rule for what the panic policy observes itself:
// outlier ejection and load_reports belong inside a least_time (or ewma,
// as the errors name it if so configured) policy, which observes the
// traffic itself (and resets its estimates on ejection), not around it,
// so that one pool has one outlier detector; and load_reports
// needs an outlier block, without which panic does not observe the
// traffic and reads no reports. complete says the whole configuration is
// there (the Caddyfile checks the first two rules after each option, the
// last once the block is read).
func (p *PanicSelection) misplaced(complete bool) error {
	lt, leastTime := p.inner.(leastTimer)
	switch {
	case leastTime && p.Outlier != nil:
		return fmt.Errorf("panic: configure outlier ejection inside the %s policy, not around it", lt.leastTime().policyName())
	case p.observes() && observesItself(p.inner):
		return errors.New("panic: the wrapped consistent_hash policy has its own outlier or slow_start; configure them in one of the two, not both")
	case leastTime && p.SlowStart != nil:
		return fmt.Errorf("panic: configure slow_start inside the %s policy, not around it", lt.leastTime().policyName())
	case leastTime && p.LoadReports != nil:
		return fmt.Errorf("panic: configure load_reports inside the %s policy, not around it", lt.leastTime().policyName())
	case p.LoadReports != nil && p.LoadReports.Probe != nil:
		return errors.New("panic: load_reports: probe is an option of least_time's load_reports; the panic policy does not probe")
	case complete && p.LoadReports != nil && p.Outlier == nil:
		return errors.New("panic: load_reports needs an outlier block: without one the panic policy does not observe the traffic, and reads no reports")
	}
	return nil
}

// observes reports whether the panic policy observes the traffic itself:
// it has outlier ejection or slow start.
func (p *PanicSelection) observes() bool { return p.Outlier != nil || p.SlowStart != nil }

// observesItself reports whether sel, a wrapped policy other than
// least_time, observes its handler's traffic itself (a handler's traffic
// is observed by one module, with one table of upstream state).
func observesItself(sel reverseproxy.Selector) bool {
	ch, ok := sel.(*ConsistentHashSelection)
	return ok && ch.observes()
}

// Validate checks the threshold, the load reports, slow start and the
// outlier ejection.
func (p *PanicSelection) Validate() error {
	if p.Threshold != nil {
		if err := bounds.Percent("threshold", *p.Threshold); err != nil {
			return fmt.Errorf("panic: %v", err)
		}
	}
	if p.LoadReports != nil {
		if err := p.LoadReports.validate(); err != nil {
			return fmt.Errorf("panic: %v", err)
		}
	}
	if p.SlowStart != nil {
		if err := p.SlowStart.validate(); err != nil {
			return fmt.Errorf("panic: %v", err)
		}
	}
	if p.Outlier != nil {
		return p.Outlier.validate()
	}
	return nil
}

// Cleanup unregisters the pool from the admin API and releases shared
// upstream state.
func (p *PanicSelection) Cleanup() error {
	unregisterPool(p)
	if p.table != nil {
		p.table.Release()
	}
	if p.observer != nil {
		return p.observer.Cleanup()
	}
	return nil
}

// Select delegates to the wrapped policy, over health-blind twins of the
// upstreams when the pool is in panic mode. On a retry the wrapped policy
// is handed those upstreams the request has not tried yet.
func (p *PanicSelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	if len(pool) == 0 {
		return nil
	}
	if !p.trackTried {
		return p.choose(pool, r, w, nil)
	}
	attempt, tried := LoadTried(r)
	picked := p.choose(pool, r, w, tried)
	RecordTried(attempt, tried, picked)
	return picked
}

// SkipsEjected reports true: with an outlier block, Select hides the
// ejected upstreams from the wrapped policy itself (unless the pool is in
// panic mode), so a handler that builds the pool (partition) must hand it
// every upstream for the panic threshold to count them.
func (*PanicSelection) SkipsEjected() bool { return true }

// choose is Select, given what the request already tried (nil on a
// first attempt).
func (p *PanicSelection) choose(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter, tried *Tried) *reverseproxy.Upstream {
	v := p.viewFor(pool)
	now := monoclock.Now()
	if !p.panic.check(v, pool, now) {
		if v.keepUnejected {
			// fresh even when panic mode is off; the count is also what
			// notices upstreams back from Caddy-unhealthy, for slow start
			v.availability(pool, now)
			if kept := v.unejected.Load(); kept != nil {
				if !v.matches(pool) {
					// the view was found by dial addresses: these are
					// fresh Upstream values, filter them instead
					return p.selectDrained(v, v.withoutEjected(pool, now), r, w, tried, now)
				}
				return p.selectDrained(v, *kept, r, w, tried, now)
			}
		}
		return p.selectDrained(v, pool, r, w, tried, now)
	}
	// In panic mode no ramp is applied: too few upstreams look
	// available, and holding a returning one back would push its share
	// onto a pool already short of capacity.
	picked := p.selectDrained(v, v.shadows, r, w, tried, 0)
	if picked == nil {
		return nil
	}
	if i, ok := v.shadowOf[picked]; ok {
		return pool[i]
	}
	return picked
}

// selectUntried has the wrapped policy choose among the members of ups
// the request has not tried, and among all of them when it chooses none
// of those (none is left, or none is usable). With slow start and a
// non-zero now (0 in panic mode), ramps apply (see ramped).
func (p *PanicSelection) selectUntried(ups []*reverseproxy.Upstream, r *http.Request, w http.ResponseWriter, tried *Tried, now int64) *reverseproxy.Upstream {
	if tried != nil {
		if rest := tried.without(ups); rest != nil {
			if picked := p.ramped(rest, r, w, now); picked != nil {
				return picked
			}
		}
	}
	return p.ramped(ups, r, w, now)
}

// maxRampAsks bounds how many times one selection asks the wrapped policy
// again after passing over a ramping upstream: each ask leaves out one
// more upstream, and a pool with several ramping at once must still be
// served in a few steps.
const maxRampAsks = 4

// ramped has the wrapped policy choose among ups and applies slow start
// to its choice: a ramping upstream is kept with probability its ramp
// factor, else the wrapped policy is asked again over ups without it.
//
// The wrapped policy is any stock policy, which knows nothing of weights
// that change over time; filtering its choice after the fact works with
// every one of them (see passOver for how much a ramping upstream then
// gets). Its keys, connection counts or cookies stay the wrapped policy's
// business: asking again over the rest is how that policy would choose
// were the upstream unavailable. A ramp shapes shares and never refuses a
// request: when the asks run out, or only passed-over upstreams are
// usable, the first choice stands.
func (p *PanicSelection) ramped(ups []*reverseproxy.Upstream, r *http.Request, w http.ResponseWriter, now int64) *reverseproxy.Upstream {
	first := p.inner.Select(ups, r, w)
	if first == nil || p.SlowStart == nil || now == 0 {
		return first
	}
	firstStats := p.statsOf(first)
	if !p.passOver(first, firstStats, ups, now) {
		return counted(first, firstStats, now)
	}
	rest := make([]*reverseproxy.Upstream, 0, len(ups)-1)
	for _, u := range ups {
		if u != first {
			rest = append(rest, u)
		}
	}
	for range maxRampAsks {
		if len(rest) == 0 {
			break
		}
		picked := p.inner.Select(rest, r, w)
		if picked == nil {
			break
		}
		if st := p.statsOf(picked); !p.passOver(picked, st, ups, now) {
			return counted(picked, st, now)
		}
		if i := slices.Index(rest, picked); i >= 0 {
			rest = slices.Delete(rest, i, i+1)
		}
	}
	return counted(first, firstStats, now)
}

// statsOf returns u's state in the policy's table, nil if it has none.
func (p *PanicSelection) statsOf(u *reverseproxy.Upstream) *hoststate.Stats {
	if st, ok := p.table.Lookup(u.Dial); ok {
		return st
	}
	return nil
}

// counted counts the pick of u, whose state is stats (nil: none), for
// the ramp cap and returns it.
func counted(u *reverseproxy.Upstream, stats *hoststate.Stats, now int64) *reverseproxy.Upstream {
	if stats != nil {
		stats.CountPick(now)
	}
	return u
}

// passOver decides whether slow start passes over u (whose state is
// stats, nil when it has none), a choice of the wrapped policy among ups,
// at now. While u ramps, with factor f:
//   - a draw passes over it with probability 1 − f, which is all a policy
//     blind to load needs (random: f × its share);
//   - and it is held to f times the recent picks of the others in ups,
//     on average (plus one, so that a ramp at a trickle of traffic is not
//     starved), because the draw alone does not hold a policy that
//     seeks the least loaded: a ramping upstream holds fewer requests,
//     least_conn offers it at nearly every choice, and the draw then
//     lets through f of all picks, not f of its share. round_robin,
//     whose turn comes round sooner after a pass, is held to f too.
func (p *PanicSelection) passOver(u *reverseproxy.Upstream, stats *hoststate.Stats, ups []*reverseproxy.Upstream, now int64) bool {
	if stats == nil {
		return false
	}
	start := stats.RampStart(now)
	if !p.SlowStart.ramping(start, now) {
		return false
	}
	f := p.SlowStart.factor(start, now)
	if rand.Float64() >= f {
		return true
	}
	others, n := 0.0, 0
	for _, o := range ups {
		if o == u {
			continue
		}
		if s, ok := p.table.Lookup(o.Dial); ok {
			others += s.RecentPicks(now)
			n++
		}
	}
	return n > 0 && pickrate.HeldTo(f, stats.RecentPicks(now), others/float64(n))
}

// viewFor returns the view of pool, building the twins the wrapped policy
// sees in panic mode: same dial address, same Caddy host record (so
// requests in flight are counted as usual), same max_requests, but no health
// state, so Available() reports only whether they are full.
func (p *PanicSelection) viewFor(pool reverseproxy.UpstreamPool) *poolView {
	return p.views.get(pool, p.buildView)
}

// buildView builds the view of a pool the policy has not served yet.
func (p *PanicSelection) buildView(pool reverseproxy.UpstreamPool) *poolView {
	v := newView(pool)
	v.shadows = make([]*reverseproxy.Upstream, len(pool))
	v.shadowOf = make(map[*reverseproxy.Upstream]int, len(pool))
	for i, u := range pool {
		twin := &reverseproxy.Upstream{Host: u.Host, Dial: u.Dial, MaxRequests: u.MaxRequests}
		v.shadows[i] = twin
		v.shadowOf[twin] = i
	}
	if p.table != nil {
		v.members = make([]member, len(pool))
		for i, u := range pool {
			v.members[i].stats, v.members[i].invWeight = p.table.Stats(u.Dial), 1
		}
		// ejection state is per address: an upstream another lbx
		// policy's detector ejected is hidden too, as least_time does
		v.keepUnejected = true
		if p.SlowStart != nil {
			p.SlowStart.watch(v, p.logger)
		}
	}
	return v
}

// poolStatuses implements poolStatusSource.
func (p *PanicSelection) poolStatuses() []poolStatus {
	var pools []poolStatus
	for _, v := range p.views.all() {
		pools = append(pools, p.statusOf(v))
	}
	return pools
}

// statusOf describes the pool of v.
func (p *PanicSelection) statusOf(v *poolView) poolStatus {
	status := poolStatus{
		Policy:         "panic(" + p.innerName + ")",
		Available:      v.availableNow(),
		PanicThreshold: p.panic.percent(),
		Panic:          v.panic.on.Load(),
		PanicEntered:   v.panic.entered.Load(),
	}
	now := monoclock.Now()
	if p.SlowStart != nil {
		status.SlowStart = time.Duration(p.SlowStart.Window).String()
	}
	for i, u := range v.ups {
		avail := u.Available() && (v.members == nil || !v.members[i].stats.Ejected(now))
		m := poolMember{Dial: u.Dial, Weight: 1, Healthy: u.Healthy(), Available: avail}
		if p.SlowStart != nil {
			m.SlowStartPercent = p.SlowStart.percent(v.members[i].stats, now)
		}
		status.Upstreams = append(status.Upstreams, m)
	}
	return status
}

// Interface guards
var (
	_ reverseproxy.Selector = (*PanicSelection)(nil)
	_ caddy.Provisioner     = (*PanicSelection)(nil)
	_ caddy.Validator       = (*PanicSelection)(nil)
	_ caddy.CleanerUpper    = (*PanicSelection)(nil)
	_ poolStatusSource      = (*PanicSelection)(nil)
)
