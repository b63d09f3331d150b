package fleet

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/caddy-lbx/lbx/integration/shedsim"
)

// RollingRestart is issue 15's rolling restart, a Caddy upgrade done one
// node at a time: Nodes nodes under long-lived clients behind the outer
// balancer (Front), converged; then each node in turn is drained as the
// operations guide says (out of the balancer, then SIGTERM: Fleet.Stop),
// stays down for Down, is started again on its ports (Fleet.Restart), and
// the fleet refills it before the next node goes.
type RollingRestart struct {
	// Bin is a cmd/caddy binary; Dir a directory for the nodes' files.
	Bin, Dir string
	// Nodes is the fleet's size. Default: 6.
	Nodes int
	// Clients is the number of long-lived clients; each sends a request
	// every Every.
	Clients int
	Every   time.Duration
	// Down is how long a node stays stopped (a binary swap, a host
	// reboot). Default: 2s.
	Down time.Duration
	// Settings are every node's rebalance settings.
	Settings Settings
	// Converge bounds each wait for the fleet to converge.
	Converge time.Duration
	// Logf, when set, reports progress.
	Logf func(format string, args ...any)
	// Front is the outer balancer, one of FrontNames (empty: random); the
	// ideal is simulated behind the matching shedsim balancer.
	Front string
	// StartLoad, when set, starts the Clients clients instead of
	// StartClients (a NoRetry load, say).
	StartLoad func(addr string) (Load, error)
}

// RestartResult is what one node's restart measured.
type RestartResult struct {
	Node string
	// Held is the connections it held when it was drained.
	Held int
	// Drained is from Stop to the process's exit.
	Drained time.Duration
	// Stopped is when its drain began, Started when it was started
	// again.
	Stopped, Started time.Time
	// ShedWhileDown is what the other nodes shed from the drain to the
	// restart: nothing is uneven then, so nothing should be.
	ShedWhileDown int
	// Refilled is from the restart to the fleet settled again (every node
	// within ±threshold, none shedding, nothing shed for 2 s).
	Refilled time.Duration
	// Shed is what the fleet shed from the restart to Refilled, and Ideal
	// the median of a perfect rebalancer's count behind the same kind of
	// balancer from the fleet as it was at the restart (this node empty).
	Shed  int
	Ideal float64
	// Failed are the requests that failed from the drain to Refilled.
	Failed []ClientError
}

// RollingResult is what a RollingRestart run measured.
type RollingResult struct {
	// Before is every node's connections once the clients were all
	// connected.
	Before []int
	// Restarts are the nodes' restarts, in order.
	Restarts []RestartResult
	// Requests and Errors are the clients' totals over the whole run.
	Requests int
	Errors   []ClientError
	Timeline *Timeline
}

func (rr RollingRestart) logf(format string, args ...any) {
	if rr.Logf != nil {
		rr.Logf(format, args...)
	}
}

// Run runs the rolling restart. It stops every process it started before
// it returns; on error the result holds what was measured so far.
func (rr RollingRestart) Run() (res *RollingResult, err error) {
	res = &RollingResult{}
	size := cmp.Or(rr.Nodes, 6)
	down := cmp.Or(rr.Down, 2*time.Second)
	band := rr.Settings.Threshold / 100
	f, err := New(rr.Bin, rr.Dir, rr.Front, rr.Settings, 250*time.Millisecond)
	if err != nil {
		return res, err
	}
	res.Timeline = f.Timeline
	var clients Load
	defer func() {
		if clients != nil {
			res.Requests, res.Errors, _ = clients.Stats()
			clients.Close()
		}
		if cerr := f.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	for i := range size {
		if _, err := f.AddNode(fmt.Sprintf("n%d", i+1), true); err != nil {
			return res, err
		}
	}
	if err := f.waitAlive(size); err != nil {
		return res, err
	}
	if clients, err = startLoad(rr.StartLoad, f.Front.Addr(), rr.Clients, rr.Every); err != nil {
		return res, err
	}
	s, err := f.waitSettled(rr.Converge, rr.Clients, band, fmt.Sprintf("%d nodes", size))
	if err != nil {
		return res, err
	}
	res.Before = s.Held()
	f.Timeline.Mark(fmt.Sprintf("%d nodes", size))
	rr.logf("%d nodes: %v connections", size, res.Before)

	for _, n := range f.Nodes() {
		r := RestartResult{Node: n.Name}
		before, err := f.answering()
		if err != nil {
			return res, err
		}
		r.Held = heldBy(before, n.Name)
		_, errsBefore, _ := clients.Stats()
		f.Timeline.Mark("drain " + n.Name)
		t0 := time.Now()
		r.Stopped = t0
		if err := f.Stop(n, 30*time.Second); err != nil {
			return res, err
		}
		r.Drained = time.Since(t0)
		time.Sleep(down - min(r.Drained, down))
		stopped, err := f.answering()
		if err != nil {
			return res, err
		}
		r.ShedWhileDown = shedSince(before, stopped)
		f.Timeline.Mark("restart " + n.Name)
		r.Started = time.Now()
		if err := f.Restart(n); err != nil {
			return res, err
		}
		back, err := f.answering()
		if err != nil {
			return res, err
		}
		r.Ideal = shedsim.IdealShedsFor(back.Held(), band, 201, 1, IdealBalancer(rr.Front))
		tBack := time.Now()
		settled, err := f.waitSettled(rr.Converge, rr.Clients, band, fmt.Sprintf("the fleet refilling %s", n.Name))
		if err != nil {
			return res, err
		}
		r.Refilled = time.Since(tBack)
		r.Shed = shedSince(back, settled)
		_, errs, _ := clients.Stats()
		r.Failed = errs[len(errsBefore):]
		res.Restarts = append(res.Restarts, r)
		rr.logf("%s: held %d, drained in %v, %d shed while down, refilled in %v shedding %d (ideal %.0f), %d failed requests",
			n.Name, r.Held, r.Drained.Round(time.Millisecond), r.ShedWhileDown, r.Refilled.Round(time.Millisecond), r.Shed, r.Ideal, len(r.Failed))
	}
	f.Timeline.Mark("done")
	return res, nil
}

// answering returns a snapshot in which every live node answered,
// waiting up to 10 s for one.
func (f *Fleet) answering() (Snapshot, error) {
	return f.WaitFor(10*time.Second, "every node answering", func(Snapshot) (bool, string) { return true, "" })
}

// heldBy returns what the node named name holds in s (0 when absent).
func heldBy(s Snapshot, name string) int {
	if i := slices.IndexFunc(s.Nodes, func(n *Node) bool { return n.Name == name }); i >= 0 {
		return max(s.Views[i].Held(), 0)
	}
	return 0
}

// shedSince returns what the nodes live in both snapshots shed between
// them. A node's count is its process's: one restarted in between
// started again from 0, and its count at the later snapshot is all new.
func shedSince(from, to Snapshot) int {
	total := 0
	for i, n := range to.Nodes {
		now := to.Views[i].Shed()
		if j := slices.Index(from.Nodes, n); j >= 0 && from.Views[j].Shed() <= now {
			now -= from.Views[j].Shed()
		}
		total += now
	}
	return total
}
