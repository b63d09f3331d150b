package fleet

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-lbx/lbx/integration/shedsim"
)

// ScaleOut is the rebalance acceptance run (issue 5): a fleet scales out
// from 3 to 6 nodes (From to 2 × From) under long-lived clients, a node with the wrong
// gossip key tries to join, then 2 more nodes join and, while the fleet
// rebalances, one node is reloaded through its admin API and another is
// killed with SIGKILL.
type ScaleOut struct {
	// Bin is a cmd/caddy binary; Dir a directory for the nodes' files.
	Bin, Dir string
	// Clients is the number of long-lived clients; each sends a request
	// every Every.
	Clients int
	Every   time.Duration
	// Settings are every node's rebalance settings.
	Settings Settings
	// Converge bounds each wait for the fleet to converge.
	Converge time.Duration
	// Logf, when set, reports progress.
	Logf func(format string, args ...any)
	// From is the nodes the fleet starts with; phase 1 doubles it and
	// phase 2 adds two more. Default: 3.
	From int
	// Front is the outer balancer, one of FrontNames (empty: random); the
	// ideal is simulated behind the matching shedsim balancer.
	Front string
	// StartLoad, when set, starts the Clients clients instead of
	// StartClients (a NoRetry load, say).
	StartLoad func(addr string) (Load, error)
	// Phase1Only ends the run after phase 1 (From → 2 × From nodes).
	Phase1Only bool
}

// ScaleOutResult is what a ScaleOut run measured.
type ScaleOutResult struct {
	Clients int
	// Phase 1, From → 2 × From nodes (3 → 6 by default).
	Before, After []int // connections per node before the new nodes joined, and once converged
	// Joined is when every node saw all the members alive, and Converged when
	// every node was within ±threshold and none was shedding, both from
	// the moment the first new node started.
	Joined, Converged time.Duration
	// Shed is the connections shed until Converged; Moved the
	// connections the old nodes lost; Ideal the median shed count of a
	// perfect rebalancer behind the same kind of balancer (shedsim), and
	// IdealP99 its 99th percentile over the simulated runs.
	Shed, Moved     int
	Ideal, IdealP99 float64
	// Reconnections are the connections the clients opened after the
	// first Clients, as of the end of phase 1: one per connection shed by
	// then, ShedAtEnd (a node may still shed one after Converged).
	Reconnections, ShedAtEnd int
	// Requests, Errors and Retried are the clients' totals for phase 1.
	Requests int
	Errors   []ClientError
	Retried  int

	// WrongKey is the node that tried to join with another gossip key.
	WrongKey struct {
		JoinError string   // its own admin view's join_error
		Alive     int      // alive members it sees (itself: 1)
		SeenBy    []string // nodes that listed it as a member (none)
	}

	// Phase 2, 6 → 8 nodes with a reload and a kill.
	Reload struct {
		Node string
		// Start is when the POST /load went out, End when it returned
		// (the old config stopped).
		Start, End time.Time
		// NotAlive lists every sighting of the node in another status
		// than alive by another node during the reload (none).
		NotAlive []string
		// Rejoins counts join, leave and failure events for the node in
		// the seed node's log after the reload (none; Joins counts its
		// join events before, at least the first join, which shows the
		// log says what the count looks for), and BindErrors "address
		// already in use" in its own log (none).
		Rejoins, Joins, BindErrors int
		// Reused is true when the reloaded config took over the running
		// serf member (its log says reused_member true).
		Reused bool
		// TagSeen is how long after the reload every other node saw the
		// node's new tag; DecidedAfter whether its decision loop ran on
		// after the reload; ShedBefore and ShedAfter are the fleet's
		// shed totals when the reload started and 2 s after it.
		TagSeen                 time.Duration
		DecidedAfter            bool
		ShedBefore, ShedAfter   int
		ActiveAtReload          bool
		ConnectionsBeforeReload int
	}
	Kill struct {
		Node string
		// At is when the SIGKILL was sent.
		At time.Time
		// HeldAtKill is what the node held when it was killed, and
		// ActiveAtKill whether the fleet was shedding then.
		HeldAtKill   int
		ActiveAtKill bool
		// Excluded is when no survivor counted it in its average any
		// more, MarkedFailed when every survivor's serf marked it failed,
		// Stable when the survivors were converged, not shedding, and
		// had shed nothing for 2 s; all from the kill.
		Excluded, MarkedFailed, Stable time.Duration
		Final                          []int
		// ShedAfter is the connections shed from the kill to Stable;
		// ErrorsAfter the requests that failed from the kill on.
		ShedAfter, ErrorsAfter int
	}
	// Phase2Requests and Phase2Errors are the clients' totals for phase 2.
	Phase2Requests int
	Phase2Errors   []ClientError

	Timeline *Timeline
}

// reloadLossWindow is how long after the reload's POST /load returned a
// failure on a new connection still counts as the reload's: the client
// records it when its request returns, which a loaded machine delays.
const reloadLossWindow = time.Second

// Phase2Split sorts the phase-2 failures into those at the reload, those
// from the kill on, and the rest. A failure at the reload is a reset
// (ClientError.ReloadReset) between the reload's start and
// reloadLossWindow after its end: Linux resets the connections still
// queued on the old SO_REUSEPORT socket when it closes. The requests Go's
// http.Server would drop because it read them after its Shutdown began
// (EOF), lbx_handoff serves with the new config: such a failure is one of
// the rest (docs/handoff.md).
func (r *ScaleOutResult) Phase2Split() (atReload, afterKill, others []ClientError) {
	for _, e := range r.Phase2Errors {
		switch {
		case !r.Kill.At.IsZero() && !e.At.Before(r.Kill.At):
			afterKill = append(afterKill, e)
		case e.ReloadReset() && !e.At.Before(r.Reload.Start) && !e.At.After(r.Reload.End.Add(reloadLossWindow)):
			atReload = append(atReload, e)
		default:
			others = append(others, e)
		}
	}
	return atReload, afterKill, others
}

func (so ScaleOut) logf(format string, args ...any) {
	if so.Logf != nil {
		so.Logf(format, args...)
	}
}

// Run runs the scale-out. It stops every process it started before it
// returns; on error the result holds what was measured so far.
func (so ScaleOut) Run() (res *ScaleOutResult, err error) {
	res = &ScaleOutResult{Clients: so.Clients}
	f, err := New(so.Bin, so.Dir, so.Front, so.Settings, 250*time.Millisecond)
	if err != nil {
		return res, err
	}
	res.Timeline = f.Timeline
	var clients Load
	defer func() {
		if clients != nil {
			clients.Close()
		}
		if cerr := f.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	threshold := so.Settings.Threshold / 100
	from := cmp.Or(so.From, 3)

	for i := range from {
		if _, err := f.AddNode(fmt.Sprintf("n%d", i+1), true); err != nil {
			return res, err
		}
	}
	if err := f.waitAlive(from); err != nil {
		return res, err
	}
	f.Timeline.Mark(fmt.Sprintf("%d nodes", from))
	if clients, err = startLoad(so.StartLoad, f.Front.Addr(), so.Clients, so.Every); err != nil {
		return res, err
	}
	s, err := f.WaitFor(60*time.Second, "every client connected", func(s Snapshot) (bool, string) {
		_, errs, _ := clients.Stats()
		return s.Total() == so.Clients && clients.Opened() >= int64(so.Clients),
			fmt.Sprintf("%d held, %d connects, %d failed requests (last: %v)", s.Total(), clients.Opened(), len(errs), errs[max(len(errs)-3, 0):])
	})
	if err != nil {
		return res, err
	}
	res.Before = s.Held()
	so.logf("%d nodes: %v connections", from, res.Before)

	// Phase 1: as many nodes again, and one with the wrong key.
	t0 := time.Now()
	f.Timeline.Mark(fmt.Sprintf("n%d-n%d join", from+1, 2*from))
	for i := from; i < 2*from; i++ {
		if _, err := f.AddNode(fmt.Sprintf("n%d", i+1), true); err != nil {
			return res, err
		}
	}
	intruderSpec := f.Spec("intruder")
	intruderSpec.Key = NewKey()
	intruder, err := f.AddNode("intruder", false, intruderSpec)
	if err != nil {
		return res, err
	}
	if err := f.waitAlive(2 * from); err != nil {
		return res, err
	}
	res.Joined = time.Since(t0)
	s, err = f.WaitFor(so.Converge, fmt.Sprintf("%d nodes converged", 2*from), func(s Snapshot) (bool, string) {
		return s.Total() == so.Clients && !s.Active() && s.Within(so.Clients, threshold), ""
	})
	if err != nil {
		return res, err
	}
	res.Converged = time.Since(t0)
	res.After, res.Shed = s.Held(), s.Shed()
	for i := range from {
		res.Moved += res.Before[i] - res.After[i]
	}
	sheds := shedsim.ShedsFor(append(slices.Clone(res.Before), make([]int, from)...), threshold, 201, 1, IdealBalancer(so.Front))
	res.Ideal, res.IdealP99 = float64(sheds[100]), float64(sheds[198])
	f.Timeline.Mark("converged")
	so.logf("%d nodes after %v: %v; shed %d to move %d (ideal %.0f)", 2*from, res.Converged.Round(time.Millisecond), res.After, res.Shed, res.Moved, res.Ideal)
	// Every shed connection comes back as one reconnection.
	deadline := time.Now().Add(5 * time.Second)
	for {
		res.Reconnections = int(clients.Opened()) - so.Clients
		res.ShedAtEnd = f.Snapshot().Shed()
		if res.Reconnections == res.ShedAtEnd || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	res.Requests, res.Errors, res.Retried = clients.Stats()

	// The intruder: never a member, with a clear error.
	iv, err := intruder.View()
	if err != nil {
		return res, err
	}
	res.WrongKey.JoinError, res.WrongKey.Alive = iv.JoinError, iv.Alive()
	for i, v := range f.Snapshot().Views {
		if _, _, _, ok := v.Member("intruder"); ok {
			res.WrongKey.SeenBy = append(res.WrongKey.SeenBy, f.Nodes()[i].Name)
		}
	}
	if err := intruder.Proc.Kill(); err != nil {
		return res, err
	}
	if so.Phase1Only {
		return res, nil
	}

	// Phase 2: two more nodes; a reload and a kill while they fill.
	reqsBefore, errsBefore, _ := clients.Stats()
	f.Timeline.Mark(fmt.Sprintf("n%d, n%d join", 2*from+1, 2*from+2))
	for i := 2 * from; i < 2*from+2; i++ {
		if _, err := f.AddNode(fmt.Sprintf("n%d", i+1), true); err != nil {
			return res, err
		}
	}
	if err := f.waitAlive(2*from + 2); err != nil {
		return res, err
	}
	if err := so.reload(f, res); err != nil {
		return res, err
	}
	if err := so.kill(f, res, clients); err != nil {
		return res, err
	}
	reqs, errs, _ := clients.Stats()
	res.Phase2Requests, res.Phase2Errors = reqs-reqsBefore, errs[len(errsBefore):]
	return res, nil
}

// startLoad starts the clients of a run: start's, or n Clients.
func startLoad(start func(addr string) (Load, error), addr string, n int, every time.Duration) (Load, error) {
	if start != nil {
		return start(addr)
	}
	return StartClients(addr, n, every), nil
}

// settledFor is how long the fleet must shed nothing, converged, to be
// settled (waitSettled).
const settledFor = 2 * time.Second

// waitSettled waits up to timeout until the live nodes hold all clients'
// connections, each within ±band of the average, none is in a shedding
// phase, and nothing was shed for settledFor. who names the nodes in the
// error.
func (f *Fleet) waitSettled(timeout time.Duration, clients int, band float64, who string) (Snapshot, error) {
	prev, stable := -1, time.Now()
	return f.WaitFor(timeout, who+" converged and not shedding for "+settledFor.String(), func(s Snapshot) (bool, string) {
		ok := s.Total() == clients && !s.Active() && s.Within(clients, band)
		if !ok || s.Shed() != prev {
			prev, stable = s.Shed(), time.Now()
			return false, ""
		}
		return time.Since(stable) >= settledFor, "stable for " + time.Since(stable).String()
	})
}

// waitAlive waits until every live node sees want alive members.
func (f *Fleet) waitAlive(want int) error {
	_, err := f.WaitFor(30*time.Second, fmt.Sprintf("%d alive members on every node", want), func(s Snapshot) (bool, string) {
		for i, v := range s.Views {
			if v.Alive() != want {
				return false, fmt.Sprintf("%s sees %d alive", s.Nodes[i].Name, v.Alive())
			}
		}
		return true, ""
	})
	return err
}

// reload reloads n3, an old node, through its admin API with a new tag
// while the fleet rebalances, watching the other nodes' view of it.
func (so ScaleOut) reload(f *Fleet, res *ScaleOutResult) error {
	nodes := f.Nodes()
	target, seed := nodes[2], nodes[0]
	r := &res.Reload
	r.Node = target.Name
	s, err := f.WaitFor(10*time.Second, "the fleet shedding before the reload", func(s Snapshot) (bool, string) {
		return s.Active(), ""
	})
	r.ActiveAtReload = err == nil
	r.ShedBefore = s.Shed()
	if v, err := target.View(); err == nil {
		r.ConnectionsBeforeReload = v.Held()
	}
	stop := make(chan struct{})
	var watch sync.WaitGroup
	var mu sync.Mutex
	watch.Go(func() {
		for {
			for _, n := range f.Nodes() {
				if n == target {
					continue
				}
				v, err := n.View()
				if err != nil {
					continue
				}
				if st, _, _, ok := v.Member(target.Name); !ok || st != "alive" {
					mu.Lock()
					r.NotAlive = append(r.NotAlive, fmt.Sprintf("%s saw %s %q", n.Name, target.Name, st))
					mu.Unlock()
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	})
	seedLogBefore := len(seed.Proc.Log())
	spec := target.Spec
	spec.Tags = map[string]string{"zone": "b"}
	f.Timeline.Mark("reload " + target.Name)
	tReload := time.Now()
	so.logf("reloading %s (fleet shedding: %v, %d connections on it)", target.Name, r.ActiveAtReload, r.ConnectionsBeforeReload)
	r.Start = tReload
	loadErr := target.Reload(spec)
	r.End = time.Now()
	if loadErr == nil {
		_, loadErr = f.WaitFor(10*time.Second, "every node sees "+target.Name+"'s new tag", func(s Snapshot) (bool, string) {
			for i, v := range s.Views {
				if s.Nodes[i] == target {
					continue
				}
				if _, _, tags, _ := v.Member(target.Name); tags["zone"] != "b" {
					return false, s.Nodes[i].Name + " does not"
				}
			}
			return true, ""
		})
		r.TagSeen = time.Since(tReload)
	}
	if loadErr == nil {
		_, loadErr = f.WaitFor(5*time.Second, target.Name+" deciding after the reload", func(s Snapshot) (bool, string) {
			for i, v := range s.Views {
				if s.Nodes[i] == target {
					return v.Decision.At.After(tReload), v.Decision.At.String()
				}
			}
			return false, "not in the snapshot"
		})
		r.DecidedAfter = loadErr == nil
	}
	if loadErr == nil {
		time.Sleep(2*time.Second - time.Since(tReload)) // the fleet sheds on meanwhile
		r.ShedAfter = f.Snapshot().Shed()
	}
	close(stop)
	watch.Wait()
	if loadErr != nil {
		return fmt.Errorf("reloading %s: %v", target.Name, loadErr)
	}
	seedLog := seed.Proc.Log()
	joinEvent := "EventMemberJoin: " + target.Name + " "
	r.Joins = strings.Count(seedLog[:seedLogBefore], joinEvent)
	for _, ev := range []string{joinEvent, "EventMemberLeave: " + target.Name + " ", "EventMemberFailed: " + target.Name + " "} {
		r.Rejoins += strings.Count(seedLog[seedLogBefore:], ev)
	}
	log := target.Proc.Log()
	r.BindErrors = strings.Count(log, "address already in use")
	r.Reused = strings.Count(log, `"reused_member":true`) > 0
	so.logf("reload: tag seen after %v, fleet shed %d -> %d, %d not-alive sightings, %d rejoin events, %d bind errors, reused member %v",
		r.TagSeen.Round(time.Millisecond), r.ShedBefore, r.ShedAfter, len(r.NotAlive), r.Rejoins, r.BindErrors, r.Reused)
	return nil
}

// kill kills n2, an old node, while the fleet rebalances, and waits for
// the survivors to leave it out of their averages, converge and stop
// shedding.
func (so ScaleOut) kill(f *Fleet, res *ScaleOutResult, clients Load) error {
	k := &res.Kill
	dead := f.Nodes()[1]
	k.Node = dead.Name
	s, err := f.WaitFor(10*time.Second, "the fleet shedding before the kill", func(s Snapshot) (bool, string) {
		return s.Active(), ""
	})
	k.ActiveAtKill = err == nil
	for i, n := range s.Nodes {
		if n == dead {
			k.HeldAtKill = s.Views[i].Held()
		}
	}
	f.Timeline.Mark("kill -9 " + dead.Name)
	tKill := time.Now()
	k.At = tKill
	if err := f.Kill(dead); err != nil {
		return err
	}
	so.logf("killed %s holding %d (fleet shedding: %v)", dead.Name, k.HeldAtKill, k.ActiveAtKill)
	survivors := len(f.Nodes())
	_, err = f.WaitFor(30*time.Second, dead.Name+" out of every average and marked failed", func(s Snapshot) (bool, string) {
		excluded, failed := true, true
		for _, v := range s.Views {
			st, counted, _, _ := v.Member(dead.Name)
			excluded = excluded && !counted && v.Decision.Counted == survivors
			failed = failed && st == "failed"
		}
		if excluded && k.Excluded == 0 {
			k.Excluded = time.Since(tKill)
		}
		if failed && k.MarkedFailed == 0 {
			k.MarkedFailed = time.Since(tKill)
		}
		return k.Excluded > 0 && k.MarkedFailed > 0, fmt.Sprintf("excluded %v, failed %v", excluded, failed)
	})
	if err != nil {
		return err
	}
	shedAtKill := f.Snapshot().Shed()
	s, err = f.waitSettled(so.Converge, so.Clients, so.Settings.Threshold/100, "the survivors")
	if err != nil {
		return err
	}
	k.Stable = time.Since(tKill)
	k.Final = s.Held()
	k.ShedAfter = s.Shed() - shedAtKill
	_, errs, _ := clients.Stats()
	for _, e := range errs {
		if !e.At.Before(tKill) {
			k.ErrorsAfter++
		}
	}
	f.Timeline.Mark("stable")
	so.logf("survivors stable %v after the kill at %v; %s out of the averages after %v, marked failed after %v",
		k.Stable.Round(time.Millisecond), k.Final, dead.Name, k.Excluded.Round(time.Millisecond), k.MarkedFailed.Round(time.Millisecond))
	return nil
}
