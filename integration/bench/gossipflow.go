package main

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/gossipavg"
	"github.com/caddy-lbx/lbx/internal/serfnet"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// The flow scheme of bench gossip: the members' loads are averaged by
// gossipavg (flow updating) over direct messages on the gossip socket
// (serfnet.Transport, as the app's members run it), instead of
// being flooded in serf tags. Each member sets its input every interval,
// as the tags scheme publishes, and exchanges with one peer every tick.

// flowKind is the direct-message kind the harness's exchanges use.
const flowKind byte = 1

// flowMember is one member's averaging state.
type flowMember struct {
	direct *serfnet.Transport
	peers  []string // every other member: the harness's membership does not change

	mu   sync.Mutex
	node *gossipavg.Node
	rng  *rand.Rand
}

// newFlowMember wraps the member's counting transport with the direct
// transport and makes its averaging node; conf is the serf config the
// member is about to be created with.
func newFlowMember(i int, run *gossipRun, conf *serf.Config, inner *countingTransport, cfg *gossipConfig) (*flowMember, error) {
	rng := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	node, err := gossipavg.New(shed.AverageConfig(conf.NodeName, cfg.interval, cfg.freshness), time.Now(), rng)
	if err != nil {
		return nil, err
	}
	f := &flowMember{direct: serfnet.NewTransport(inner, conf, zap.NewNop()), node: node, rng: rng}
	for name, j := range run.names {
		if j != i {
			f.peers = append(f.peers, name)
		}
	}
	slices.Sort(f.peers)
	return f, nil
}

// start delivers the member's direct messages and answers them.
func (f *flowMember) start(sf *serf.Serf) {
	f.direct.Handle(flowKind, func(from string, payload []byte) {
		m, err := gossipavg.Decode(payload)
		if err != nil || m.From != from {
			return
		}
		f.mu.Lock()
		reply, ok, err := f.node.Receive(time.Now(), m)
		f.mu.Unlock()
		if ok && err == nil {
			f.send(sf, reply)
		}
	})
	go f.direct.Deliver(sf)
}

// send encodes and sends one message to its addressee.
func (f *flowMember) send(sf *serf.Serf, m gossipavg.Message) {
	var buf [gossipavg.MaxMessageSize]byte
	b, err := m.AppendBinary(buf[:0])
	if err == nil {
		_ = f.direct.Send(sf, m.To, flowKind, b)
	}
}

// setLoad sets the member's input: its load, and the anchor indicator.
func (f *flowMember) setLoad(i int, load float64) {
	anchor := 0.0
	if i == 0 {
		anchor = 1
	}
	f.mu.Lock()
	_ = f.node.SetInput([]float64{load, anchor})
	f.mu.Unlock()
}

// tickLoop starts one exchange every tick until done.
func (f *flowMember) tickLoop(sf *serf.Serf, tick time.Duration, done <-chan struct{}) {
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		f.mu.Lock()
		m, ok := f.node.Tick(time.Now(), f.peers, f.rng)
		f.mu.Unlock()
		if ok {
			f.send(sf, m)
		}
	}
}

// flowView is what one member's averaging node says at a sample.
type flowView struct {
	average, size float64       // estimates of the cluster's average load and size
	lowest        string        // the lowest member it knows
	age           time.Duration // since the last completed exchange; -1: none yet
}

// view reads the member's estimates at now.
func (f *flowMember) view(now time.Time) flowView {
	f.mu.Lock()
	defer f.mu.Unlock()
	v := f.node.Estimate(now)
	out := flowView{average: v.Values[0], size: math.Inf(1), lowest: f.node.Lowest(now).Name, age: -1}
	if !v.LastExchange.IsZero() {
		out.age = max(0, now.Sub(v.LastExchange))
	}
	if v.Values[1] > 0 {
		out.size = 1 / v.Values[1]
	}
	return out
}

// sampleFlow returns, at now, each member's error of the cluster average
// and of the cluster size against the truth (in percent), the share of
// members that know the true lowest member (percent), and the mean time
// since each member's last completed exchange (ms; members that have not
// completed one yet are left out, NaN when none has).
func (run *gossipRun) sampleFlow(now time.Time) (avgErr, sizeErr []float64, lowestPct, ageMs float64) {
	truth := run.truth()
	var sum float64
	lowest := 0
	for j, l := range truth {
		sum += l
		if l < truth[lowest] {
			lowest = j
		}
	}
	trueAvg := sum / float64(run.n)
	lowName := run.nameOf(lowest)
	know, never := 0, 0
	var ageSum float64
	for _, m := range run.members {
		v := m.flow.view(now)
		if trueAvg > 0 {
			avgErr = append(avgErr, 100*math.Abs(v.average-trueAvg)/trueAvg)
		}
		sizeErr = append(sizeErr, 100*math.Abs(v.size-float64(run.n))/float64(run.n))
		if v.lowest == lowName {
			know++
		}
		if v.age < 0 {
			never++
			continue
		}
		ageSum += float64(v.age) / 1e6
	}
	age := math.NaN() // no member has exchanged yet
	if never < run.n {
		age = ageSum / float64(run.n-never)
	}
	return avgErr, sizeErr, 100 * float64(know) / float64(run.n), age
}
