package rebalance

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/gossipavg"
	"github.com/caddy-lbx/lbx/internal/shed"
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
	cfg := shed.AverageConfig(name, s.interval, s.params.Freshness)
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
func (a *averager) step(name string, members []string, local float64, p shed.Params, tags shed.TagRange, now time.Time) shed.AverageView {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.state == nil {
		return shed.AverageView{Size: math.Inf(1), Members: len(members) + 1, Why: "the gossip averaging has not started", Tags: tags}
	}
	v := shed.MakeAverageView(a.state.Estimate(now), a.state.Lows(now, nil), len(members)+1, p, tags, now)
	// From now on average only with estimates the tags allow; the size
	// indicator's average is always within 0 and 1.
	var err error
	if tags.OK {
		err = a.state.SetBounds([]float64{tags.Lo(), 0}, []float64{tags.Hi(), 1})
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
