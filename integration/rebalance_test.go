package integration

import (
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// Settings of the rebalance acceptance run: shedding sped up for the
// test (5% every 200 ms instead of 0.5% every second), the default
// threshold and stop band.
var rbSettings = fleet.Settings{
	Interval: "200ms", History: "1s", Freshness: "1s",
	Threshold: 20, ShedRate: 5, MinConnections: 5,
}

// rbClients is the number of long-lived clients, each sending a request
// every rbEvery: as many as a loaded 2-core machine carries with 8 Caddy
// processes, the balancer and the clients on it (fewer under the race
// detector, which slows the clients and the balancer several times).
var (
	rbClients = 1500
	rbEvery   = time.Second
)

// TestRebalanceScaleOut is issue 5's acceptance run with real processes
// (fleet.ScaleOut): 3 cmd/caddy nodes in a serf cluster with an
// encryption key, behind a TCP balancer that gives each new connection to
// a random node, and rbClients keep-alive clients that reconnect through
// it when a connection closes. Then:
//
//   - 3 more nodes join, and one with the wrong key tries to: every node
//     ends within ±20% of the average and none sheds, no request fails,
//     every connection shed comes back as exactly one reconnection, the
//     shed total is within 1.3× the 99th percentile of a perfect
//     rebalancer behind the same balancer (simulated; the 1.3× target on
//     its median is the benchmark's), and the wrong-key node is never a member and
//     says why;
//   - 2 more nodes join; while the fleet sheds, n3 is reloaded through its
//     admin API with a new tag: no other node ever sees it other than
//     alive, the seed logs no join or leave for it, it binds nothing
//     twice, it keeps its serf member, the new tag reaches every node and
//     its decisions go on; then n2 is killed with SIGKILL mid-rebalance:
//     it leaves every survivor's average, serf marks it failed, and the
//     survivors converge within ±20% and stop shedding. No request fails
//     before the kill but new connections the kernel resets as n3's old
//     socket closes (fleet.Phase2Split; lbx_handoff serves the rest).
func TestRebalanceScaleOut(t *testing.T) {
	start := time.Now()
	bin := drainBuildCaddy(t)
	t.Logf("built cmd/caddy in %v", time.Since(start).Round(time.Millisecond))
	clients := rbClients
	if raceEnabled {
		clients = 400
	}
	res, err := fleet.ScaleOut{
		Bin: bin, Dir: t.TempDir(),
		Clients: clients, Every: rbEvery,
		Settings: rbSettings,
		Converge: 60 * time.Second,
		Logf:     t.Logf,
	}.Run()
	if err != nil {
		t.Fatal(err)
	}

	// Phase 1: 3 → 6.
	avg := float64(clients) / 6
	t.Logf("3 → 6 nodes: %v → %v (average %.1f); all 6 alive after %v, converged after %v",
		res.Before, res.After, avg, res.Joined.Round(time.Millisecond), res.Converged.Round(time.Millisecond))
	ratio := float64(res.Shed) / res.Ideal
	t.Logf("shed %d to move %d: %.2f× the ideal %.0f of a perfect rebalancer behind a random balancer, %.2f× twice the moved count",
		res.Shed, res.Moved, ratio, res.Ideal, float64(res.Shed)/float64(2*res.Moved))
	t.Logf("clients: %d requests, %d failed, %d written twice by Go's transport after a keep-alive close crossed them, %d reconnections",
		res.Requests, len(res.Errors), res.Retried, res.Reconnections)
	if len(res.Errors) > 0 {
		t.Errorf("%d requests failed while shedding, e.g. %v", len(res.Errors), res.Errors[:min(len(res.Errors), 5)])
	}
	if res.Reconnections != res.ShedAtEnd {
		t.Errorf("%d reconnections for %d connections shed by then (%d when converged); want one each", res.Reconnections, res.ShedAtEnd, res.Shed)
	}
	if res.Requests < clients {
		t.Errorf("only %d requests sent", res.Requests)
	}
	// The target, at most 1.3× the ideal, is a median over runs and is
	// checked by the benchmark (go run ./integration/bench rebalance).
	// One run scatters, and with few connections a perfect rebalancer
	// scatters too (400 clients under -race: its 99th percentile is 1.25×
	// its median, against 1.07× with 3000), so one run is held to 1.3× that
	// percentile: it catches churn, not the dice (CI failed once at 1.50×
	// the median with 400 clients, 1.20× the percentile).
	if bound := 1.3 * res.IdealP99; float64(res.Shed) > bound {
		t.Errorf("shed %d is %.2f× the ideal %.0f, %.2f× its 99th percentile %.0f; want at most 1.3× that percentile in one run (the 1.3× target on the median is the benchmark's)",
			res.Shed, ratio, res.Ideal, float64(res.Shed)/res.IdealP99, res.IdealP99)
	}

	// The wrong key.
	t.Logf("wrong-key node: join error %q; sees %d alive; listed by %v", res.WrongKey.JoinError, res.WrongKey.Alive, res.WrongKey.SeenBy)
	if !strings.Contains(res.WrongKey.JoinError, "encrypt_key") || res.WrongKey.Alive != 1 || len(res.WrongKey.SeenBy) > 0 {
		t.Errorf("wrong-key node: join error %q, %d alive, listed by %v; want a join error naming encrypt_key, itself alone, listed by none",
			res.WrongKey.JoinError, res.WrongKey.Alive, res.WrongKey.SeenBy)
	}

	// Phase 2: the reload.
	r := res.Reload
	t.Logf("reload of %s (%d connections, fleet shedding %v): new tag everywhere after %v; fleet shed %d → %d in the 2 s after; reused member %v; %d not-alive sightings, %d join/leave events, %d bind errors",
		r.Node, r.ConnectionsBeforeReload, r.ActiveAtReload, r.TagSeen.Round(time.Millisecond), r.ShedBefore, r.ShedAfter, r.Reused, len(r.NotAlive), r.Rejoins, r.BindErrors)
	if r.Joins == 0 {
		t.Errorf("the seed's log shows no join event for %s before the reload; the rejoin count looks for the wrong line", r.Node)
	}
	if len(r.NotAlive) > 0 || r.Rejoins > 0 || r.BindErrors > 0 || !r.Reused || !r.DecidedAfter {
		t.Errorf("reload of %s: not-alive sightings %v, %d join/leave events, %d bind errors, reused member %v, decisions after %v; want none, 0, 0, true, true",
			r.Node, r.NotAlive, r.Rejoins, r.BindErrors, r.Reused, r.DecidedAfter)
	}
	if !r.ActiveAtReload || r.ShedAfter <= r.ShedBefore {
		t.Errorf("the fleet was shedding at the reload: %v; shed %d → %d: want shedding before and after", r.ActiveAtReload, r.ShedBefore, r.ShedAfter)
	}

	// Phase 2: the kill.
	k := res.Kill
	t.Logf("SIGKILL of %s (holding %d, fleet shedding %v): out of every average after %v, marked failed after %v; survivors stable at %v after %v, shedding %d meanwhile; %d requests failed from the kill on",
		k.Node, k.HeldAtKill, k.ActiveAtKill, k.Excluded.Round(time.Millisecond), k.MarkedFailed.Round(time.Millisecond), k.Final, k.Stable.Round(time.Millisecond), k.ShedAfter, k.ErrorsAfter)
	if !k.ActiveAtKill {
		t.Error("the fleet was not shedding when the node was killed: not mid-rebalance")
	}
	if k.ErrorsAfter > k.HeldAtKill {
		t.Errorf("%d requests failed after the kill; the dead node held %d", k.ErrorsAfter, k.HeldAtKill)
	}
	// A reload under a stream of new connections has the kernel reset a
	// few of them (Phase2Split); the rebalance must lose nothing else.
	atReload, _, others := res.Phase2Split()
	if len(atReload) > 0 {
		t.Logf("%d new connections reset during %s's reload (docs/handoff.md, \"Limits\"), e.g. %v",
			len(atReload), r.Node, atReload[:min(len(atReload), 3)])
	}
	if len(others) > 0 {
		t.Errorf("%d requests failed in phase 2 outside the reload's new connections and before the kill, e.g. %v", len(others), others[:min(len(others), 5)])
	}
	t.Logf("total %v", time.Since(start).Round(time.Millisecond))
}
