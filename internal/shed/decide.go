package shed

import (
	"fmt"
	"math"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
)

// Report is one member's last load report as this node sees it.
type Report struct {
	// Name is the member's serf node name.
	Name string
	// Status is the member's serf status.
	Status cluster.MemberStatus
	// Load is the member's smoothed load, in the unit of the metric; NaN
	// when its tag does not hold one (such a report never counts).
	Load float64
	// At is when this node last saw the report change (its own clock, so
	// clock skew between nodes does not matter). The zero time means the
	// member never reported.
	At time.Time
	// Metric names the member's metric; a report in another metric than
	// ours cannot be averaged with ours and is excluded. Empty means ours.
	Metric string
}

// Params are the settings of the shedding decision.
type Params struct {
	// Threshold is the fraction above the cluster average at which a node
	// starts shedding (0.2 = 20%).
	Threshold float64
	// StopBand is the fraction above the average down to which a node
	// that is shedding keeps shedding. 0 means Threshold/2. Must not
	// exceed Threshold.
	StopBand float64
	// ShedRate is the largest fraction of the connections held that one
	// decision sheds (0.005 = 0.5%). A positive rate always allows at
	// least one connection.
	ShedRate float64
	// MinConnections is the number of connections a node never sheds
	// below, and below which it does not shed at all.
	MinConnections int
	// Freshness is how recent a member's report must be to count. A
	// member whose report is older (a silent, partitioned or crashed node
	// that serf has not yet marked failed) is excluded.
	Freshness time.Duration
	// MinMembers is the number of fresh, alive members (this node
	// included) needed to decide anything. Values below 2 mean 2.
	MinMembers int
	// Metric is this node's metric name; reports in another metric are
	// excluded. Empty accepts every report.
	Metric string
	// LiftPatience is how long lifting may go on without the lowest
	// member's load rising before that member is left out of the average
	// for a while (a member that gets no new connections, e.g. one the
	// outer balancer does not send to, must not keep the others
	// shedding). 0 means 2 × Freshness.
	LiftPatience time.Duration
	// JoinSettle is how long no node sheds after a member joins, so that
	// nodes added one after another are filled once: connections shed
	// before the last of them is in land on nodes that must shed them
	// again. Joins less than JoinSettle apart make one burst, and a burst
	// holds shedding for at most maxJoinHolds × JoinSettle from its first
	// join, so steady churn in a large fleet cannot stop it. 0 means
	// Freshness; negative turns the wait off.
	JoinSettle time.Duration
}

// EffectiveJoinSettle returns the effective join settle time (0: off).
func (p Params) EffectiveJoinSettle() time.Duration {
	switch {
	case p.JoinSettle < 0:
		return 0
	case p.JoinSettle == 0:
		return p.Freshness
	}
	return p.JoinSettle
}

// maxJoinHolds bounds a burst of joins' hold on shedding, in JoinSettles.
const maxJoinHolds = 4

// JoinBurst is the members joining the cluster that hold shedding back
// (Params.JoinSettle): the first and the latest join of the current
// burst. The zero value is "no join seen".
type JoinBurst struct {
	First, Last time.Time
}

// Joined returns the burst with a member joining at now: p's join settle
// or more after the last one starts a new burst.
func (b JoinBurst) Joined(now time.Time, p Params) JoinBurst {
	if b.Last.IsZero() || now.Sub(b.Last) >= p.EffectiveJoinSettle() {
		b.First = now
	}
	b.Last = now
	return b
}

// holds reports whether the burst holds shedding back at now.
func (b JoinBurst) holds(now time.Time, settle time.Duration) bool {
	return settle > 0 && !b.Last.IsZero() && now.Sub(b.Last) < settle && now.Sub(b.First) < maxJoinHolds*settle
}

// EffectiveStopBand returns the effective stop band.
func (p Params) EffectiveStopBand() float64 {
	if p.StopBand > 0 {
		return p.StopBand
	}
	return p.Threshold / 2
}

// EffectiveLiftPatience returns the effective lift patience.
func (p Params) EffectiveLiftPatience() time.Duration {
	if p.LiftPatience > 0 {
		return p.LiftPatience
	}
	return 2 * p.Freshness
}

// liftIgnoreFactor is how many lift patiences a member that gained no
// connections stays out of the average: if it is still stuck when it
// counts again, it costs at most one patience of shedding in every
// liftIgnoreFactor+1.
const liftIgnoreFactor = 10

// MaxLoad is the largest load a report may carry and count: far above any
// real node's connections, bytes per second or CPU percent, and small
// enough that the sum of any number of counted loads stays finite, so
// the average cannot overflow.
const MaxLoad = 1e15

// ValidLoad reports whether v can be a load: a number from 0 to MaxLoad
// (NaN, infinities and negative numbers are not).
func ValidLoad(v float64) bool { return v >= 0 && v <= MaxLoad }

// Standing is whether a member's report counts toward the cluster
// average, or why not.
type Standing int

const (
	// Counted: the report counts.
	Counted Standing = iota
	// NotAlive: serf does not list the member alive.
	NotAlive
	// OtherMetric: the report is in another metric.
	OtherMetric
	// Stale: the report did not change within the freshness.
	Stale
	// Invalid: the load is not a number from 0 to MaxLoad (a tag that does
	// not parse, NaN, an infinity, a negative or absurd number).
	Invalid
	// Ignored: the lift rule left it out (Decide's own; see LiftState).
	Ignored
)

// Standing judges one member's report at now: it counts when the member
// is alive, was seen to change within p.Freshness, carries a valid load
// (ValidLoad: a peer that gossips NaN, an infinity, a negative or absurd
// number, or no number, is never taken for an idle node), and reports p's
// metric (or p accepts every metric, or the report names none). It is the
// one rule for the cluster average (Decide), the admin view and the
// cluster_load selection policy.
func (p Params) Standing(r Report, now time.Time) Standing {
	switch {
	case r.Status != cluster.StatusAlive:
		return NotAlive
	case r.At.IsZero() || now.Sub(r.At) > p.Freshness:
		return Stale
	case !ValidLoad(r.Load):
		return Invalid
	case p.Metric != "" && r.Metric != "" && r.Metric != p.Metric:
		return OtherMetric
	}
	return Counted
}

// Input is what one decision looks at.
type Input struct {
	// Self is this node's name; its entry in Members, if any, is replaced
	// by Local (this node's own report is always fresh).
	Self string
	// Local is this node's smoothed load: the value it gossips, so the
	// average is the one every other node computes too.
	Local float64
	// Current is this node's load now, unsmoothed, in the metric's unit.
	// It sizes the shed: smoothing lags, and sizing by the smoothed value
	// would keep shedding after the node already reached the stop band.
	// Zero or negative means Local.
	Current float64
	// Held is the number of connections this node holds now (those
	// already marked for closing excluded).
	Held int
	// Members are the reports of the cluster's members, as serf lists
	// them (any status, any age).
	Members []Report
	// Shedding is the previous decision's Shedding (the high rule's
	// hysteresis state).
	Shedding bool
	// Lift is the previous decision's Lift.
	Lift LiftState
	// PhaseAverage and PhaseCounted are the previous decision's: the
	// average, and the members counted in it, when this node's current
	// shedding phase began.
	PhaseAverage float64
	PhaseCounted int
	// Joins are the members joining lately (JoinBurst.Joined for each).
	Joins JoinBurst
	// Now is the decision's time, for freshness.
	Now time.Time
}

// LiftState is the lift rule's state, passed from one decision to the
// next. The zero value is "not lifting".
type LiftState struct {
	// Lifting is true while this node sheds toward the average to lift
	// an underloaded member.
	Lifting bool
	// Member is the lowest member when lifting started or last made
	// progress, Low its load then, and Since when that was.
	Member string
	Low    float64
	Since  time.Time
	// Ignored is a member that gained no connections while this node
	// lifted it for LiftPatience: it is left out of the average until
	// IgnoredUntil (it evidently gets no new connections, e.g. the outer
	// balancer does not send it any).
	Ignored      string
	IgnoredUntil time.Time
}

// Decision is the outcome of one decision.
type Decision struct {
	// Shed is how many connections to shed now.
	Shed int
	// Shedding is the high rule's hysteresis state to pass to the next
	// decision: true from above the threshold down to the stop band.
	Shedding bool
	// Lift is the lift rule's state to pass to the next decision.
	Lift LiftState
	// PhaseAverage and PhaseCounted are the average and the number of
	// members counted in it when this node's shedding phase (Active)
	// began, to pass to the next decision; 0 outside a phase. While the
	// phase lasts and the same number of members count, the stop and
	// lift lines are drawn from the higher of it and the current average:
	// shedding moves clients and does not change the fleet's total, but a
	// node's own sheds lower its view of the average at once while the
	// gains of the members its clients move to arrive only with their
	// reports, so the current average alone sank below the true one under
	// a busy CPU (200 true, 157 seen) and the node shed to 12% below it.
	// A member joining or leaving starts the phase's average over (a
	// scale-out lowers the true average); a phase in which the fleet
	// really loses clients ends early instead, and the next one starts
	// from the new average.
	PhaseAverage float64
	PhaseCounted int
	// Lowest is the lowest load among the counted members (this node
	// included), and LowestName its member; zero when there is no average.
	Lowest     float64
	LowestName string
	// Average is the cluster average load over the counted members; 0
	// when too few members count.
	Average float64
	// Balance is Local / Average (1 = exactly average); 0 when there is
	// no average.
	Balance float64
	// Counted is the number of members in the average, this node
	// included.
	Counted int
	// Stale, NotAlive, Invalid, OtherMetric and Ignored count the members
	// excluded, and why (Ignored: Lift.Ignored).
	Stale, NotAlive, Invalid, OtherMetric, Ignored int
	// Reason says in a few words why Shed is what it is.
	Reason string
}

// View is what a decision needs of the cluster: the average load and
// the lowest member, and which members were counted or excluded, and why.
// Decide makes it from the member reports (Summarize); a node that learns
// the average some other way (by gossip averaging, say) makes its own and
// calls DecideView, leaving out the member the lift rule ignores
// (Input.Lift.Ignored) if it can.
type View struct {
	// Average is the cluster average load over the counted members, this
	// node included.
	Average float64
	// Counted is the number of members in the average, this node
	// included.
	Counted int
	// Stale, NotAlive, Invalid, OtherMetric and Ignored count the members
	// excluded, and why (Ignored: Input.Lift.Ignored).
	Stale, NotAlive, Invalid, OtherMetric, Ignored int
	// Lowest is the lowest load among the counted members, this node
	// included, and LowestName its member.
	Lowest     float64
	LowestName string
}

// Decide computes how many connections this node should shed now: it is
// DecideView of the summary of in.Members. It is a pure function: all
// state is in Input (Shedding, Lift) and Decision.
func Decide(p Params, in Input) Decision {
	return DecideView(p, in, Summarize(p, in))
}

// Summarize makes the View of in.Members. The cluster average counts only
// the members whose report counts (Params.Standing: alive, younger than
// Freshness, a valid load in the same metric), and not the member the
// lift rule leaves out (Input.Lift.Ignored, until IgnoredUntil); this node
// always counts, with Local, and is the lowest member unless another
// counted member's load is lower.
func Summarize(p Params, in Input) View {
	v := View{}
	ignoring := in.Lift.ignoring(in.Now)
	var sum float64
	lowest, lowestName := in.Local, in.Self
	for _, m := range in.Members {
		if m.Name == in.Self {
			continue
		}
		st := p.Standing(m, in.Now)
		if st == Counted && ignoring && m.Name == in.Lift.Ignored {
			st = Ignored
		}
		switch st {
		case NotAlive:
			v.NotAlive++
		case OtherMetric:
			v.OtherMetric++
		case Stale:
			v.Stale++
		case Invalid:
			v.Invalid++
		case Ignored:
			v.Ignored++
		default:
			sum += m.Load
			v.Counted++
			if m.Load < lowest {
				lowest, lowestName = m.Load, m.Name
			}
		}
	}
	sum += in.Local
	v.Counted++
	v.Average = sum / float64(v.Counted)
	v.Lowest, v.LowestName = lowest, lowestName
	return v
}

// ignoring reports whether the lift rule leaves a member out of the
// average at now.
func (l LiftState) ignoring(now time.Time) bool {
	return l.Ignored != "" && now.Before(l.IgnoredUntil)
}

// DecideView computes how many connections this node should shed now,
// from v, the cluster as this node sees it. It is a pure function: all
// state is in Input (Shedding, Lift) and Decision; Input.Members is not
// read. With fewer than MinMembers counted it never sheds.
//
// Two rules make a node shed. The high rule: a node starts shedding when
// Local exceeds average × (1 + Threshold), keeps shedding while Local
// exceeds average × (1 + StopBand), and stops at or below that. The lift
// rule: while some counted member is below average × (1 − Threshold) (a
// node that joined, say), every node above the average sheds toward the
// average, until the lowest member reaches average × (1 − StopBand). The
// high rule alone only works when as many nodes join as there were: from
// 10 to 11 nodes the old ones sit at 1.1× the average, inside the band,
// and the new one would get no connection at all. A shed client lands on
// the underloaded member only with probability 1/members, so lifting is
// given up when the lowest member's load has not risen for LiftPatience:
// that member is then left out of the average for 10 × LiftPatience (a
// member that gets no new connections, e.g. one the outer balancer does
// not send to, would otherwise keep the cluster shedding forever, under
// either rule).
//
// Each decision sheds at most what brings Current down to the stop line
// (the average while lifting), scaled to connections as
// Held × (1 − line/Current), at most ceil(Held × ShedRate), and never
// takes Held below MinConnections.
func DecideView(p Params, in Input, v View) Decision {
	d := Decision{
		Counted: v.Counted, Stale: v.Stale, NotAlive: v.NotAlive,
		Invalid: v.Invalid, OtherMetric: v.OtherMetric, Ignored: v.Ignored,
	}
	ignoring := in.Lift.ignoring(in.Now)
	if ignoring {
		d.Lift = LiftState{Ignored: in.Lift.Ignored, IgnoredUntil: in.Lift.IgnoredUntil}
	}
	minMembers := max(p.MinMembers, 2)
	if d.Counted < minMembers {
		d.Reason = fmt.Sprintf("too few fresh members (%d of %d needed)", d.Counted, minMembers)
		return d
	}
	d.Average = v.Average
	if !(d.Average > 0) {
		d.Average = 0
		d.Reason = "no load in the cluster"
		return d
	}
	d.Balance = in.Local / d.Average
	lowest, lowestName := v.Lowest, v.LowestName
	d.Lowest, d.LowestName = lowest, lowestName

	// The lines' average: the current one, or within a shedding phase
	// the phase's, if higher (Decision.PhaseAverage).
	avg := d.Average
	samePhase := (in.Shedding || in.Lift.Lifting) && in.PhaseCounted == d.Counted && in.PhaseAverage > 0
	if samePhase && in.PhaseAverage > avg {
		avg = in.PhaseAverage
	}
	startLine := avg * (1 + p.Threshold)
	stopLine := avg * (1 + p.EffectiveStopBand())
	d.Shedding = in.Shedding && in.Local > stopLine || !in.Shedding && in.Local > startLine
	d.Lift = nextLift(p, in, d.Lift, avg, lowest, lowestName)
	if d.Active() {
		d.PhaseAverage, d.PhaseCounted = d.Average, d.Counted
		if samePhase {
			d.PhaseAverage = in.PhaseAverage
		}
	}
	line := stopLine
	switch {
	case d.Lift.Lifting:
		line = avg
	case d.Shedding:
	case d.Lift.Ignored == lowestName && !ignoring:
		d.Reason = fmt.Sprintf("%s gained no connections while lifted; left out of the average for a while", lowestName)
		return d
	case in.Shedding:
		d.Reason = "reached the stop band"
		return d
	default:
		d.Reason = "within the threshold"
		return d
	}

	if settle := p.EffectiveJoinSettle(); in.Joins.holds(in.Now, settle) {
		if d.Lift.Lifting {
			d.Lift.Since = in.Now // the lowest member cannot rise while nobody sheds
		}
		d.Reason = fmt.Sprintf("a member joined %v ago: waiting join_settle (%v) for more", in.Now.Sub(in.Joins.Last).Round(time.Millisecond), settle)
		return d
	}
	if in.Held <= p.MinConnections {
		d.Reason = fmt.Sprintf("at or below min_connections (%d)", p.MinConnections)
		return d
	}
	current := in.Current
	if current <= 0 {
		current = in.Local
	}
	// Connections to shed to bring the current load down to the line.
	// The epsilon keeps float noise (e.g. 1100.0000001) from asking for one
	// more connection than needed.
	excess := float64(in.Held) * (1 - line/current)
	needed := int(math.Ceil(excess - 1e-9))
	if needed <= 0 {
		d.Reason = "current load already at the stop band"
		if d.Lift.Lifting {
			d.Reason = "current load already at the average"
		}
		return d
	}
	limit := int(math.Ceil(float64(in.Held)*p.ShedRate - 1e-9))
	floor := in.Held - p.MinConnections
	d.Shed = min(needed, limit, floor)
	switch d.Shed {
	case needed:
		d.Reason = "shedding down to the stop band"
		if d.Lift.Lifting {
			d.Reason = "shedding down to the average"
		}
	case limit:
		d.Reason = "shedding at shed_rate"
	default:
		d.Reason = "shedding down to min_connections"
	}
	if d.Lift.Lifting {
		d.Reason += fmt.Sprintf(" to lift %s", lowestName)
	}
	return d
}

// nextLift returns the lift rule's next state; kept holds what carries
// over whatever happens (the member left out, if any). Lifting needs this
// node above the average; it starts when the lowest member is below
// average × (1 − Threshold) and goes on until that member reaches
// average × (1 − StopBand), as long as the lowest member's load keeps
// rising within LiftPatience. When it does not, lifting stops and that
// member is left out of the average for liftIgnoreFactor × LiftPatience.
func nextLift(p Params, in Input, kept LiftState, avg, lowest float64, lowestName string) LiftState {
	prev := in.Lift
	line := avg * (1 - p.Threshold)
	if prev.Lifting {
		line = avg * (1 - p.EffectiveStopBand())
	}
	if lowest >= line || in.Local <= avg {
		return kept
	}
	next := kept
	next.Lifting, next.Member, next.Low, next.Since = true, lowestName, lowest, in.Now
	switch {
	case !prev.Lifting, lowestName != prev.Member, lowest > prev.Low:
		// Started, or the lowest member gained (or another is lowest
		// now): patience starts over.
		return next
	case in.Now.Sub(prev.Since) > p.EffectiveLiftPatience():
		return LiftState{Ignored: lowestName, IgnoredUntil: in.Now.Add(liftIgnoreFactor * p.EffectiveLiftPatience())}
	}
	next.Low, next.Since = prev.Low, prev.Since
	return next
}

// Active reports whether the node is in a shedding phase: above the stop
// band, or lifting an underloaded member.
func (d Decision) Active() bool { return d.Shedding || d.Lift.Lifting }
