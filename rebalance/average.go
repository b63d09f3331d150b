package rebalance

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
)

// The cluster average by gossip averaging. Load tags reach every member
// through serf's broadcasts, whose traffic per member grows with the
// cluster (every update of every member is re-gossiped by everyone);
// past a few dozen members the reports queue up and arrive late. So every
// rebalance node also takes part in averaging the members' loads by flow
// updating (internal/gossipavg): a few pairwise exchanges per interval,
// each one direct message and its answer on the gossip socket, whatever
// the cluster's size. A decision uses that average when it is complete
// (averageUsable), and the tags' view otherwise: while the node starts,
// while the averaging has not caught up with a change of membership, or
// when its messages do not get through.

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
// them (validLoad). So the average is held to what the tags make
// possible: a node averages only with estimates within the range of the
// tags of the alive members in its metric (its own load included),
// widened by tagSlack and tagSlackAbs (gossipavg.Node.SetBounds refuses
// the rest); a decision uses the gossip average only while it lies in
// that range (else the tags decide), and clamped to within meanSlack of
// the tags' average; lowest-load entries below the range are not
// counted. A lying member can move the decision's average no farther than
// that: not far enough that a node at or below the tags' average sheds by
// the high rule. Clamping rather than refusing keeps the gossip average's
// count of members and its freshness while the tags lag behind a fast
// change (a node shedding quickly), when the tags alone decide worse.

// tagRange is what the load tags of the alive members in a node's metric
// (any age, this node's own load in place of its tag) say about the
// average: their smallest and largest load and their average. ok is false
// when no other member has a valid tag in the metric (no evidence: the
// bounds do not apply).
type tagRange struct {
	ok             bool
	min, max, mean float64
}

// tagRangeOf returns the tagRange of in's members in p's metric.
func tagRangeOf(p Params, in Input) tagRange {
	r := tagRange{min: in.Local, max: in.Local}
	sum, n := in.Local, 1
	for _, m := range in.Members {
		if m.Name == in.Self || m.Status != cluster.StatusAlive || !validLoad(m.Load) ||
			p.Metric != "" && m.Metric != "" && m.Metric != p.Metric {
			continue
		}
		r.min, r.max = min(r.min, m.Load), max(r.max, m.Load)
		sum += m.Load
		n++
	}
	r.ok = n > 1 && validLoad(in.Local)
	r.mean = sum / float64(n)
	return r
}

// lo is the smallest average, estimate and lowest load the tags allow.
func (r tagRange) lo() float64 { return max(0, r.min-r.min*tagSlack-tagSlackAbs) }

// hi is the largest average and estimate the tags allow.
func (r tagRange) hi() float64 { return r.max + r.max*tagSlack + tagSlackAbs }

// meanSlack is how far the decision's average may be off mean, the tags'
// average, with p (the gossip average is clamped to it): t/(1 + t) of
// mean, t the threshold, and at least tagSlackAbs. With an average a that
// far below the tags' average m, a node at m is at a × (1 + t) exactly,
// which does not exceed it: a member cannot make it shed by the high
// rule. With the default 20% threshold that is 16.7%.
func meanSlack(p Params, mean float64) float64 {
	return max(p.Threshold/(1+p.Threshold)*mean, tagSlackAbs)
}

// clampedAverage is the average a decision takes from v: the gossip
// average, within MeanSlack of the tags' average when there are tags.
func (v averageView) clampedAverage() float64 {
	if !v.Tags.ok {
		return v.Average
	}
	return min(max(v.Average, v.Tags.mean-v.MeanSlack), v.Tags.mean+v.MeanSlack)
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
	// (averageUsable).
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

// averageKinds are the direct-message kinds of the averaging, one per
// metric: members balancing different metrics never average together
// (the node's CPU and this process's among them).
var averageKinds = map[string]byte{
	metricConnections: 1,
	metricThroughput:  2,
	metricCPU:         3,
	metricNodeCPU:     4,
}

// averager is a node's part in the gossip averaging. Its state machine
// (gossipavg.Node) is made at the node's first step with a running
// cluster member, and made again when a config changes its settings.
type averager struct {
	logger *zap.Logger

	mu      sync.Mutex
	cluster *cluster.App // the app the handler was registered through
	cancel  func()       // removes the handler
	kind    byte
	cfg     gossipavg.Config
	state   *gossipavg.Node
	rng     *rand.Rand
	peers   []string // alive members in this node's metric, sorted

	// refused counts the messages refused because their estimates are
	// outside what the load tags allow (gossipavg.ErrOutOfBounds).
	refused atomic.Uint64
}

// averageView is what the averaging says at a step, and whether the
// decision uses it.
type averageView struct {
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
	// what the load tags allow (tagRange): a member may be lying.
	Refused bool
	// Tags is what the load tags allow, and MeanSlack how far the
	// decision's average may be off theirs (clampedAverage); Clamped is
	// true when a used average was that far off.
	Tags      tagRange
	MeanSlack float64
	Clamped   bool
}

// Where a decision's average came from (averageView.source).
const (
	fromGossip = "gossip"
	fromTags   = "tags"
)

// source says where the decision's average came from: fromGossip, or
// fromTags because of Why.
func (v averageView) source() string {
	if v.Used {
		return fromGossip
	}
	return fromTags + ": " + v.Why
}

// newAverager returns an averager that starts at the node's first step.
func newAverager(logger *zap.Logger) *averager {
	return &averager{logger: logger, rng: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
}

// prepare makes sure the averaging runs with s's settings through s's
// cluster member: it registers the message handler (through a config's
// new cluster app, superseding the old registration, as a reload does)
// and makes a new state machine when the settings or the metric changed
// (a new incarnation to the peers, which drop the old one's pairs: an
// estimate in one metric never flows into another's averaging).
func (a *averager) prepare(s *settings, name string, now time.Time) error {
	kind := averageKinds[s.metric]
	cfg := AverageConfig(name, s.interval, s.params.Freshness)
	a.mu.Lock()
	defer a.mu.Unlock()
	newKind := a.kind != kind
	if a.cluster != s.cluster || newKind {
		cancel, err := s.cluster.HandleDirect(kind, a.receive)
		if err != nil {
			return err
		}
		if a.cancel != nil {
			a.cancel()
		}
		a.cluster, a.cancel, a.kind = s.cluster, cancel, kind
	}
	if a.state == nil || a.cfg != cfg || newKind {
		st, err := gossipavg.New(cfg, now, a.rng)
		if err != nil {
			// The app's bounds keep AverageConfig valid; say so if not.
			return fmt.Errorf("gossip averaging: %v", err)
		}
		a.state, a.cfg = st, cfg
	}
	return nil
}

// close removes the message handler: the node stops.
func (a *averager) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cancel != nil {
		a.cancel()
	}
	a.cluster, a.cancel, a.state = nil, nil, nil
}

// step reads the averaging's view at now, then sets this node's input to
// local and follows the membership: members, the alive ones in this
// node's metric other than itself, sorted. The view is read before the
// input changes: this node's own change reaches its estimate at once but
// the others' only as it spreads, so reading after would weigh it N
// times.
func (a *averager) step(name string, members []string, local float64, p Params, tags tagRange, now time.Time) averageView {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.state == nil {
		return averageView{Size: math.Inf(1), Members: len(members) + 1, Why: "the gossip averaging has not started", Tags: tags}
	}
	v := makeAverageView(a.state.Estimate(now), a.state.Lows(now, nil), len(members)+1, p, tags, now)
	// From now on average only with estimates the tags allow; the size
	// indicator's average is always within 0 and 1.
	var err error
	if tags.ok {
		err = a.state.SetBounds([]float64{tags.lo(), 0}, []float64{tags.hi(), 1})
	} else {
		err = a.state.SetBounds(nil, nil)
	}
	if err != nil {
		// validLoad keeps the tags within gossipavg's bounds.
		a.logger.Debug("gossip averaging refused the bounds", zap.Error(err))
	}
	for _, gone := range a.peers {
		if _, ok := slices.BinarySearch(members, gone); !ok {
			a.state.Forget(gone)
		}
	}
	a.peers = append(a.peers[:0], members...)
	// The size indicator: 1 at the member with the smallest name.
	indicator := 0.0
	if len(members) == 0 || name < members[0] {
		indicator = 1
	}
	if err := a.state.SetInput([]float64{local, indicator}); err != nil {
		// local comes from validLoad's range, which is gossipavg's.
		a.logger.Debug("gossip averaging refused the load", zap.Float64("load", local), zap.Error(err))
	}
	return v
}

// makeAverageView is the view of a gossipavg node's estimate est and
// lowest-load entries lows at now, with members the alive members in this
// node's metric (itself included) and tags what their load tags allow,
// judged by averageUsable with p.
func makeAverageView(est gossipavg.View, lows []gossipavg.Entry, members int, p Params, tags tagRange, now time.Time) averageView {
	v := averageView{
		Average: est.Values[0], Size: math.Inf(1), Members: members, Lows: lows,
		Peers: est.Peers, Exchanges: est.Exchanges, LastExchange: est.LastExchange,
		Tags: tags, MeanSlack: meanSlack(p, tags.mean),
	}
	if est.Values[1] > 0 {
		v.Size = 1 / est.Values[1]
	}
	v.Used, v.Why = averageUsable(v, p.Freshness, now)
	v.Refused = !v.Used && refusedByTags(v)
	v.Clamped = v.Used && v.clampedAverage() != v.Average
	return v
}

// AveragedView returns the View a decision on in takes from a gossip
// average, and true, when the average is usable (the freshness rule of
// averageUsable); otherwise tags, the View of the members' load tags, and
// false. est and lows are what the node's gossipavg node says (Estimate
// and Lows, read before this step's input is set), members the alive
// members in its metric, itself included. The average and the size come
// from the averaging, the lowest member from its lowest-load entries
// (this node's own at in.Local, and not the member the lift rule leaves
// out, which the averaging cannot take out of the average), and the
// members not alive, in another metric or with an invalid tag as the tags
// count them (none of those averages with this node). The average must
// also agree with the load tags in in.Members (tagRangeOf; with none,
// as in the fleet simulation, that check does not apply). The
// rebalance app decides this way; it is exported for the fleet
// simulation.
func AveragedView(p Params, in Input, est gossipavg.View, lows []gossipavg.Entry, members int, tags View) (View, bool) {
	tr := tagRangeOf(p, in)
	avg := makeAverageView(est, lows, members, p, tr, in.Now)
	if !avg.Used {
		return tags, false
	}
	return avg.decisionView(in, tags), true
}

// decisionView is the View of a usable gossip average for a decision on
// in (AveragedView).
func (avg averageView) decisionView(in Input, tags View) View {
	v := View{
		Average: avg.clampedAverage(), Counted: int(math.Round(avg.Size)),
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
		if avg.Tags.ok && e.Load < avg.Tags.lo() {
			continue // below every tag: no member says so of itself
		}
		if e.Load < in.Local {
			v.Lowest, v.LowestName = e.Load, e.Name
		}
		break
	}
	return v
}

// averageUsable is the rule of the gossip average: the decision uses it
// when this node completed an exchange within freshness, the average
// lies within the range of the load tags (see tagRange; a member's
// estimates cannot take the decision beyond what the members publish of
// themselves, and a restart or a join still spreading waits until the
// average agrees with the tags again), and the size estimate is within sizeTolerance of the
// members serf lists in this node's metric (so the average covers the
// members serf sees: not while a join or a departure is still spreading,
// not while this node's messages do not get through, not while a member
// takes no part).
func averageUsable(v averageView, freshness time.Duration, now time.Time) (bool, string) {
	switch {
	case v.Members < 2:
		return false, "no other member in this metric"
	case v.LastExchange.IsZero():
		return false, "no exchange completed yet"
	case now.Sub(v.LastExchange) > freshness:
		return false, fmt.Sprintf("no exchange completed for %v (freshness %v)", now.Sub(v.LastExchange).Round(time.Millisecond), freshness)
	case math.Abs(v.Size-float64(v.Members)) > sizeTolerance*float64(v.Members):
		return false, fmt.Sprintf("estimated size %.1f is not within %.0f%% of the %d members in this metric", v.Size, sizeTolerance*100, v.Members)
	case v.Tags.ok && !(v.Average >= v.Tags.lo() && v.Average <= v.Tags.hi()): // NaN too
		return false, fmt.Sprintf("%s %.4g to %.4g", tagsRefuse, v.Tags.lo(), v.Tags.hi())
	}
	return true, ""
}

// The beginning of averageUsable's reason that says the tags refuse the
// average (refusedByTags).
const (
	tagsRefuse = "the average is outside what the members' load tags allow:"
)

// refusedByTags reports whether v's average is not used because the load
// tags refuse it.
func refusedByTags(v averageView) bool {
	return strings.HasPrefix(v.Why, tagsRefuse)
}

// tick starts this node's next exchange, if any.
func (a *averager) tick(now time.Time) {
	a.mu.Lock()
	if a.state == nil {
		a.mu.Unlock()
		return
	}
	m, ok := a.state.Tick(now, a.peers, a.rng)
	c, kind := a.cluster, a.kind
	a.mu.Unlock()
	if ok {
		a.send(c, kind, m)
	}
}

// receive handles a direct message of the averaging: it applies it and
// answers. A message whose sender is not the member it came from, or
// that does not decode, is dropped.
func (a *averager) receive(from string, payload []byte) {
	m, err := gossipavg.Decode(payload)
	if err != nil || m.From != from {
		if c := a.logger.Check(zap.DebugLevel, "dropped a gossip averaging message"); c != nil {
			c.Write(zap.String("from", from), zap.String("claimed", m.From), zap.Error(err))
		}
		return
	}
	a.mu.Lock()
	if a.state == nil {
		a.mu.Unlock()
		return
	}
	reply, ok, err := a.state.Receive(time.Now(), m)
	c, kind := a.cluster, a.kind
	a.mu.Unlock()
	if errors.Is(err, gossipavg.ErrOutOfBounds) {
		a.refused.Add(1)
	}
	if err != nil {
		if ce := a.logger.Check(zap.DebugLevel, "refused a gossip averaging message"); ce != nil {
			ce.Write(zap.String("from", from), zap.Error(err))
		}
		return
	}
	if ok {
		a.send(c, kind, reply)
	}
}

// send encodes m and sends it to its addressee. Delivery is best effort;
// the averaging retries what gets no answer.
func (a *averager) send(c *cluster.App, kind byte, m gossipavg.Message) {
	var buf [gossipavg.MaxMessageSize]byte
	b, err := m.AppendBinary(buf[:0])
	if err == nil {
		err = c.SendDirect(m.To, kind, b)
	}
	if err != nil {
		if ce := a.logger.Check(zap.DebugLevel, "sending a gossip averaging message"); ce != nil {
			ce.Write(zap.String("to", m.To), zap.Error(err))
		}
	}
}
