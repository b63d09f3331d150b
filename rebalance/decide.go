package rebalance

import (
	"fmt"
	"math"
	"time"
)

// MemberStatus is a cluster member's state as serf reports it, reduced to
// what the shedding decision needs.
type MemberStatus int

// Member states. Only StatusAlive members count toward the cluster
// average; serf keeps failed and left members in its list for a day.
const (
	StatusAlive MemberStatus = iota
	StatusLeaving
	StatusLeft
	StatusFailed
)

// String returns serf's name for the status.
func (s MemberStatus) String() string {
	switch s {
	case StatusAlive:
		return "alive"
	case StatusLeaving:
		return "leaving"
	case StatusLeft:
		return "left"
	case StatusFailed:
		return "failed"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// Report is one member's last load report as this node sees it.
type Report struct {
	// Name is the member's serf node name.
	Name string
	// Status is the member's serf status.
	Status MemberStatus
	// Load is the member's smoothed load, in the unit of the metric.
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
}

// stopBand returns the effective stop band.
func (p Params) stopBand() float64 {
	if p.StopBand > 0 {
		return p.StopBand
	}
	return p.Threshold / 2
}

// Validate reports settings that cannot work, naming the bad value.
func (p Params) Validate() error {
	switch {
	case !(p.Threshold > 0) || math.IsInf(p.Threshold, 0):
		return fmt.Errorf("threshold must be above 0%%, got %v%%", p.Threshold*100)
	case p.StopBand < 0 || p.StopBand > p.Threshold || math.IsNaN(p.StopBand):
		return fmt.Errorf("stop band must be between 0%% and the threshold (%v%%), got %v%%", p.Threshold*100, p.StopBand*100)
	case !(p.ShedRate > 0) || p.ShedRate > 1:
		return fmt.Errorf("shed rate must be above 0%% and at most 100%%, got %v%%", p.ShedRate*100)
	case p.MinConnections < 0:
		return fmt.Errorf("min_connections must not be negative, got %d", p.MinConnections)
	case p.Freshness <= 0:
		return fmt.Errorf("freshness must be positive, got %v", p.Freshness)
	}
	return nil
}

// standing is whether a member's report counts toward the cluster
// average, or why not.
type standing int

const (
	counted standing = iota
	notAlive
	otherMetric
	stale
)

// standing judges one member's report at now: it counts when the member
// is alive, reports p's metric (or p accepts every metric, or the report
// names none), and was seen to change within p.Freshness. It is the one
// rule for the cluster average (Decide), the admin view and the
// cluster_load selection policy.
func (p Params) standing(r Report, now time.Time) standing {
	switch {
	case r.Status != StatusAlive:
		return notAlive
	case p.Metric != "" && r.Metric != "" && r.Metric != p.Metric:
		return otherMetric
	case r.At.IsZero() || now.Sub(r.At) > p.Freshness:
		return stale
	}
	return counted
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
	// Shedding is the previous decision's Shedding (the hysteresis state).
	Shedding bool
	// Now is the decision's time, for freshness.
	Now time.Time
}

// Decision is the outcome of one decision.
type Decision struct {
	// Shed is how many connections to shed now.
	Shed int
	// Shedding is the hysteresis state to pass to the next decision.
	Shedding bool
	// Average is the cluster average load over the counted members; 0
	// when too few members count.
	Average float64
	// Balance is Local / Average (1 = exactly average); 0 when there is
	// no average.
	Balance float64
	// Counted is the number of members in the average, this node
	// included.
	Counted int
	// Stale, NotAlive and OtherMetric count the members excluded, and why.
	Stale, NotAlive, OtherMetric int
	// Reason says in a few words why Shed is what it is.
	Reason string
}

// Decide computes how many connections this node should shed now. It is
// a pure function: all state is in Input (Shedding) and Decision.
//
// The cluster average counts only members that are alive, report the same
// metric, and whose report is younger than Freshness; this node always
// counts, with Local. With fewer than MinMembers counted it never sheds.
// A node starts shedding when Local exceeds average × (1 + Threshold),
// keeps shedding while Local exceeds average × (1 + StopBand), and stops
// at or below that. Each decision sheds at most what brings Current down
// to the stop line (scaled to connections as Held × (1 − stop/Current)),
// at most ceil(Held × ShedRate), and never takes Held below
// MinConnections.
func Decide(p Params, in Input) Decision {
	d := Decision{}
	var sum float64
	for _, m := range in.Members {
		if m.Name == in.Self {
			continue
		}
		switch p.standing(m, in.Now) {
		case notAlive:
			d.NotAlive++
		case otherMetric:
			d.OtherMetric++
		case stale:
			d.Stale++
		default:
			sum += m.Load
			d.Counted++
		}
	}
	sum += in.Local
	d.Counted++

	minMembers := max(p.MinMembers, 2)
	if d.Counted < minMembers {
		d.Reason = fmt.Sprintf("too few fresh members (%d of %d needed)", d.Counted, minMembers)
		return d
	}
	d.Average = sum / float64(d.Counted)
	if d.Average <= 0 {
		d.Reason = "no load in the cluster"
		return d
	}
	d.Balance = in.Local / d.Average

	startLine := d.Average * (1 + p.Threshold)
	stopLine := d.Average * (1 + p.stopBand())
	switch {
	case in.Shedding && in.Local > stopLine:
		d.Shedding = true
	case !in.Shedding && in.Local > startLine:
		d.Shedding = true
	default:
		if in.Shedding {
			d.Reason = "reached the stop band"
		} else {
			d.Reason = "within the threshold"
		}
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
	// Connections to shed to bring the current load down to the stop line.
	// The epsilon keeps float noise (e.g. 1100.0000001) from asking for one
	// more connection than needed.
	excess := float64(in.Held) * (1 - stopLine/current)
	needed := int(math.Ceil(excess - 1e-9))
	if needed <= 0 {
		d.Reason = "current load already at the stop band"
		return d
	}
	limit := int(math.Ceil(float64(in.Held)*p.ShedRate - 1e-9))
	floor := in.Held - p.MinConnections
	d.Shed = min(needed, limit, floor)
	switch d.Shed {
	case needed:
		d.Reason = "shedding down to the stop band"
	case limit:
		d.Reason = "shedding at shed_rate"
	default:
		d.Reason = "shedding down to min_connections"
	}
	return d
}
