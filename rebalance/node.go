package rebalance

import (
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/dustin/go-humanize"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// nodes holds the shedding state of this process, keyed by the cluster
// member it publishes through (cluster.App.Key): a config reload starts
// the new config (which finds the node here) before stopping the old one,
// so the load window and the shedding state survive it. Its Destruct
// withdraws the load tag.
var nodes = caddy.NewUsagePool()

// settings are what one config asks of the node. The node runs with the
// settings of the most recently started config that still runs.
type settings struct {
	owner    *App
	cluster  *cluster.App
	params   shed.Params
	interval time.Duration
	history  time.Duration
	boundary time.Duration // boundary_timeout; 0: never forced
	// idleClose is idle_close_after (for the admin view: the tracker
	// gets it from the config's processSource).
	idleClose time.Duration
	metric    string
	source    loadSource
	logger    *zap.Logger
	events    emitter
}

// loadSource measures this node's load and sheds its connections.
type loadSource interface {
	// Sweep runs once per interval, before Sample: it forgets closed
	// upgraded connections, counts shed connections open recountAfter
	// after the shed toward the load again, and closes those still
	// without a response boundary after boundaryTimeout (0: never).
	Sweep(recountAfter, boundaryTimeout time.Duration) conntrack.SweepResult
	// Sample returns the load in the metric's unit and the connections
	// held (those shed and still closing excluded; overdue ones count).
	Sample(metric string) (load float64, held int)
	// Shed sheds up to n connections.
	Shed(n int) ShedResult
}

// seenReport is what this node last saw in a member's load tag, and when
// it changed.
type seenReport struct {
	raw string
	at  time.Time // zero until the tag is seen to change
}

// node is this process's shedding state and its decision loop.
type node struct {
	key    string // the cluster member's key
	name   string // the member's node name
	logger *zap.Logger

	mu     sync.Mutex
	owners []*settings // oldest first; the last one drives
	window *shed.Window
	// recentSheds holds the connections shed at each of the last
	// `history` steps (WithShedInFlight).
	recentSheds *shed.Window
	seq         uint64
	// published is the load in the last load tag published, and
	// sincePublished the steps since, that step included (0: none yet;
	// see LoadTagDue).
	published      float64
	sincePublished int
	shedding       bool           // the high rule's hysteresis state
	lift           shed.LiftState // the lift rule's state
	phaseAvg       phase          // the shedding phase's average (shed.Decision.PhaseAverage)
	seen           map[string]seenReport
	members        []shed.Report    // as of the last decision
	average        shed.AverageView // the gossip average as of the last decision
	last           shed.Decision
	lastAt         time.Time
	local          float64
	current        float64
	held           int
	shed           ShedResult // totals since the node started
	forced         uint64     // shed connections closed at boundary_timeout, since the node started
	// lastForced is the number forced in the last interval.
	lastForced int
	// shedDecisions counts the intervals that shed since the node started.
	shedDecisions uint64
	// averageRefused counts the decisions that did not use the gossip
	// average because the load tags refuse it (averageView.Refused);
	// refusedLogged is whether the last log line about it said so, and
	// refusalLoggedAt when it was written (refusalLogEvery).
	averageRefused  uint64
	averageClamped  uint64 // decisions that clamped it (shed.AverageView.Clamped)
	refusedLogged   bool
	refusalLoggedAt time.Time

	// alive are the other members alive at the last step, and joins
	// those that became alive after the node's first step
	// (Params.JoinSettle).
	alive map[string]bool
	joins shed.JoinBurst

	// steps is the node's coarse clock: when its last decision step
	// took in the members' reports, as a monoclock reading. It advances
	// once per interval; policies that cache what they read from the
	// node compare it with their cache's age instead of reading the
	// clock per request.
	steps atomic.Int64

	// avg is the node's part in the gossip averaging; its exchanges run
	// in their own loop (node.loop), AverageTicks per interval.
	avg *averager

	stop chan struct{}
	done sync.WaitGroup
}

// newNode creates the shedding state for s and starts its loop.
func newNode(key, name string, s *settings) *node {
	n := &node{
		key:         key,
		name:        name,
		logger:      s.logger.With(zap.String("node", name)),
		seen:        make(map[string]seenReport),
		window:      shed.NewWindow(windowSize(s.history, s.interval)),
		recentSheds: shed.NewWindow(windowSize(s.history, s.interval)),
		stop:        make(chan struct{}),
		owners:      []*settings{s},
	}
	n.avg = newAverager(n.logger)
	n.done.Add(2)
	go n.loop(func(s *settings) time.Duration { return s.interval }, n.safeStep)
	go n.loop(func(s *settings) time.Duration { return s.interval / shed.AverageTicks }, n.safeTick)
	return n
}

// windowSize is the number of samples in history at one per interval.
func windowSize(history, interval time.Duration) int {
	if interval <= 0 {
		return 1
	}
	return max(1, int(history/interval))
}

// Destruct stops the loop and withdraws the load tag: the last config
// using the node has stopped. A cluster member that leaves with it takes
// the tag along anyway.
func (n *node) Destruct() error {
	close(n.stop)
	n.done.Wait()
	n.avg.close()
	n.mu.Lock()
	last := n.owners
	n.mu.Unlock()
	for _, s := range last {
		_ = s.cluster.Publish(shed.LoadTag, "")
	}
	return nil
}

// attach makes s the settings that drive the node (a newer config).
func (n *node) attach(s *settings) {
	n.mu.Lock()
	defer n.mu.Unlock()
	prev := n.owners[len(n.owners)-1]
	n.owners = append(n.owners, s)
	n.follow(prev, s)
}

// follow adapts the node's state to s, the settings that drive it after
// prev: the windows take s's size, keeping their most recent samples,
// but when the metric changed (a reload that changed metric or cpu) the
// load's samples and the decision's state, in the old metric's unit, are
// dropped, and the next step publishes a tag in the new metric. The
// caller holds n.mu.
func (n *node) follow(prev, s *settings) {
	size := windowSize(s.history, s.interval)
	n.recentSheds.Resize(size)
	if prev.metric == s.metric {
		n.window.Resize(size)
		return
	}
	n.window = shed.NewWindow(size)
	n.shedding, n.lift, n.phaseAvg = false, shed.LiftState{}, phase{}
	n.sincePublished = 0
}

// detach removes the settings of a config that stopped; it returns the
// ones it removed.
func (n *node) detach(owner *App) {
	n.mu.Lock()
	defer n.mu.Unlock()
	gone := slices.IndexFunc(n.owners, func(s *settings) bool { return s.owner == owner })
	if gone < 0 {
		return
	}
	if len(n.owners) == 1 {
		return // Destruct withdraws the tag through it
	}
	prev := n.owners[len(n.owners)-1]
	n.owners = slices.Delete(n.owners, gone, gone+1)
	n.follow(prev, n.owners[len(n.owners)-1])
}

// driver returns the driving settings, or nil.
func (n *node) driver() *settings {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.owners) == 0 {
		return nil
	}
	return n.owners[len(n.owners)-1]
}

// loop calls do with the driving settings every period of them until the
// node stops (every second while no config drives it): the decision
// loop, every interval, and the gossip averaging's, AverageTicks times
// per interval.
func (n *node) loop(period func(*settings) time.Duration, do func(*settings)) {
	defer n.done.Done()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-n.stop:
			return
		case <-timer.C:
		}
		s := n.driver()
		if s == nil {
			timer.Reset(time.Second)
			continue
		}
		do(s)
		timer.Reset(period(s))
	}
}

// safeTick starts the next exchange of the gossip averaging, logging a
// panic instead of crashing Caddy.
func (n *node) safeTick(*settings) {
	defer n.logPanic("gossip averaging tick panicked")
	n.avg.tick(time.Now())
}

// noMembers records a step that could not read or publish through the
// cluster member (not started yet, or shut down over a name conflict):
// the node decides nothing and says why.
func (n *node) noMembers(s *settings, err error, now time.Time) {
	n.mu.Lock()
	changed := n.last.Reason != err.Error()
	n.last, n.lastAt = shed.Decision{Reason: err.Error()}, now
	n.members = nil
	n.shedding, n.lift, n.phaseAvg = false, shed.LiftState{}, phase{}
	n.mu.Unlock()
	lvl := zapcore.WarnLevel
	if errors.Is(err, cluster.ErrNotRunning) {
		lvl = zapcore.DebugLevel // it starts after this app, or has stopped
	}
	if c := s.logger.Check(lvl, "rebalance is not deciding: the cluster member is not available"); changed && c != nil {
		c.Write(zap.Error(err))
	}
}

// safeStep runs one step, logging a panic instead of crashing Caddy.
func (n *node) safeStep(s *settings) {
	defer n.logPanic("rebalance step panicked")
	n.step(s, time.Now())
}

// logPanic, deferred, logs a panic of its caller with msg instead of
// crashing Caddy.
func (n *node) logPanic(msg string) {
	if r := recover(); r != nil {
		n.logger.Error(msg, zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
	}
}

// step sweeps the connections, samples the load, gossips it, reads the
// others' reports and the gossip average, decides and sheds. Nothing in
// it waits on the network: the load tag is published in the background,
// and the averaging's messages are single datagrams.
func (n *node) step(s *settings, now time.Time) {
	sw := s.source.Sweep(s.history, s.boundary)
	load, held := s.source.Sample(s.metric)

	n.mu.Lock()
	local := n.window.Add(shed.WithShedInFlight(s.metric, load, held, n.recentSheds.Fading()))
	var tag string
	if shed.LoadTagDue(n.sincePublished, n.published, local, s.interval, s.params.Freshness) {
		n.seq++
		tag = shed.FormatLoadReport(s.metric, local, n.seq)
	}
	shedding, lift, phaseAvg := n.shedding, n.lift, n.phaseAvg
	n.mu.Unlock()

	if tag != "" {
		if err := s.cluster.Publish(shed.LoadTag, tag); err != nil {
			n.noMembers(s, err, now)
			return
		}
		n.mu.Lock()
		n.published, n.sincePublished = local, 0
		n.mu.Unlock()
	}

	members, err := s.cluster.Members()
	if err != nil {
		n.noMembers(s, err, now)
		return
	}
	if err := n.avg.prepare(s, n.name, now); err != nil {
		n.logger.Debug("gossip averaging not running", zap.Error(err))
	}
	n.mu.Lock()
	n.sincePublished++
	reports := make([]shed.Report, 0, len(members))
	present := make(map[string]bool, len(members))
	alive := make(map[string]bool, len(members))
	var peers []string // alive members averaging in this node's metric
	for _, m := range members {
		present[m.Name] = true
		r := shed.Report{Name: m.Name, Status: m.Status}
		raw := m.Tags[shed.LoadTag]
		prev, ok := n.seen[m.Name]
		switch {
		case !ok:
			// First sight: its age is unknown, so it does not count
			// until it changes.
			n.seen[m.Name] = seenReport{raw: raw}
		case raw != prev.raw:
			n.seen[m.Name] = seenReport{raw: raw, at: now}
		}
		r.At = n.seen[m.Name].at
		if m.Self {
			r.At = now
		}
		// An invalid tag gives load NaN: Decide does not count it.
		r.Metric, r.Load, _ = shed.ParseLoadTag(raw)
		reports = append(reports, r)
		if !m.Self && m.Status == cluster.StatusAlive && r.Metric == s.metric { // "" when the tag holds no valid load
			peers = append(peers, m.Name)
		}
		if !m.Self && m.Status == cluster.StatusAlive {
			alive[m.Name] = true
			if n.alive != nil && !n.alive[m.Name] {
				n.joins = n.joins.Joined(now, s.params)
			}
		}
	}
	n.alive = alive
	joins := n.joins
	for name := range n.seen {
		if !present[name] {
			delete(n.seen, name)
		}
	}
	n.mu.Unlock()
	slices.Sort(peers)

	in := shed.Input{
		Self: n.name, Local: local, Current: load, Held: held,
		Members: reports, Shedding: shedding, Lift: lift, PhaseAverage: phaseAvg.avg, PhaseCounted: phaseAvg.counted, Joins: joins, Now: now,
	}
	avg := n.avg.step(n.name, peers, local, s.params, shed.TagRangeOf(s.params, in), now)
	view := shed.Summarize(s.params, in)
	if avg.Used {
		view = avg.DecisionView(in, view)
	}
	d := shed.DecideView(s.params, in, view)
	var res ShedResult
	if d.Shed > 0 {
		res = s.source.Shed(d.Shed)
	}

	n.mu.Lock()
	n.shedding, n.lift, n.phaseAvg = d.Shedding, d.Lift, phase{d.PhaseAverage, d.PhaseCounted}
	n.members = reports
	n.average = avg
	if avg.Refused {
		n.averageRefused++
	}
	if avg.Clamped {
		n.averageClamped++
	}
	logRefusal := avg.Refused != n.refusedLogged && now.Sub(n.refusalLoggedAt) >= refusalLogEvery
	if logRefusal {
		n.refusedLogged, n.refusalLoggedAt = avg.Refused, now
	}
	n.last, n.lastAt = d, now
	n.steps.Store(monoclock.At(now))
	n.local, n.current, n.held = local, load, held
	n.recentSheds.Add(float64(res.Total()))
	n.shed.Idle += res.Idle
	n.shed.Active += res.Active
	n.shed.Hijacked += res.Hijacked
	if res.Total() > 0 {
		n.shedDecisions++
	}
	n.forced += uint64(sw.Forced)
	n.lastForced = sw.Forced
	n.mu.Unlock()

	if logRefusal {
		n.logRefusal(s, avg)
	}
	n.logDecision(s, d, shedding || lift.Lifting, local, res, sw, avg)
	if res.Total() > 0 || sw.Forced > 0 {
		s.events.emitShed(n.name, s.metric, local, d, res, sw.Forced)
	}
}

// phase is a node's Decision.PhaseAverage and PhaseCounted, kept for
// its next decision.
type phase struct {
	avg     float64
	counted int
}

// refusalLogEvery is the least time between two log lines about the load
// tags refusing the gossip average: one line when it starts and one when
// it ends, unless it flaps faster.
const refusalLogEvery = 10 * time.Second

// logRefusal logs that the load tags started (a warning: a member may be
// sending false estimates) or stopped refusing the gossip average.
func (n *node) logRefusal(s *settings, avg shed.AverageView) {
	if !avg.Refused {
		n.logger.Info("the gossip average agrees with the load tags again", zap.String("metric", s.metric),
			zap.String("average_from", avg.Source()))
		return
	}
	n.logger.Warn("the gossip average is not used: it disagrees with the members' load tags, which decide instead (a member may be sending false averaging estimates)",
		zap.String("metric", s.metric),
		zap.Float64("gossip_average", avg.Average),
		zap.Float64("tags_average", avg.Tags.Mean),
		zap.Float64("tags_low", avg.Tags.Min),
		zap.Float64("tags_high", avg.Tags.Max),
		zap.String("unused_because", avg.Why),
		zap.Uint64("messages_refused", n.avg.refused.Load()))
}

// logDecision writes one line per decision that sheds, changes state or
// forces shed connections closed, and a debug line otherwise.
func (n *node) logDecision(s *settings, d shed.Decision, was bool, local float64, res ShedResult, sw conntrack.SweepResult, avg shed.AverageView) {
	lvl := zapcore.DebugLevel
	msg := "rebalance decision"
	switch {
	case res.Total() > 0:
		lvl, msg = zapcore.InfoLevel, "shedding connections"
	case sw.Forced > 0:
		lvl, msg = zapcore.InfoLevel, "closed shed connections past boundary_timeout"
	case d.Active() && !was:
		lvl, msg = zapcore.InfoLevel, "started shedding"
	case !d.Active() && was:
		lvl, msg = zapcore.InfoLevel, "stopped shedding"
	}
	c := n.logger.Check(lvl, msg)
	if c == nil {
		return
	}
	c.Write(
		zap.String("metric", s.metric),
		zap.String("local", formatLoad(s.metric, local)),
		zap.String("average", formatLoad(s.metric, d.Average)),
		zap.String("average_from", avg.Source()),
		zap.String("balance", fmt.Sprintf("%.2fx", d.Balance)),
		zap.Int("members_counted", d.Counted),
		zap.String("lowest", humanize.FormatFloat("#,###.#", d.Lowest)),
		zap.String("lowest_member", d.LowestName),
		zap.Bool("lifting", d.Lift.Lifting),
		zap.Int("shed", res.Total()),
		zap.Int("shed_idle", res.Idle),
		zap.Int("shed_active", res.Active),
		zap.Int("shed_hijacked", res.Hijacked),
		zap.Int("forced", sw.Forced),
		zap.Int("overdue", sw.Overdue),
		zap.String("reason", d.Reason),
	)
}

// formatLoad writes a load for people in its metric's unit: bytes per
// second in SI units for throughput ("12 MB/s", as network rates are
// quoted), otherwise the number ("1,234" connections, "45.1" percent of a
// core for cpu, of the node's CPUs for node_cpu).
func formatLoad(metric string, v float64) string {
	if metric == metricThroughput {
		if !(v > 0) {
			return "0 B/s"
		}
		// Far beyond any link; keeps the conversion defined.
		return humanize.Bytes(uint64(min(v, 1e18))) + "/s"
	}
	return humanize.FormatFloat("#,###.#", v)
}
