package shed

import (
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
)

// Settings of the gossip averaging.
const (
	// averageDim is the size of a node's input: its load (which the
	// lowest-load entries carry) and the size indicator (1 at one
	// member, so that its average is 1/N).
	averageDim = 2
	// AverageTicks is how many exchanges a node starts per interval.
	AverageTicks = 10
	// averagePeers is how many pairs a node opens by itself (see
	// gossipavg.Config.Peers).
	averagePeers = 4
	// averageEntries is how many lowest-load entries a message carries.
	averageEntries = 4
	// averageRetries is how many times an unanswered request is sent
	// again.
	averageRetries = 2
	// minRetryTimeout is the least time a request waits for its answer:
	// above a round trip on a loaded LAN.
	minRetryTimeout = 20 * time.Millisecond
	// sizeTolerance is how far, as a fraction, the averaging's estimate of
	// the cluster's size may be from the members serf lists in this
	// node's metric for its average to be used. The size is averaged
	// alongside the load (an indicator that is 1 at one member), so a
	// size that agrees says the load average covers the same members.
	sizeTolerance = 0.1
	// tagSlack is how far, as a fraction, the gossip average and the
	// estimates a node averages with may be outside the range of the
	// members' load tags (and tagSlackAbs how far in the metric's unit on
	// top of it): twice tagChange, the change that republishes a tag
	// early, so that tags a step or two behind the loads do not refuse
	// honest averaging.
	tagSlack    = 2 * tagChange
	tagSlackAbs = 0.5
)

// A member is trusted to join, not to decide. Anything in an averaging
// message is the sender's word: its estimate, its flows and its
// lowest-load entries. The members' load tags are each member's own word
// about itself, signed by serf's membership, and Decide already judges
// them (ValidLoad). So the average is held to what the tags make
// possible: a node averages only with estimates within the range of the
// tags of the alive members in its metric (its own load included),
// widened by tagSlack and tagSlackAbs (gossipavg.Node.SetBounds refuses
// the rest); a decision uses the gossip average only while it lies in
// that range (else the tags decide), and clamped to within MeanSlack of
// the tags' average; lowest-load entries below the range are not
// counted. A lying member can move the decision's average no farther than
// that: not far enough that a node at or below the tags' average sheds by
// the high rule. Clamping rather than refusing keeps the gossip average's
// count of members and its freshness while the tags lag behind a fast
// change (a node shedding quickly), when the tags alone decide worse.

// TagRange is what the load tags of the alive members in a node's metric
// (any age, this node's own load in place of its tag) say about the
// average: their smallest and largest load and their average. OK is false
// when no other member has a valid tag in the metric (no evidence: the
// bounds do not apply).
type TagRange struct {
	OK             bool
	Min, Max, Mean float64
}

// TagRangeOf returns the TagRange of in's members in p's metric.
func TagRangeOf(p Params, in Input) TagRange {
	r := TagRange{Min: in.Local, Max: in.Local}
	sum, n := in.Local, 1
	for _, m := range in.Members {
		if m.Name == in.Self || m.Status != cluster.StatusAlive || !ValidLoad(m.Load) ||
			p.Metric != "" && m.Metric != "" && m.Metric != p.Metric {
			continue
		}
		r.Min, r.Max = min(r.Min, m.Load), max(r.Max, m.Load)
		sum += m.Load
		n++
	}
	r.OK = n > 1 && ValidLoad(in.Local)
	r.Mean = sum / float64(n)
	return r
}

// lo is the smallest average, estimate and lowest load the tags allow.
func (r TagRange) Lo() float64 { return max(0, r.Min-r.Min*tagSlack-tagSlackAbs) }

// hi is the largest average and estimate the tags allow.
func (r TagRange) Hi() float64 { return r.Max + r.Max*tagSlack + tagSlackAbs }

// MeanSlack is how far the decision's average may be off mean, the tags'
// average, with p (the gossip average is clamped to it): t/(1 + t) of
// mean, t the threshold, and at least tagSlackAbs. With an average a that
// far below the tags' average m, a node at m is at a × (1 + t) exactly,
// which does not exceed it: a member cannot make it shed by the high
// rule. With the default 20% threshold that is 16.7%.
func MeanSlack(p Params, mean float64) float64 {
	return max(p.Threshold/(1+p.Threshold)*mean, tagSlackAbs)
}

// ClampedAverage is the average a decision takes from v: the gossip
// average, within MeanSlack of the tags' average when there are tags.
func (v AverageView) ClampedAverage() float64 {
	if !v.Tags.OK {
		return v.Average
	}
	return min(max(v.Average, v.Tags.Mean-v.MeanSlack), v.Tags.Mean+v.MeanSlack)
}

// AverageConfig returns the gossip averaging settings of a rebalance node
// named name with the given interval and freshness, as the app runs it:
// the inputs of averageDim, AverageTicks exchanges per interval, and
// pairs and lowest-load entries that expire at freshness. It is exported
// for the gossip benchmark, which runs members as the app does.
func AverageConfig(name string, interval, freshness time.Duration) gossipavg.Config {
	tick := interval / AverageTicks
	// A pair silent for an hour is gone whatever freshness says (up to
	// 24h); the decision still judges its own exchanges by freshness
	// (AverageUsable).
	freshness = min(freshness, gossipavg.MaxFreshness)
	// A pair must be refreshed every freshness/2, and a node takes part
	// in about two exchanges per tick: keep the pairs it opens within
	// what it can refresh.
	peers := min(averagePeers, max(1, int(freshness/2/tick)/2))
	return gossipavg.Config{
		Name: name, Dim: averageDim, Entries: averageEntries, Peers: peers,
		Freshness: freshness,
		// Capped so that a request and its retries fit in freshness/2
		// (3/8 of freshness), as gossipavg requires.
		RetryTimeout: min(max(tick/2, minRetryTimeout), freshness/8),
		MaxRetries:   averageRetries,
	}
}

// AverageView is what the averaging says at a step, and whether the
// decision uses it.
type AverageView struct {
	// Average and Size are the estimates of the cluster's average load
	// and number of members; Size is +Inf before any exchange.
	Average, Size float64
	// Members is the number of alive members in this node's metric, this
	// node included: what Size should be.
	Members int
	// Lows are the lowest-load members this node knows, itself included,
	// lowest first.
	Lows []gossipavg.Entry
	// Peers is the number of members this node holds pair state with,
	// Exchanges the exchanges it completed in the last freshness, and
	// LastExchange when it completed one last.
	Peers, Exchanges int
	LastExchange     time.Time
	// Used is true when the decision uses the average; Why says why not.
	Used bool
	Why  string
	// Refused is true when the average is not used because it is outside
	// what the load tags allow (TagRange): a member may be lying.
	Refused bool
	// Tags is what the load tags allow, and MeanSlack how far the
	// decision's average may be off theirs (ClampedAverage); Clamped is
	// true when a used average was that far off.
	Tags      TagRange
	MeanSlack float64
	Clamped   bool
}

// Where a decision's average came from (AverageView.source).
const (
	FromGossip = "gossip"
	FromTags   = "tags"
)

// source says where the decision's average came from: FromGossip, or
// FromTags because of Why.
func (v AverageView) Source() string {
	if v.Used {
		return FromGossip
	}
	return FromTags + ": " + v.Why
}

// MakeAverageView is the view of a gossipavg node's estimate est and
// lowest-load entries lows at now, with members the alive members in this
// node's metric (itself included) and tags what their load tags allow,
// judged by AverageUsable with p.
func MakeAverageView(est gossipavg.View, lows []gossipavg.Entry, members int, p Params, tags TagRange, now time.Time) AverageView {
	v := AverageView{
		Average: est.Values[0], Size: math.Inf(1), Members: members, Lows: lows,
		Peers: est.Peers, Exchanges: est.Exchanges, LastExchange: est.LastExchange,
		Tags: tags, MeanSlack: MeanSlack(p, tags.Mean),
	}
	if est.Values[1] > 0 {
		v.Size = 1 / est.Values[1]
	}
	v.Used, v.Why = AverageUsable(v, p.Freshness, now)
	v.Refused = !v.Used && RefusedByTags(v)
	v.Clamped = v.Used && v.ClampedAverage() != v.Average
	return v
}

// AveragedView returns the View a decision on in takes from a gossip
// average, and true, when the average is usable (the freshness rule of
// AverageUsable); otherwise tags, the View of the members' load tags, and
// false. est and lows are what the node's gossipavg node says (Estimate
// and Lows, read before this step's input is set), members the alive
// members in its metric, itself included. The average and the size come
// from the averaging, the lowest member from its lowest-load entries
// (this node's own at in.Local, and not the member the lift rule leaves
// out, which the averaging cannot take out of the average), and the
// members not alive, in another metric or with an invalid tag as the tags
// count them (none of those averages with this node). The average must
// also agree with the load tags in in.Members (TagRangeOf; with none,
// as in the fleet simulation, that check does not apply). The
// rebalance app decides this way; it is exported for the fleet
// simulation.
func AveragedView(p Params, in Input, est gossipavg.View, lows []gossipavg.Entry, members int, tags View) (View, bool) {
	tr := TagRangeOf(p, in)
	avg := MakeAverageView(est, lows, members, p, tr, in.Now)
	if !avg.Used {
		return tags, false
	}
	return avg.DecisionView(in, tags), true
}

// DecisionView is the View of a usable gossip average for a decision on
// in (AveragedView).
func (avg AverageView) DecisionView(in Input, tags View) View {
	v := View{
		Average: avg.ClampedAverage(), Counted: int(math.Round(avg.Size)),
		NotAlive: tags.NotAlive, OtherMetric: tags.OtherMetric, Invalid: tags.Invalid,
		Lowest: in.Local, LowestName: in.Self,
	}
	ignored := ""
	if in.Lift.ignoring(in.Now) {
		ignored = in.Lift.Ignored
	}
	for _, e := range avg.Lows {
		if e.Name == ignored || e.Name == in.Self {
			continue // this node's own entry is a step old
		}
		if avg.Tags.OK && e.Load < avg.Tags.Lo() {
			continue // below every tag: no member says so of itself
		}
		if e.Load < in.Local {
			v.Lowest, v.LowestName = e.Load, e.Name
		}
		break
	}
	return v
}

// AverageUsable is the rule of the gossip average: the decision uses it
// when this node completed an exchange within freshness, the average
// lies within the range of the load tags (see TagRange; a member's
// estimates cannot take the decision beyond what the members publish of
// themselves, and a restart or a join still spreading waits until the
// average agrees with the tags again), and the size estimate is within sizeTolerance of the
// members serf lists in this node's metric (so the average covers the
// members serf sees: not while a join or a departure is still spreading,
// not while this node's messages do not get through, not while a member
// takes no part).
func AverageUsable(v AverageView, freshness time.Duration, now time.Time) (bool, string) {
	switch {
	case v.Members < 2:
		return false, "no other member in this metric"
	case v.LastExchange.IsZero():
		return false, "no exchange completed yet"
	case now.Sub(v.LastExchange) > freshness:
		return false, fmt.Sprintf("no exchange completed for %v (freshness %v)", now.Sub(v.LastExchange).Round(time.Millisecond), freshness)
	case math.Abs(v.Size-float64(v.Members)) > sizeTolerance*float64(v.Members):
		return false, fmt.Sprintf("estimated size %.1f is not within %.0f%% of the %d members in this metric", v.Size, sizeTolerance*100, v.Members)
	case v.Tags.OK && !(v.Average >= v.Tags.Lo() && v.Average <= v.Tags.Hi()): // NaN too
		return false, fmt.Sprintf("%s %.4g to %.4g", tagsRefuse, v.Tags.Lo(), v.Tags.Hi())
	}
	return true, ""
}

// The beginning of AverageUsable's reason that says the tags refuse the
// average (RefusedByTags).
const (
	tagsRefuse = "the average is outside what the members' load tags allow:"
)

// RefusedByTags reports whether v's average is not used because the load
// tags refuse it.
func RefusedByTags(v AverageView) bool {
	return strings.HasPrefix(v.Why, tagsRefuse)
}
