package fleetsim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/integration/shedsim"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// simNode is one node of the simulated fleet.
type simNode struct {
	name     string
	conns    int
	window   *shed.Window
	shedding bool
	lift     shed.LiftState
	// report is what the others see: the smoothed load gossiped at the
	// end of the previous step, and when.
	report   float64
	reportAt time.Time
	dead     bool
	// unreachable nodes get no new connections (the outer balancer does
	// not send to them), though they are in the cluster.
	unreachable bool
	// status is how the others see the node (serf's status); a dead node
	// may still look alive until serf's failure detector notices.
	status cluster.MemberStatus
}

// simResult is the outcome of a simulation.
type simResult struct {
	steps     int    // steps run
	lastShed  int    // last step with a shed (-1: none)
	shed      int    // connections shed in total
	final     []int  // connections per node at the end
	dead      []bool // per node: killed
	avg       float64
	violation string // first conservation error, if any
}

// simulate runs the decision loop of every node over a fleet whose nodes
// hold conns[i] connections. Each step every live node samples its
// connections into its window, decides from the reports the others
// gossiped at the previous step (one interval of gossip lag), and sheds;
// every shed client reconnects to a node chosen uniformly at random among
// the live ones (the outer load balancer), possibly the one that shed it.
// kill, when non-nil, is called before each step and may mark nodes dead
// (their connections reconnect at once; their last report stays behind,
// the ghost). history is the window size in steps.
func simulate(p shed.Params, conns []int, history, maxSteps int, seed uint64, kill func(step int, nodes []*simNode) bool) simResult {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	interval := time.Second
	nodes := make([]*simNode, len(conns))
	total := 0
	for i, c := range conns {
		nodes[i] = &simNode{name: fmt.Sprintf("n%d", i), conns: c, window: shed.NewWindow(history)}
		total += c
	}
	res := simResult{lastShed: -1}
	reconnect := func(n int) {
		var live []*simNode
		for _, x := range nodes {
			if !x.dead && !x.unreachable {
				live = append(live, x)
			}
		}
		for range n {
			live[rng.IntN(len(live))].conns++
		}
	}
	for step := range maxSteps {
		now := t0.Add(time.Duration(step) * interval)
		if kill != nil && kill(step, nodes) {
			for _, x := range nodes {
				if x.dead && x.conns > 0 {
					c := x.conns
					x.conns = 0
					reconnect(c)
				}
			}
		}
		reports := make([]shed.Report, len(nodes))
		for i, x := range nodes {
			reports[i] = shed.Report{Name: x.name, Status: x.status, Load: x.report, At: x.reportAt}
		}
		shedNow := 0
		for _, x := range nodes {
			if x.dead {
				continue
			}
			local := x.window.Add(float64(x.conns))
			d := shed.Decide(p, shed.Input{Self: x.name, Local: local, Current: float64(x.conns), Held: x.conns, Members: reports, Shedding: x.shedding, Lift: x.lift, Now: now})
			x.shedding, x.lift = d.Shedding, d.Lift
			x.conns -= d.Shed
			shedNow += d.Shed
			x.report, x.reportAt = local, now
		}
		reconnect(shedNow)
		res.shed += shedNow
		if shedNow > 0 {
			res.lastShed = step
		}
		sum := 0
		for _, x := range nodes {
			sum += x.conns
		}
		if sum != total && res.violation == "" {
			res.violation = fmt.Sprintf("step %d: %d connections, want %d", step, sum, total)
		}
		res.steps = step + 1
	}
	live := 0
	for _, x := range nodes {
		res.final = append(res.final, x.conns)
		res.dead = append(res.dead, x.dead)
		if !x.dead {
			live++
		}
	}
	res.avg = float64(total) / float64(live)
	return res
}

// TestSimulateScaleOut is Piko's scenario: 3 nodes with 1000 connections
// each, 3 empty nodes join. Shed clients reconnect to a random node. For
// several seeds and smoothing windows it asserts that the fleet converges
// (no shed after a bounded number of steps), that connections are
// conserved, that the old nodes end at most at the stop band above the
// average and the new ones at most at it below (group means, with 2% of
// slack: a node that stopped still receives some of the clients the
// others shed), that every node ends within ±threshold (the lift rule
// brings up a new node that the random landings left low), and that the
// total shed is within 1.3× the ideal: the median shed count of a perfect
// rebalancer behind the same random balancer (shedsim.IdealSheds), about
// twice the connections that must move. Stopping at the trigger line
// instead is TestSimulateTriggerLine.
func TestSimulateScaleOut(t *testing.T) {
	p := DefaultParams()
	const maxSteps = 3000
	start := []int{1000, 1000, 1000, 0, 0, 0}
	ideal := shedsim.IdealSheds(start, p.Threshold, 201, 1)
	for _, history := range []int{1, 10, 60} {
		for seed := uint64(1); seed <= 5; seed++ {
			res := simulate(p, start, history, maxSteps, seed, nil)
			name := fmt.Sprintf("history %d seed %d", history, seed)
			if res.violation != "" {
				t.Fatalf("%s: %s", name, res.violation)
			}
			if res.lastShed < 0 || res.lastShed > 400 {
				t.Errorf("%s: last shed at step %d: did not converge within 400 steps", name, res.lastShed)
			}
			oldSum, newSum := res.final[0]+res.final[1]+res.final[2], res.final[3]+res.final[4]+res.final[5]
			oldMean, newMean := float64(oldSum)/3/res.avg, float64(newSum)/3/res.avg
			if oldMean > 1+p.EffectiveStopBand()+0.02 || newMean < 1-p.EffectiveStopBand()-0.02 {
				t.Errorf("%s: old nodes at %.3f×, new at %.3f× the average; want within ±%v%% (the stop band) + 2%%", name, oldMean, newMean, p.EffectiveStopBand()*100)
			}
			checkWithin(t, name, res, p.Threshold)
			ratio := float64(res.shed) / ideal
			t.Logf("%s: last shed at step %d; final %v (old %.3f×, new %.3f×); shed %d: %.3f× the ideal %.0f, %.3f× twice the moved count",
				name, res.lastShed, res.final, oldMean, newMean, res.shed, ratio, ideal, float64(res.shed)/float64(2*newSum))
			if ratio > 1.3 {
				t.Errorf("%s: shed %d is %.2f× the ideal %.0f; want ≤ 1.3×", name, res.shed, ratio, ideal)
			}
		}
	}
}

// checkWithin fails the test for every live node of res that ends outside
// ±threshold of the average.
func checkWithin(t *testing.T, name string, res simResult, threshold float64) {
	t.Helper()
	for i, c := range res.final {
		if c == 0 && res.dead[i] {
			continue
		}
		if dev := math.Abs(float64(c)-res.avg) / res.avg; dev > threshold {
			t.Errorf("%s: node %d ends with %d, %.0f%% off the average %.0f", name, i, c, dev*100, res.avg)
		}
	}
}

// TestSimulateShapes scales out by other shapes than doubling. With the
// high rule alone (before the lift rule existed), 10 → 11 nodes never
// shed (the old nodes sit at 1.1× the average, inside the threshold) and
// the new node stayed empty; 6 → 8 left the new nodes at 0.70×. The lift
// rule brings every node within ±threshold, within 1.3× the ideal shed
// count.
func TestSimulateShapes(t *testing.T) {
	p := DefaultParams()
	shapes := map[string][]int{
		"6 to 8":   {500, 500, 500, 500, 500, 500, 0, 0},
		"10 to 11": {1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 0},
		"2 to 3":   {300, 300, 0},
	}
	for name, start := range shapes {
		ideal := shedsim.IdealSheds(start, p.Threshold, 201, 1)
		for seed := uint64(1); seed <= 3; seed++ {
			res := simulate(p, start, 10, 3000, seed, nil)
			label := fmt.Sprintf("%s seed %d", name, seed)
			if res.violation != "" {
				t.Fatalf("%s: %s", label, res.violation)
			}
			if res.lastShed < 0 || res.lastShed > 600 {
				t.Errorf("%s: last shed at step %d", label, res.lastShed)
			}
			checkWithin(t, label, res, p.Threshold)
			ratio := float64(res.shed) / ideal
			t.Logf("%s: last shed at step %d; final %v; shed %d: %.3f× the ideal %.0f", label, res.lastShed, res.final, res.shed, ratio, ideal)
			if ratio > 1.3 {
				t.Errorf("%s: shed %d is %.2f× the ideal %.0f; want ≤ 1.3×", label, res.shed, ratio, ideal)
			}
		}
	}
}

// TestSimulateUnreachableMember: one of six nodes is in the cluster but
// gets no new connections (the outer balancer does not send to it), and
// its clients have left. The others sit at 1.2× the average, exactly on
// the threshold, and the lift rule would have them shed toward the
// average forever, their clients landing back on one of them. Once the
// member gains nothing for LiftPatience it is left out of the average for
// 10 × LiftPatience: over 1100 steps the cluster sheds a small fraction
// of what endless lifting sheds.
func TestSimulateUnreachableMember(t *testing.T) {
	p := DefaultParams()
	stuck := func(step int, nodes []*simNode) bool {
		if step == 0 {
			nodes[5].unreachable = true
		}
		return false
	}
	start := []int{600, 600, 600, 600, 600, 0}
	res := simulate(p, start, 10, 1100, 3, stuck)
	endless := p
	endless.LiftPatience = 1 << 62
	churn := simulate(endless, start, 10, 1100, 3, stuck)
	t.Logf("unreachable member: shed %d in 1100 steps (last at %d); without giving up: %d (last at %d)", res.shed, res.lastShed, churn.shed, churn.lastShed)
	if churn.lastShed < 1090 {
		t.Fatalf("without giving up, lifting stopped at step %d; this test's premise is endless churn", churn.lastShed)
	}
	if float64(res.shed) > 0.2*float64(churn.shed) {
		t.Errorf("shed %d; want at most 20%% of the endless %d", res.shed, churn.shed)
	}
}

// TestSimulateTriggerLine shows why the stop band matters: stopping at
// the trigger line leaves the new nodes near 0.8× the average (the issue's
// 1.2×/0.8× note); the default stop band (threshold/2) brings them to
// about 0.9×.
func TestSimulateTriggerLine(t *testing.T) {
	newMean := func(r simResult) float64 {
		return float64(r.final[3]+r.final[4]+r.final[5]) / 3 / r.avg
	}
	p := DefaultParams()
	hyst := simulate(p, []int{1000, 1000, 1000, 0, 0, 0}, 1, 3000, 7, nil)
	p.StopBand = p.Threshold
	trig := simulate(p, []int{1000, 1000, 1000, 0, 0, 0}, 1, 3000, 7, nil)
	t.Logf("new nodes' mean: %.3f× average with the stop band, %.3f× stopping at the trigger line; final %v vs %v",
		newMean(hyst), newMean(trig), hyst.final, trig.final)
	if m := newMean(trig); m > 0.82 {
		t.Errorf("trigger line: new nodes at %.3f× average; expected them stuck near 0.8×", m)
	}
	if m := newMean(hyst); m < 0.87 {
		t.Errorf("stop band: new nodes at %.3f× average; want about 0.9×", m)
	}
	for i, c := range trig.final[:3] {
		if float64(c) > 1.2*trig.avg+0.5 {
			t.Errorf("trigger line: old node %d at %d, above 1.2× average", i, c)
		}
	}
}

// TestSimulateGhost is Piko's issues #322 and #314: a node dies having
// reported no connections. If its stale report stayed in the average (a
// ghost), the three live nodes, each at the true average, would look 33%
// above it and shed forever, their clients landing back on one of them.
// Excluding failed members (serf's status) and silent ones (Freshness)
// stops that: with the dead node marked failed nothing is shed at all;
// while it still looks alive, shedding stops once its report is older
// than Freshness.
func TestSimulateGhost(t *testing.T) {
	p := DefaultParams()
	start := []int{1000, 1000, 1000, 0}
	dieAtStart := func(status cluster.MemberStatus) func(int, []*simNode) bool {
		return func(step int, nodes []*simNode) bool {
			if step == 0 {
				nodes[3].dead = true
				nodes[3].status = status
				nodes[3].reportAt = t0 // its last report: 0 connections
				return true
			}
			return false
		}
	}

	// Failed (or left): serf's status excludes it at once.
	for _, st := range []cluster.MemberStatus{cluster.StatusFailed, cluster.StatusLeft} {
		res := simulate(p, start, 1, 1000, 11, dieAtStart(st))
		if res.shed != 0 {
			t.Errorf("%v ghost: shed %d; want 0", st, res.shed)
		}
	}

	// Still listed as alive, but silent: excluded after Freshness.
	res := simulate(p, start, 1, 1000, 11, dieAtStart(cluster.StatusAlive))
	fresh := int(p.Freshness / time.Second)
	if res.lastShed > fresh {
		t.Errorf("silent ghost: still shedding at step %d; want none after step %d", res.lastShed, fresh)
	}
	t.Logf("silent ghost: shed %d connections, last at step %d (freshness %d steps)", res.shed, res.lastShed, fresh)

	// The Piko behaviour: a ghost that never goes stale.
	piko := p
	piko.Freshness = time.Duration(math.MaxInt64)
	res = simulate(piko, start, 1, 1000, 11, dieAtStart(cluster.StatusAlive))
	if res.lastShed < 990 {
		t.Errorf("ghost counted forever: last shed at step %d; expected endless churn (this test's premise)", res.lastShed)
	}
	t.Logf("ghost counted forever (Piko): shed %d connections in 1000 steps, still shedding at the end", res.shed)
}

// TestSimulateKillMidway kills an old node in the middle of the scale-out:
// its clients reconnect at random, serf sees it as alive (a stale report)
// for 3 steps and then as failed. The survivors must still converge and
// stop shedding (no endless churn), every live node within ±threshold of
// the new average.
func TestSimulateKillMidway(t *testing.T) {
	p := DefaultParams()
	kill := func(step int, nodes []*simNode) bool {
		switch step {
		case 100:
			nodes[0].dead = true
			return true
		case 103:
			nodes[0].status = cluster.StatusFailed
		}
		return false
	}
	res := simulate(p, []int{1000, 1000, 1000, 0, 0, 0}, 10, 3000, 5, kill)
	if res.violation != "" {
		t.Fatal(res.violation)
	}
	if res.lastShed > 600 {
		t.Errorf("last shed at step %d: still churning", res.lastShed)
	}
	for i, c := range res.final[1:] {
		if dev := math.Abs(float64(c)-res.avg) / res.avg; dev > p.Threshold {
			t.Errorf("node %d ends with %d, %.0f%% off the average %.0f", i+1, c, dev*100, res.avg)
		}
	}
	t.Logf("killed node 0 at step 100: last shed at step %d; final %v (avg of 5 live %.0f); shed %d", res.lastShed, res.final, res.avg, res.shed)
}
