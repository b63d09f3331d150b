// Package fleetsim simulates the rebalance app's decision on a fleet of
// hundreds to thousands of nodes, one decision interval at a time: every
// node samples its connections into a shed.Window, learns the
// cluster average and lowest member through one of three views (its own
// gossipavg node, serf tags that arrive late, or the exact truth), decides
// with shed.DecideView and sheds; every shed client reconnects through
// an outer balancer (random or least-connections). It is deterministic for
// a seed, runs no goroutines, and measures how many intervals the fleet
// takes to converge after a scale-out, a scale-in or a rolling restart,
// how much it sheds against a perfect rebalancer behind the same balancer
// (shedsim.IdealShedsFor), and whether nodes oscillate.
package fleetsim

import (
	"fmt"
	"math"
	"time"

	"github.com/caddy-lbx/lbx/integration/shedsim"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// Interval is the simulated decision interval (the app's default).
const Interval = time.Second

// ViewKind is how a node learns the cluster average and lowest member.
type ViewKind int

const (
	// Flow: every node runs a gossipavg.Node over [smoothed load, anchor
	// indicator] with the rebalance app's settings (AverageConfig,
	// AverageTicks exchanges per interval) and decides as the app does:
	// from its own estimate when the app's rule finds it usable
	// (shed.AveragedView), else from the tags, as Tags sees them.
	Flow ViewKind = iota
	// Tags: every node sees every other node's last published smoothed
	// load, late by a lag drawn per (observer, member) pair (Config.LagMedian
	// and LagP99), as the app does today with serf tags.
	Tags
	// Exact: every node sees the true average and lowest member of this
	// interval: the yardstick.
	Exact
)

// String returns the view's name as the bench command spells it.
func (v ViewKind) String() string {
	switch v {
	case Flow:
		return "flow"
	case Tags:
		return "tags"
	case Exact:
		return "exact"
	}
	return fmt.Sprintf("view(%d)", int(v))
}

// Balancer is the outer balancer through which shed clients reconnect:
// shedsim's, so that the ideal is taken behind the same one.
type Balancer = shedsim.Balancer

// The balancers.
const (
	// Random sends a client to a live node drawn uniformly.
	Random = shedsim.Random
	// LeastConn sends a client to the live node with the fewest
	// connections, ties at random.
	LeastConn = shedsim.LeastConn
)

// Scenario is what happens to the fleet at interval 0.
type Scenario int

const (
	// ScaleOut10, ScaleOut50 and Double add 10%, 50% and 100% more nodes,
	// empty; they take part in gossip from their first interval.
	ScaleOut10 Scenario = iota
	ScaleOut50
	Double
	// ScaleIn10 takes 10% of the nodes (the last named) out gracefully:
	// the others forget them at once and their clients reconnect through
	// the balancer.
	ScaleIn10
	// RollingRestart takes every node out in turn, one every
	// Config.RestartEvery intervals, and brings it back empty the next
	// interval with a new gossipavg incarnation.
	RollingRestart
)

// Scenarios lists every scenario, in the order the bench reports them.
var Scenarios = []Scenario{ScaleOut10, ScaleOut50, Double, ScaleIn10, RollingRestart}

// String returns the scenario's name as the bench command spells it.
func (s Scenario) String() string {
	switch s {
	case ScaleOut10:
		return "scale-out-10"
	case ScaleOut50:
		return "scale-out-50"
	case Double:
		return "scale-out-double"
	case ScaleIn10:
		return "scale-in-10"
	case RollingRestart:
		return "rolling-restart"
	}
	return fmt.Sprintf("scenario(%d)", int(s))
}

// Config is one simulation run. Zero fields take the defaults given.
type Config struct {
	// Nodes is the fleet's size before the scenario, at least 2.
	Nodes int
	// Conns is every node's connections before the scenario, at least 1.
	Conns int
	// Scenario, View and Balancer say what happens, how nodes see the
	// cluster and where shed clients go.
	Scenario Scenario
	View     ViewKind
	Balancer Balancer
	// Seed makes the run reproducible.
	Seed uint64
	// Params are the decision's settings. Default: DefaultParams.
	Params shed.Params
	// History is the smoothing window, in intervals. Default: 10 (the
	// app's 10s history at a 1s interval).
	History int
	// Loss is the probability that a gossipavg message is lost (Flow).
	// Default (0): 0.005; negative means none.
	Loss float64
	// LagMedian and LagP99 are the median and 99th percentile of the tag
	// lag, in intervals, fitted by a lognormal (Tags). Default: TagLag of
	// the largest fleet size of the run.
	LagMedian, LagP99 float64
	// JoinEvery is the intervals between two nodes a scale-out adds, the
	// first at interval 0, as autoscalers and deploys add them one after
	// another. Default: 0, all at interval 0.
	JoinEvery int
	// ReconnectDelay is the most intervals a shed client takes to
	// reconnect: each lands before the sample of an interval drawn
	// uniformly from the next ReconnectDelay (a client that sends a
	// request every second, at a 200 ms interval: 5). Default: 1, every
	// shed client back before the next sample.
	ReconnectDelay int
	// RestartEvery is the intervals between two restarts
	// (RollingRestart). Default: 2.
	RestartEvery int
	// Hold is the intervals convergence must hold. Default: 10.
	Hold int
	// MaxIntervals bounds the run after the scenario's last event.
	// Default: 3000.
	MaxIntervals int
	// IdealRuns is the number of runs of the perfect rebalancer whose
	// median is the ideal shed count. Default: 3.
	IdealRuns int
	// Timeline, when set, is called after every interval from 0 on with
	// the connections of every node ever made (0 for nodes out of the
	// fleet), indexed by node; it must not keep the slice.
	Timeline func(interval int, conns []int)
}

// DefaultParams returns the rebalance app's default settings at its
// default 1s interval (rebalance/app.go): threshold 20%, stop band half
// of it, shed rate 0.5%, min_connections 50, freshness 5 intervals.
func DefaultParams() shed.Params {
	return shed.Params{Threshold: 0.2, ShedRate: 0.005, MinConnections: 50, Freshness: 5 * Interval}
}

// TagLag returns the median and 99th percentile of the serf tag lag, in
// intervals, for a cluster of n members: measured at 16 members (0.4 and
// 0.8 intervals) and 128 members (0.8 and 2.9), and extrapolated linearly
// in log n beyond (and clamped at 16 below): an estimate, not a
// measurement, above 128.
func TagLag(n int) (median, p99 float64) {
	x := math.Log2(float64(max(n, 16))/16) / 3 // 0 at 16, 1 at 128
	return 0.4 + 0.4*x, 0.8 + 2.1*x
}

// resolved returns cfg with its defaults filled in, or an error.
func (cfg Config) resolved() (Config, error) {
	if cfg.Nodes < 2 || cfg.Nodes > 100_000 {
		return cfg, fmt.Errorf("fleetsim: Nodes %d, want 2 to 100000", cfg.Nodes)
	}
	if cfg.Conns < 1 || cfg.Conns > 1_000_000 {
		return cfg, fmt.Errorf("fleetsim: Conns %d, want 1 to 1000000", cfg.Conns)
	}
	if cfg.Params == (shed.Params{}) {
		cfg.Params = DefaultParams()
	}
	if cfg.History <= 0 {
		cfg.History = 10
	}
	switch {
	case cfg.Loss == 0:
		cfg.Loss = 0.005
	case cfg.Loss < 0:
		cfg.Loss = 0
	}
	switch {
	case cfg.ReconnectDelay == 0:
		cfg.ReconnectDelay = 1
	case cfg.ReconnectDelay < 0 || cfg.ReconnectDelay > maxLag:
		return cfg, fmt.Errorf("fleetsim: ReconnectDelay %d, want 1 to %d", cfg.ReconnectDelay, maxLag)
	}
	if cfg.JoinEvery < 0 || cfg.JoinEvery > maxLag {
		return cfg, fmt.Errorf("fleetsim: JoinEvery %d, want 0 to %d", cfg.JoinEvery, maxLag)
	}
	if cfg.RestartEvery <= 0 {
		cfg.RestartEvery = 2
	}
	if cfg.Hold <= 0 {
		cfg.Hold = 10
	}
	if cfg.MaxIntervals <= 0 {
		cfg.MaxIntervals = 3000
	}
	if cfg.IdealRuns <= 0 {
		cfg.IdealRuns = 3
	}
	if cfg.LagMedian <= 0 || cfg.LagP99 <= 0 {
		cfg.LagMedian, cfg.LagP99 = TagLag(cfg.maxSize())
	}
	if cfg.LagP99 < cfg.LagMedian {
		return cfg, fmt.Errorf("fleetsim: LagP99 %v below LagMedian %v", cfg.LagP99, cfg.LagMedian)
	}
	return cfg, nil
}

// added returns the nodes the scenario adds.
func (cfg Config) added() int {
	switch cfg.Scenario {
	case ScaleOut10:
		return max(1, int(math.Round(0.1*float64(cfg.Nodes))))
	case ScaleOut50:
		return max(1, int(math.Round(0.5*float64(cfg.Nodes))))
	case Double:
		return cfg.Nodes
	}
	return 0
}

// removed returns the nodes ScaleIn10 takes out.
func (cfg Config) removed() int {
	if cfg.Scenario != ScaleIn10 {
		return 0
	}
	return min(cfg.Nodes-2, max(1, int(math.Round(0.1*float64(cfg.Nodes)))))
}

// maxSize returns the most nodes the fleet ever has.
func (cfg Config) maxSize() int { return cfg.Nodes + cfg.added() }

// idealAt returns the interval at whose start (after its event) the
// ideal is taken: a scale-out's first, before anything is shed, with the
// nodes still to join counted empty; the other scenarios' last event.
func (cfg Config) idealAt() int {
	if cfg.added() > 0 {
		return 0
	}
	return cfg.lastEvent()
}

// lastEvent returns the interval of the scenario's last event.
func (cfg Config) lastEvent() int {
	if cfg.Scenario == RollingRestart {
		return (cfg.Nodes-1)*cfg.RestartEvery + 1
	}
	if cfg.JoinEvery > 0 && cfg.added() > 0 {
		return (cfg.added() - 1) * cfg.JoinEvery
	}
	return 0
}
