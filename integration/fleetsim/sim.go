package fleetsim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/caddy-lbx/lbx/integration/shedsim"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// Result is what one run measured.
type Result struct {
	// Converged is true when every live node was within ±Threshold of the
	// average connections, and none shed, for Hold intervals in a row
	// after the scenario's last event. Intervals is then the first
	// interval of that streak (counted from the scenario's start at 0),
	// else the intervals run.
	Converged bool
	Intervals int
	// Shed is the connections shed in all, from interval 0 on.
	Shed int
	// Ideal is the median shed count of a perfect rebalancer behind the
	// same balancer (shedsim.IdealShedsFor) from the fleet right after the
	// scenario's (last) event (a scale-out's nodes all in at once, empty,
	// even when they join JoinEvery apart), and Ratio is Shed/Ideal (NaN when Ideal is
	// 0). For RollingRestart that is the end state only: the restarts
	// themselves are not part of the ideal, so Ratio is not comparable
	// with the other scenarios'.
	Ideal, Ratio float64
	// Worst is the largest deviation of a live node's connections from
	// the average at the end, as a fraction of the average.
	Worst float64
	// Oscillating is the number of nodes that shed in two separate
	// shedding phases: a node shed, then spent an interval neither
	// shedding nor in a shedding phase (shed.Decision.Active), then
	// shed again.
	Oscillating int
	// Relanded is the number of shed connections that reconnected to a
	// node that shed in the same interval (itself included).
	Relanded int
	// TagDecisions counts the decisions a Flow node took from the tags
	// because its gossip average was not usable (shed.AveragedView).
	TagDecisions int
	// Nodes is the fleet's size at the end, and Total the connections it
	// holds (all along: a shed client, or one whose node left, reconnects).
	Nodes, Total int
}

// node is one simulated Caddy node.
type node struct {
	name   string
	live   bool
	conns  int
	window *shed.Window
	// recentSheds holds what the node shed in each of the last History
	// intervals: the app counts them toward its load until its clients
	// are back (shed.WithShedInFlight).
	recentSheds *shed.Window
	local       float64
	shedding    bool
	lift        shed.LiftState
	// phaseAvg and phaseCounted are shed.Decision's PhaseAverage
	// and PhaseCounted.
	phaseAvg     float64
	phaseCounted int
	gossip       *gossipavg.Node
	// shed is what the node shed in this interval.
	shed int
	// phaseShed is true once the node shed in its current shedding
	// phase; phases counts the phases in which it shed.
	phaseShed bool
	phases    int
}

// sim is one run's state.
type sim struct {
	cfg    Config
	p      shed.Params
	rng    *rand.Rand
	nodes  []*node // every node ever made, by slot; names in slot order
	live   []int   // the live slots, in order
	names  []string
	byName map[string]int
	t      int
	// Flow.
	gcfg  gossipavg.Config
	queue []gossipavg.Message
	lows  []gossipavg.Entry // a node's Lows, reused
	perm  []int
	// Tags: lag[o*cap+m] is how many intervals late observer o sees member
	// m's reports; pub[(t mod len(pub))*cap+m] is what m published at t
	// (NaN: not in the fleet).
	lag []uint8
	pub []float64
	// Least-connections balancer's groups, by count.
	byCount [][]int
	counts  []int
	// lastShed is what the fleet shed in the last interval.
	lastShed int
	// joins are the nodes joining lately, as every node sees them.
	joins shed.JoinBurst
	// landing[t mod len] is the shed clients that reconnect before the
	// sample of interval t; pending is their sum.
	landing []int
	pending int
	res     Result
}

// t0 is the simulated clock's origin.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// warmup is how many intervals the fleet runs, without deciding, before
// the scenario: windows fill and gossip settles.
const warmup = 20

// maxLag bounds a tag lag, in intervals.
const maxLag = 60

// Run simulates one scenario and returns what it measured.
func Run(cfg Config) (Result, error) {
	cfg, err := cfg.resolved()
	if err != nil {
		return Result{}, err
	}
	s := &sim{
		cfg:    cfg,
		p:      cfg.Params,
		rng:    rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x6a09e667f3bcc909)),
		byName: make(map[string]int),
	}
	s.landing = make([]int, cfg.ReconnectDelay+1)
	s.gcfg = shed.AverageConfig("", Interval, s.p.Freshness)
	size := cfg.maxSize()
	if cfg.View != Exact { // Flow falls back to the tags
		s.drawLags(size)
	}
	s.t = -warmup
	for range cfg.Nodes {
		if err := s.join(cfg.Conns); err != nil {
			return Result{}, err
		}
	}
	for ; s.t < 0; s.t++ {
		if err := s.step(false); err != nil {
			return Result{}, err
		}
	}
	last, end := cfg.lastEvent(), cfg.lastEvent()+cfg.MaxIntervals
	streak := 0
	for ; s.t < end; s.t++ {
		if err := s.event(); err != nil {
			return Result{}, err
		}
		if s.t == s.cfg.idealAt() {
			s.ideal()
		}
		if err := s.step(true); err != nil {
			return Result{}, err
		}
		if cfg.Timeline != nil {
			cfg.Timeline(s.t, s.connsBySlot())
		}
		if s.t >= last && s.balanced() {
			streak++
		} else {
			streak = 0
		}
		if streak == cfg.Hold {
			s.res.Converged = true
			s.res.Intervals = s.t - cfg.Hold + 1
			break
		}
	}
	if !s.res.Converged {
		s.res.Intervals = s.t
	}
	s.finish()
	return s.res, nil
}

// now returns the time of gossip tick j of the current interval; tick
// shed.AverageTicks is the decision.
func (s *sim) now(j int) time.Time {
	return t0.Add(time.Duration(s.t)*Interval + time.Duration(j)*Interval/shed.AverageTicks)
}

// join adds a new node holding conns connections.
func (s *sim) join(conns int) error {
	n := &node{name: fmt.Sprintf("n%05d", len(s.nodes))}
	s.nodes = append(s.nodes, n)
	s.byName[n.name] = len(s.nodes) - 1
	return s.start(len(s.nodes)-1, conns)
}

// start brings slot i into the fleet, fresh: an empty window, no decision
// state, a new gossipavg incarnation.
func (s *sim) start(i, conns int) error {
	n := s.nodes[i]
	n.live, n.conns, n.window = true, conns, shed.NewWindow(s.cfg.History)
	n.recentSheds = shed.NewWindow(s.cfg.History)
	s.joins = s.joins.Joined(s.now(0), s.p)
	n.local, n.shedding, n.lift, n.phaseAvg, n.phaseCounted = 0, false, shed.LiftState{}, 0, 0
	if s.cfg.View == Flow {
		c := s.gcfg
		c.Name = n.name
		g, err := gossipavg.New(c, s.now(0), rand.New(rand.NewPCG(s.rng.Uint64(), 1)))
		if err != nil {
			return err
		}
		n.gossip = g
	}
	s.relist()
	return nil
}

// stop takes slot i out of the fleet gracefully: the others forget it
// and its clients reconnect through the balancer.
func (s *sim) stop(i int) {
	n := s.nodes[i]
	n.live, n.gossip = false, nil
	c := n.conns
	n.conns = 0
	s.relist()
	if s.cfg.View == Flow {
		for _, j := range s.live {
			s.nodes[j].gossip.Forget(n.name)
		}
	}
	s.reconnect(c)
}

// relist rebuilds the live list.
func (s *sim) relist() {
	s.live, s.names = s.live[:0], s.names[:0]
	for i, n := range s.nodes {
		if n.live {
			s.live = append(s.live, i)
			s.names = append(s.names, n.name)
		}
	}
}

// event applies the scenario's event at the current interval, if any.
func (s *sim) event() error {
	switch cfg := s.cfg; cfg.Scenario {
	case ScaleOut10, ScaleOut50, Double:
		if cfg.JoinEvery > 0 {
			if s.t%cfg.JoinEvery == 0 && s.t/cfg.JoinEvery < cfg.added() {
				if err := s.join(0); err != nil {
					return err
				}
			}
		} else if s.t == 0 {
			for range cfg.added() {
				if err := s.join(0); err != nil {
					return err
				}
			}
		}
	case ScaleIn10:
		if s.t == 0 {
			for i := cfg.Nodes - cfg.removed(); i < cfg.Nodes; i++ {
				s.stop(i)
			}
		}
	case RollingRestart:
		// Node i goes at interval i × RestartEvery and is back the next.
		if back := s.t - 1; back >= 0 && back%cfg.RestartEvery == 0 && back/cfg.RestartEvery < cfg.Nodes {
			if err := s.start(back/cfg.RestartEvery, 0); err != nil {
				return err
			}
		}
		if s.t%cfg.RestartEvery == 0 && s.t/cfg.RestartEvery < cfg.Nodes {
			s.stop(s.t / cfg.RestartEvery)
		}
	}
	return nil
}

// ideal computes the perfect rebalancer's shed count from the fleet now,
// with the nodes a scale-out has still to add, empty.
func (s *sim) ideal() {
	counts := make([]int, 0, len(s.live))
	for _, i := range s.live {
		counts = append(counts, s.nodes[i].conns)
	}
	for range s.cfg.added() - (len(s.nodes) - s.cfg.Nodes) {
		counts = append(counts, 0)
	}
	s.res.Ideal = shedsim.IdealShedsFor(counts, s.p.Threshold, s.cfg.IdealRuns, s.cfg.Seed, s.cfg.Balancer)
}

// step runs the current interval: every live node samples its load and
// publishes it, gossip runs, and (when decide) every node decides and
// sheds and the shed clients reconnect.
func (s *sim) step(decide bool) error {
	slot := s.landingAt(s.t)
	s.pending -= *slot
	s.reconnect(*slot)
	*slot = 0
	anchor := ""
	if len(s.live) > 0 {
		anchor = s.names[0]
	}
	for _, i := range s.live {
		n := s.nodes[i]
		n.local = n.window.Add(shed.WithShedInFlight("connections", float64(n.conns), n.conns, n.recentSheds.Fading()))
		if n.gossip != nil {
			ind := 0.0
			if n.name == anchor {
				ind = 1
			}
			if err := n.gossip.SetInput([]float64{n.local, ind}); err != nil {
				return err
			}
		}
	}
	if s.cfg.View == Flow {
		for j := range shed.AverageTicks {
			if err := s.gossip(s.now(j)); err != nil {
				return err
			}
		}
	}
	if s.cfg.View != Exact {
		s.publish()
	}
	if !decide {
		return nil
	}
	now := s.now(shed.AverageTicks)
	exact := s.exactView()
	total := 0
	for _, i := range s.live {
		n := s.nodes[i]
		in := shed.Input{
			Self: n.name, Local: n.local, Current: float64(n.conns), Held: n.conns,
			Shedding: n.shedding, Lift: n.lift, PhaseAverage: n.phaseAvg, PhaseCounted: n.phaseCounted, Joins: s.joins, Now: now,
		}
		var v shed.View
		switch s.cfg.View {
		case Flow:
			var ok bool
			s.lows = n.gossip.Lows(now, s.lows[:0])
			if v, ok = shed.AveragedView(s.p, in, n.gossip.Estimate(now), s.lows, len(s.live), shed.View{}); !ok {
				v = s.tagView(i)
				s.res.TagDecisions++
			}
		case Tags:
			v = s.tagView(i)
		default:
			v = exact
		}
		d := shed.DecideView(s.p, in, v)
		n.shedding, n.lift, n.phaseAvg, n.phaseCounted, n.shed = d.Shedding, d.Lift, d.PhaseAverage, d.PhaseCounted, d.Shed
		n.conns -= d.Shed
		n.recentSheds.Add(float64(d.Shed))
		total += d.Shed
		switch {
		case d.Shed > 0 && !n.phaseShed:
			n.phaseShed = true
			n.phases++
		case d.Shed == 0 && !d.Active():
			n.phaseShed = false
		}
	}
	s.res.Shed += total
	s.lastShed = total
	s.schedule(total)
	for _, i := range s.live {
		s.nodes[i].shed = 0
	}
	return nil
}

// schedule schedules k shed clients to reconnect, each before the sample of
// one of the next ReconnectDelay intervals, drawn uniformly.
func (s *sim) schedule(k int) {
	d := len(s.landing) - 1
	if d == 1 {
		*s.landingAt(s.t + 1) += k
	} else {
		for range k {
			*s.landingAt(s.t + 1 + s.rng.IntN(d))++
		}
	}
	s.pending += k
}

// landingAt returns the count of the clients landing before interval t's
// sample (t may be negative: the warm-up).
func (s *sim) landingAt(t int) *int {
	l := len(s.landing)
	return &s.landing[(t%l+l)%l]
}

// exactView returns the true average and lowest member of this interval.
func (s *sim) exactView() shed.View {
	v := shed.View{Counted: len(s.live), Lowest: math.Inf(1)}
	var sum float64
	for _, i := range s.live {
		n := s.nodes[i]
		sum += n.local
		if n.local < v.Lowest {
			v.Lowest, v.LowestName = n.local, n.name
		}
	}
	if v.Counted > 0 {
		v.Average = sum / float64(v.Counted)
	}
	return v
}

// balanced reports whether no node shed in this interval and every live
// node is within ±Threshold of the average.
func (s *sim) balanced() bool {
	return s.lastShed == 0 && s.pending == 0 && s.worst() <= s.p.Threshold
}

// worst returns the largest deviation of a live node from the average
// connections, as a fraction of it.
func (s *sim) worst() float64 {
	total := 0
	for _, i := range s.live {
		total += s.nodes[i].conns
	}
	avg := float64(total) / float64(len(s.live))
	w := 0.0
	for _, i := range s.live {
		w = max(w, math.Abs(float64(s.nodes[i].conns)-avg)/avg)
	}
	return w
}

// finish fills in the figures measured at the end.
func (s *sim) finish() {
	s.res.Worst = s.worst()
	s.res.Ratio = math.NaN()
	if s.res.Ideal > 0 {
		s.res.Ratio = float64(s.res.Shed) / s.res.Ideal
	}
	for _, n := range s.nodes {
		if n.phases >= 2 {
			s.res.Oscillating++
		}
	}
	s.res.Nodes = len(s.live)
	for _, i := range s.live {
		s.res.Total += s.nodes[i].conns
	}
}

// connsBySlot returns every slot's connections.
func (s *sim) connsBySlot() []int {
	s.counts = s.counts[:0]
	for _, n := range s.nodes {
		s.counts = append(s.counts, n.conns)
	}
	return s.counts
}
