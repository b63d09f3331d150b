package gossipavg

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// The simulation: N nodes in synchronous rounds of simRound. Each round
// every running node ticks once (in a random order) and its request is
// sent; then the messages due this round are delivered in a random order,
// and replies go out at once. Every message is encoded and decoded,
// lost with probability loss, and delayed by 0 to maxDelay rounds.

// simRound is the time a round takes; testConfig's Freshness is 50
// rounds, its RetryTimeout 5.
const simRound = 100 * time.Millisecond

// simNode is one simulated member.
type simNode struct {
	name  string
	node  *Node
	input [2]float64 // load, anchor indicator
	// up: the node ticks and answers. A node that is not up stays in the
	// peer lists (serf would still see it alive).
	up bool
}

// sim is the simulated cluster.
type sim struct {
	t        testing.TB
	cfg      func(name string) Config
	rng      *rand.Rand
	round    int
	nodes    []*simNode
	byName   map[string]*simNode
	listed   []string       // the members, as serf would list them
	pos      map[string]int // a name's index in listed
	queue    [][]Message    // queue[r % len]: the messages due in round r
	loss     float64
	dup      float64 // probability that a message is also delivered a second time
	maxDelay int
	buf      []byte
	// staleReplies counts the replies delivered with an older version
	// than the receiver's own.
	staleReplies int
}

// newSim makes a cluster of n nodes named n0…, node i with load load(i)
// and anchor indicator 1 at node 0 only.
func newSim(t testing.TB, n int, seed uint64, load func(i int) float64) *sim {
	s := &sim{
		t:        t,
		cfg:      testConfig,
		rng:      rand.New(rand.NewPCG(seed, 42)),
		byName:   make(map[string]*simNode),
		pos:      make(map[string]int),
		maxDelay: 2,
	}
	for i := range n {
		sn := &simNode{name: fmt.Sprintf("n%d", i), up: true}
		sn.input = [2]float64{load(i), 0}
		if i == 0 {
			sn.input[1] = 1
		}
		s.nodes = append(s.nodes, sn)
		s.byName[sn.name] = sn
		s.pos[sn.name] = len(s.listed)
		s.listed = append(s.listed, sn.name)
		s.start(sn)
	}
	s.queue = make([][]Message, s.maxDelay+1)
	return s
}

// now is the current round's time.
func (s *sim) now() time.Time { return t0.Add(time.Duration(s.round) * simRound) }

// start (re)starts sn's node: a new incarnation, no state.
func (s *sim) start(sn *simNode) {
	n, err := New(s.cfg(sn.name), s.now(), rand.New(rand.NewPCG(s.rng.Uint64(), 0)))
	if err != nil {
		s.t.Fatal(err)
	}
	sn.node = n
	s.setInput(sn, sn.input[0])
}

// setInput sets sn's load.
func (s *sim) setInput(sn *simNode, load float64) {
	sn.input[0] = load
	if err := sn.node.SetInput(sn.input[:]); err != nil {
		s.t.Fatal(err)
	}
}

// step runs one round.
func (s *sim) step() {
	now := s.now()
	last := len(s.listed) - 1
	for _, i := range s.rng.Perm(len(s.nodes)) {
		sn := s.nodes[i]
		if !sn.up {
			continue
		}
		// The peer list without sn: swap it to the end, hide it, swap back.
		peers := s.listed
		j, listed := s.pos[sn.name]
		if listed {
			peers[j], peers[last] = peers[last], peers[j]
			peers = peers[:last]
		}
		m, ok := sn.node.Tick(now, peers, s.rng)
		if listed {
			s.listed[j], s.listed[last] = s.listed[last], s.listed[j]
		}
		if ok {
			s.send(m, false)
		}
	}
	slot := s.round % len(s.queue)
	s.rng.Shuffle(len(s.queue[slot]), func(i, j int) {
		s.queue[slot][i], s.queue[slot][j] = s.queue[slot][j], s.queue[slot][i]
	})
	for i := 0; i < len(s.queue[slot]); i++ { // replies due now join the queue
		s.deliver(now, s.queue[slot][i], false)
	}
	clear(s.queue[slot])
	s.queue[slot] = s.queue[slot][:0]
	s.round++
}

// send puts m through the wire and into the queue, or loses it;
// immediate sends it due this round without loss, as drain does.
func (s *sim) send(m Message, immediate bool) {
	b, err := m.AppendBinary(s.buf[:0])
	if err != nil {
		s.t.Fatalf("%s → %s: %v", m.From, m.To, err)
	}
	s.buf = b
	if m, err = Decode(b); err != nil {
		s.t.Fatalf("%s → %s: %v", m.From, m.To, err)
	}
	copies := 1
	if !immediate && s.rng.Float64() < s.dup {
		copies = 2
	}
	for range copies {
		if !immediate && s.rng.Float64() < s.loss {
			continue
		}
		d := 0
		if !immediate {
			d = s.rng.IntN(s.maxDelay + 1)
		}
		slot := (s.round + d) % len(s.queue)
		s.queue[slot] = append(s.queue[slot], m)
	}
}

// deliver hands m to its receiver, if up, and sends the reply (at once
// when immediate).
func (s *sim) deliver(now time.Time, m Message, immediate bool) {
	dst := s.byName[m.To]
	if dst == nil || !dst.up {
		return
	}
	if m.Kind == Reply {
		if p := dst.node.lookup(m.From); p != nil && p.inc == m.FromIncarnation && m.Version < p.stamp {
			s.staleReplies++
		}
	}
	r, ok, err := dst.node.Receive(now, m)
	if err != nil {
		s.t.Fatalf("round %d: %v", s.round, err)
	}
	if ok {
		s.send(r, immediate)
	}
}

// drain delivers every message in flight (and the replies to them)
// without loss, delay or ticks: afterwards every exchange that reached
// its responder has completed.
func (s *sim) drain() {
	now := s.now()
	for {
		var q []Message
		for k := range s.queue {
			q = append(q, s.queue[k]...)
			s.queue[k] = s.queue[k][:0]
		}
		if len(q) == 0 {
			return
		}
		for _, m := range q {
			s.deliver(now, m, true) // replies go to this round's slot
		}
	}
}

// up returns the running nodes.
func (s *sim) up() []*simNode {
	var up []*simNode
	for _, sn := range s.nodes {
		if sn.up {
			up = append(up, sn)
		}
	}
	return up
}

// average is the true average input k over the running nodes.
func (s *sim) average(k int) float64 {
	var sum float64
	up := s.up()
	for _, sn := range up {
		sum += sn.input[k]
	}
	return sum / float64(len(up))
}

// maxRelErr is the largest relative error of a running node's load
// estimate.
func (s *sim) maxRelErr() float64 { return s.maxRelErrIn(0) }

// maxRelErrIn is the largest relative error of a running node's
// estimate in dimension k.
func (s *sim) maxRelErrIn(k int) float64 {
	avg, now := s.average(k), s.now()
	var worst float64
	for _, sn := range s.up() {
		worst = max(worst, math.Abs(sn.node.Estimate(now).Values[k]-avg)/avg)
	}
	return worst
}

// massErr is the relative difference between the running nodes' load
// estimates and their loads, summed.
func (s *sim) massErr() float64 {
	var est, in float64
	for _, sn := range s.up() {
		est += sn.node.estimate()[0]
		in += sn.input[0]
	}
	return math.Abs(est-in) / in
}

// roundsTo runs rounds until the largest relative error has stayed below
// target for hold rounds, and returns the round at which it went below
// target for good; -1 if that did not happen within limit rounds.
func (s *sim) roundsTo(target float64, hold, limit int) int {
	below := -1
	for r := 1; r <= limit+hold; r++ {
		s.step()
		switch {
		case s.maxRelErr() >= target:
			below = -1
		case below < 0:
			below = r
		}
		if below > 0 && r-below >= hold {
			return below
		}
	}
	return -1
}

// uniformLoads returns loads drawn uniformly from [lo, hi).
func uniformLoads(seed uint64, lo, hi float64) func(int) float64 {
	rng := rand.New(rand.NewPCG(seed, 3))
	return func(int) float64 { return lo + rng.Float64()*(hi-lo) }
}

// freshRounds is testConfig's Freshness in rounds.
var freshRounds = int(testConfig("").Freshness / simRound)

// convergenceSeeds is how many clusters each cell of the convergence
// table averages over.
const convergenceSeeds = 3

func TestSimConvergenceTable(t *testing.T) {
	t.Parallel()
	sizes := []int{10, 100, 1000}
	if raceEnabled {
		sizes = []int{10, 100, 300}
	}
	const limit = 150
	type cell struct {
		delay int
		loss  float64
	}
	cells := []cell{{2, 0}, {2, 0.1}, {0, 0}, {0, 0.1}}
	rounds := map[[2]int]float64{}
	var table strings.Builder
	fmt.Fprintf(&table, "rounds until every node's load estimate is within 1%% of the average for good (10 rounds at least), mean of %d clusters:\n", convergenceSeeds)
	fmt.Fprintf(&table, "%6s %18s %18s %18s %18s\n", "N", "delay 0-2, no loss", "delay 0-2, 10% loss", "no delay, no loss", "no delay, 10% loss")
	for _, n := range sizes {
		fmt.Fprintf(&table, "%6d", n)
		for ci, c := range cells {
			var sum int
			for seed := range uint64(convergenceSeeds) {
				s := newSim(t, n, seed*1000+uint64(n), uniformLoads(seed*1000+uint64(n), 0, 1000))
				s.loss, s.maxDelay = c.loss, c.delay
				s.queue = make([][]Message, c.delay+1)
				r := s.roundsTo(0.01, 10, limit)
				if r < 0 {
					t.Fatalf("N=%d, %+v: not within 1%% for good after %d rounds (max error %.3g)", n, c, limit, s.maxRelErr())
				}
				sum += r
			}
			mean := float64(sum) / convergenceSeeds
			rounds[[2]int{n, ci}] = mean
			fmt.Fprintf(&table, " %18.1f", mean)
		}
		fmt.Fprintln(&table)
	}
	t.Log(table.String())
	// Rounds grow at most logarithmically: ten times the nodes (three
	// under the race detector) costs a few rounds more, not ten times as
	// many.
	for ci, c := range cells {
		small, large := rounds[[2]int{sizes[1], ci}], rounds[[2]int{sizes[2], ci}]
		if large > small+12 {
			t.Errorf("%+v: %.1f rounds at N=%d, %.1f at N=%d", c, large, sizes[2], small, sizes[1])
		}
	}
}

// drift changes the load of a tenth of the running nodes by up to ±1%.
// A node's estimate moves by its input's change at once: with loads up
// to twice the average, a change jolts that node's error by up to 2%.
func (s *sim) drift() {
	for _, sn := range s.up() {
		if s.rng.IntN(10) == 0 {
			s.setInput(sn, sn.input[0]*(1+0.02*(s.rng.Float64()-0.5)))
		}
	}
}

func TestSimLostUpdates(t *testing.T) {
	t.Parallel()
	s := newSim(t, 100, 1, uniformLoads(1, 0, 1000))
	s.loss = 0.1
	var worstMass, worstErr float64
	for r := 1; r <= 150; r++ {
		s.drift()
		s.step()
		if r > 60 {
			worstMass, worstErr = max(worstMass, s.massErr()), max(worstErr, s.maxRelErr())
		}
	}
	t.Logf("10%% loss, drifting loads, rounds 60-150: mass error up to %.3g, node error up to %.3g", worstMass, worstErr)
	if worstMass > 0.005 || worstErr > 0.05 {
		t.Fatalf("with 10%% loss the mass error reached %.3g, a node's error %.3g", worstMass, worstErr)
	}
	s.drain()
	lossy := s.massErr()
	// Without loss, every pair exchanges again: the lost replies' errors
	// are gone.
	s.loss = 0
	for range freshRounds {
		s.step()
	}
	s.drain()
	t.Logf("mass error after a drain: %.3g with loss, %.3g once every pair exchanged again", lossy, s.massErr())
	if e := s.massErr(); e > 1e-9 {
		t.Fatalf("mass error %.3g after every pair exchanged without loss", e)
	}
	if e := s.maxRelErr(); e > 0.001 {
		t.Fatalf("node error %.3g after %d rounds without loss", e, freshRounds)
	}
}

func TestSimReorderedAndDuplicatedMessages(t *testing.T) {
	t.Parallel()
	s := newSim(t, 50, 2, uniformLoads(2, 0, 1000))
	// Retries race the replies still in flight (a round trip takes up to
	// 4 rounds), and a tenth of the messages arrive twice.
	s.cfg = func(name string) Config {
		c := testConfig(name)
		c.RetryTimeout = 2 * simRound
		return c
	}
	for _, sn := range s.nodes {
		s.start(sn)
	}
	s.dup = 0.1
	for range 10 {
		for range 10 {
			s.drift()
			s.step()
		}
		s.drain()
		if e := s.massErr(); e > 1e-9 {
			t.Fatalf("round %d: mass error %.3g after a drain", s.round, e)
		}
	}
	t.Logf("%d stale replies delivered; node error %.3g", s.staleReplies, s.maxRelErr())
	if s.staleReplies == 0 {
		t.Fatal("no reply arrived after a newer one: the test tests nothing")
	}
	if e := s.maxRelErr(); e > 0.01 {
		t.Fatalf("node error %.3g", e)
	}
}

// heavyLoads gives node i, i ≥ 1, a load from 100 to 200, and node 1 a
// load of heavy.
func heavyLoads(seed uint64, heavy float64) func(int) float64 {
	u := uniformLoads(seed, 100, 200)
	return func(i int) float64 {
		if i == 1 {
			return heavy
		}
		return u(i)
	}
}

func TestSimSilentMemberMassLeaves(t *testing.T) {
	t.Parallel()
	s := newSim(t, 100, 3, heavyLoads(3, 2000))
	if r := s.roundsTo(0.01, 10, 100); r < 0 {
		t.Fatal("no convergence")
	}
	// Node 1 stops ticking and answering; it stays listed (serf still
	// sees it alive).
	silent := s.nodes[1]
	silent.up = false
	for range freshRounds / 2 {
		s.step()
	}
	if e := s.maxRelErr(); e < 0.05 {
		t.Fatalf("error %.3g half a Freshness after node 1 went silent: its mass should still be there", e)
	}
	r := s.roundsTo(0.01, 10, freshRounds/2+50)
	t.Logf("within 1%% of the survivors' average %d rounds after going silent (Freshness is %d rounds)", freshRounds/2+r, freshRounds)
	if r < 0 {
		t.Fatalf("error %.3g %d rounds after node 1 went silent", s.maxRelErr(), freshRounds+50)
	}
	for _, sn := range s.up() {
		if sn.node.lookup(silent.name) != nil {
			t.Fatalf("%s still holds a pair with the silent node", sn.name)
		}
	}
}

func TestSimRestartedMember(t *testing.T) {
	t.Parallel()
	s := newSim(t, 100, 4, heavyLoads(4, 2000))
	if r := s.roundsTo(0.01, 10, 100); r < 0 {
		t.Fatal("no convergence")
	}
	// Node 1 restarts: a new incarnation, request sequence numbers from 1
	// again, no pairs, and a new load. Its old estimate (near the
	// average) is gone, and with it the 1830 or so its flows handed out,
	// which the others must drop.
	restarted := s.nodes[1]
	restarted.input[0] = 150
	s.start(restarted)
	r := s.roundsTo(0.01, 10, freshRounds+50)
	t.Logf("within 1%% of the true average %d rounds after the restart (Freshness is %d rounds)", r, freshRounds)
	if r < 0 {
		t.Fatalf("error %.3g %d rounds after the restart", s.maxRelErr(), freshRounds+50)
	}
	s.drain()
	if e := s.massErr(); e > 1e-9 {
		t.Fatalf("mass error %.3g after a drain", e)
	}
}

func TestSimStepChange(t *testing.T) {
	t.Parallel()
	n := 1000
	if raceEnabled {
		n = 300
	}
	for _, tc := range []struct{ delay, limit int }{{0, 12}, {2, 35}} {
		s := newSim(t, n, 5, uniformLoads(5, 0, 1000))
		s.maxDelay = tc.delay
		s.queue = make([][]Message, tc.delay+1)
		if r := s.roundsTo(0.01, 10, 150); r < 0 {
			t.Fatal("no convergence")
		}
		for i, sn := range s.nodes {
			if i%2 == 0 {
				s.setInput(sn, sn.input[0]*0.9)
			}
		}
		jolt := s.maxRelErr()
		r := s.roundsTo(0.01, 10, 60)
		t.Logf("N=%d, delay up to %d rounds: half the nodes lose 10%% of their load: error %.3g at once, within 1%% again after %d rounds",
			n, tc.delay, jolt, r)
		if r < 0 || r > tc.limit {
			t.Fatalf("delay up to %d: error %.3g, %d rounds after the step", tc.delay, s.maxRelErr(), r)
		}
	}
}

func TestSimLowest(t *testing.T) {
	t.Parallel()
	sizes := []int{100, 1000}
	if raceEnabled {
		sizes = []int{100, 300}
	}
	for _, n := range sizes {
		s := newSim(t, n, 6, uniformLoads(6, 100, 1000))
		low, second := s.nodes[7], s.nodes[8]
		s.setInput(low, 10)
		s.setInput(second, 20)
		known := func(want *simNode) bool {
			for _, sn := range s.up() {
				if e := sn.node.Lowest(s.now()); e.Name != want.name || e.Load != want.input[0] {
					return false
				}
			}
			return true
		}
		r := 0
		for ; r < 60 && !known(low); r++ {
			s.step()
		}
		limit := 3*int(math.Ceil(math.Log2(float64(n)))) + 6
		t.Logf("N=%d: every node knows the lowest member after %d rounds (limit %d)", n, r, limit)
		if r > limit {
			t.Fatalf("N=%d: %d rounds until every node knows the lowest member", n, r)
		}
		for range 10 {
			s.step()
		}
		// Its load rises: the entry it sent last goes from every node
		// within Freshness.
		s.setInput(low, 5000)
		old := low.node.selfSeq - 1
		for range freshRounds {
			s.step()
		}
		for _, sn := range s.up() {
			if i := sn.node.findEntry(low.name); i >= 0 && sn.node.low[i].seq <= old {
				t.Fatalf("N=%d: %s still holds %s's old entry %+v after Freshness", n, sn.name, low.name, sn.node.low[i])
			}
		}
		if !known(second) {
			t.Fatalf("N=%d: not every node takes %s for the lowest after Freshness", n, second.name)
		}
	}
}

func TestSimNodeCount(t *testing.T) {
	t.Parallel()
	n := 1000
	if raceEnabled {
		n = 300
	}
	s := newSim(t, n, 7, uniformLoads(7, 0, 1000))
	// The anchor indicator is 1 at node 0, 0 elsewhere: its average is 1/N.
	below := -1
	var worst float64
	for r := 1; r <= 150; r++ {
		s.step()
		worst = 0
		for _, sn := range s.nodes {
			nHat := 1 / sn.node.Estimate(s.now()).Values[1]
			worst = max(worst, math.Abs(nHat-float64(n))/float64(n))
		}
		switch {
		case worst >= 0.05 || math.IsNaN(worst):
			below = -1
		case below < 0:
			below = r
		}
		if below > 0 && r-below >= 10 {
			break
		}
	}
	t.Logf("N=%d: every node's count estimate within 5%% after %d rounds (now within %.3g)", n, below, worst)
	if below < 0 || worst >= 0.05 {
		t.Fatalf("N=%d: a count estimate is %.3g off", n, worst)
	}
}

func TestSimDeterministic(t *testing.T) {
	t.Parallel()
	run := func() []View {
		s := newSim(t, 50, 8, uniformLoads(8, 0, 1000))
		s.loss = 0.1
		for range 40 {
			s.drift()
			s.step()
		}
		var views []View
		for _, sn := range s.nodes {
			views = append(views, sn.node.Estimate(s.now()))
		}
		return views
	}
	a, b := run(), run()
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("node %d: %+v, then %+v", i, a[i], b[i])
		}
	}
}

// join adds a running node named n<i>, i the number of nodes made so
// far, with load load.
func (s *sim) join(load float64) *simNode {
	sn := &simNode{name: fmt.Sprintf("n%d", len(s.nodes)), up: true}
	sn.input[0] = load
	s.nodes = append(s.nodes, sn)
	s.byName[sn.name] = sn
	s.pos[sn.name] = len(s.listed)
	s.listed = append(s.listed, sn.name)
	s.start(sn)
	return sn
}

// lowestLoad is the lowest load of a running node.
func (s *sim) lowestLoad() float64 {
	low := math.Inf(1)
	for _, sn := range s.up() {
		low = min(low, sn.input[0])
	}
	return low
}

// TestSimMassJoinLowest: a tenth more nodes join with load 0, and every
// 5 rounds their loads rise while the others' fall, as when the
// rebalancer fills them. With fleetsim's settings (5 ticks an interval,
// Freshness 5 intervals), from 15 rounds after the join on, in every
// round, 99% of the nodes must know, as the lowest member, another one
// whose entry is at most 16 rounds old (Freshness is 25) and whose load
// is within 5% of the average of the true lowest load, or be within that
// of the lowest themselves. With entries ranked by load alone, the
// joiners' first entries (load 0) outranked their newer ones everywhere,
// so the lowest-load entries known were up to Freshness old, and when
// they expired together most nodes knew no joiner at all.
func TestSimMassJoinLowest(t *testing.T) {
	t.Parallel()
	n := 1000
	if raceEnabled {
		n = 300
	}
	const (
		interval = 5   // rounds between two load changes
		settle   = 15  // rounds after the join before the checks
		rounds   = 100 // rounds after the join: four Freshness
		maxAge   = 16 * simRound
	)
	s := newSim(t, 0, 9, nil)
	s.cfg = func(name string) Config {
		c := testConfig(name)
		c.Freshness, c.RetryTimeout = 25*simRound, simRound/2
		return c
	}
	s.maxDelay = 0
	s.queue = make([][]Message, 1)
	loads := uniformLoads(9, 900, 1100)
	for range n {
		s.join(loads(0))
	}
	for range 30 {
		s.step()
	}
	olds := s.nodes
	var joined []*simNode
	for range n / 10 {
		joined = append(joined, s.join(0))
	}
	worst, worstRound, failed := 1.0, 0, 0
	var worstLog string
	for r := range rounds {
		if r > 0 && r%interval == 0 {
			var rise float64
			for _, sn := range joined {
				d := 20 * s.rng.Float64()
				rise += d
				s.setInput(sn, sn.input[0]+d)
			}
			for _, sn := range olds {
				s.setInput(sn, max(0, sn.input[0]-2*rise/float64(len(olds))*s.rng.Float64()))
			}
		}
		s.step()
		if r < settle {
			continue
		}
		now, low, margin := s.now(), s.lowestLoad(), 0.05*s.average(0)
		good, self := 0, 0
		var ages, offs []float64
		for _, sn := range s.nodes {
			e := sn.node.Lowest(now)
			age := time.Duration(e.AgeMillis) * time.Millisecond
			if e.Name == sn.name {
				self++
				if e.Load <= low+margin {
					good++
				}
				continue
			}
			ages = append(ages, float64(age)/float64(simRound))
			offs = append(offs, e.Load-low)
			if age <= maxAge && math.Abs(e.Load-low) <= margin {
				good++
			}
		}
		frac := float64(good) / float64(len(s.nodes))
		if frac < 0.99 {
			failed++
		}
		if r == settle || frac < worst {
			worst, worstRound = frac, r
			worstLog = fmt.Sprintf("lowest load %.1f; %d nodes name themselves; the others' entries: age in rounds %s, load minus the lowest %s",
				low, self, quantiles(ages), quantiles(offs))
		}
	}
	t.Logf("N=%d+%d: worst round %d after the join, %.1f%% of the nodes right: %s", n, n/10, worstRound, 100*worst, worstLog)
	if failed > 0 {
		t.Fatalf("in %d of %d rounds, fewer than 99%% of the nodes knew a current lowest member (worst: %.1f%%, round %d after the join)",
			failed, rounds-settle, 100*worst, worstRound)
	}
}

// quantiles formats the least, median, 99th percentile and largest of x
// (which it sorts).
func quantiles(x []float64) string {
	if len(x) == 0 {
		return "none"
	}
	slices.Sort(x)
	return fmt.Sprintf("%.1f/%.1f/%.1f/%.1f (min/median/p99/max)", x[0], x[len(x)/2], x[min(len(x)-1, len(x)*99/100)], x[len(x)-1])
}
