package cluster

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/drain"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// Ops keys of the tests: base64 of 32 bytes, neither a gossip key.
const (
	testOpsKey  = "b3BzLWtleS1vZi10aGUtdGVzdHMtMzItYnl0ZXMtISE=" // ops-key-of-the-tests-32-bytes-!!
	otherOpsKey = "YW5vdGhlci1vcHMta2V5LW9mLTMyLWJ5dGVzLS0tLS0=" // another-ops-key-of-32-bytes-----
)

// drainNode starts a cluster app with the test gossip key, ops key ops
// (none when empty) and a drain store of its own, joining join when set.
func drainNode(t *testing.T, name, ops string, join *App) (*App, *drain.Store) {
	t.Helper()
	store := drain.New()
	a := testCluster(t, name, func(a *App) {
		a.EncryptKey, a.OpsKey, a.drainStore = testGossipKey, ops, store
		if join != nil {
			a.Join = []string{join.gossipAddr()}
		}
	})
	return a, store
}

// waitEntry waits, at most within, until st holds addr drained (or not).
func waitEntry(t *testing.T, st *drain.Store, who, addr string, drained bool, within time.Duration) {
	t.Helper()
	lbxtest.WaitFor(t, within, fmt.Sprintf("%s has %s drained=%v", who, addr, drained), func() (bool, string) {
		e, ok := st.Get(addr)
		return ok && e.Drained == drained, fmt.Sprintf("%+v %v", e, ok)
	})
}

// TestDrainPropagates: on a 3-node cluster with one ops key, a drain made
// on one node reaches the others within two push intervals, an undrain
// from another node too, and a node that joins later gets both; a member
// with the gossip key and another ops key, or none, changes nothing.
func TestDrainPropagates(t *testing.T) {
	a0, s0 := drainNode(t, "drain-0", testOpsKey, nil)
	a1, s1 := drainNode(t, "drain-1", testOpsKey, a0)
	a2, s2 := drainNode(t, "drain-2", testOpsKey, a0)
	for _, a := range []*App{a0, a1, a2} {
		waitAlive(t, a, 3)
	}
	if !s0.Propagated() || s0.Origin() != "drain-0" {
		t.Fatalf("store not attached: %v %q", s0.Propagated(), s0.Origin())
	}

	const addr = "10.0.0.7:8080"
	if _, err := s0.Set(addr, true, 100); err != nil {
		t.Fatal(err)
	}
	waitEntry(t, s1, "drain-1", addr, true, 2*drainPushEvery)
	waitEntry(t, s2, "drain-2", addr, true, 2*drainPushEvery)
	if e, _ := s2.Get(addr); e.Origin != "drain-0" || !e.Remote {
		t.Fatalf("entry at drain-2: %+v", e)
	}
	// a reweight and an undrain from another node
	if _, err := s1.Set("10.0.0.8:8080", false, 40); err != nil {
		t.Fatal(err)
	}
	if _, err := s1.Set(addr, false, 100); err != nil {
		t.Fatal(err)
	}
	waitEntry(t, s0, "drain-0", addr, false, 2*drainPushEvery)
	waitEntry(t, s2, "drain-2", addr, false, 2*drainPushEvery)
	lbxtest.WaitFor(t, 2*drainPushEvery, "drain-2 has the reweight", func() (bool, string) {
		st, ok := s2.Lookup("10.0.0.8:8080")
		return ok && st.WeightPercent == 40, fmt.Sprintf("%+v", st)
	})

	// A member with the gossip key and another ops key: its drains are
	// sent, signed with the wrong key, and refused.
	bad, sBad := drainNode(t, "drain-bad", otherOpsKey, a0)
	// A member with the gossip key alone sends forged entries: signed
	// with nothing, with the gossip key, and a valid message's bytes
	// with one field changed.
	plain, _ := drainNode(t, "drain-plain", "", a0)
	for _, a := range []*App{a0, a1, a2, bad, plain} {
		waitAlive(t, a, 5)
	}
	const victim = "10.0.0.9:8080"
	if _, err := sBad.Set(victim, true, 100); err != nil {
		t.Fatal(err)
	}
	forged := []drain.Entry{{Addr: victim, Drained: true, WeightPercent: 100, Version: 1 << 60, Origin: "drain-0"}}
	withGossipKey, _ := drain.Encode(forged, mustDecodeKey(t, testGossipKey), 1200)
	withZeroKey, _ := drain.Encode(forged, make([]byte, 32), 1200)
	good, _ := drain.Encode([]drain.Entry{{Addr: "10.0.0.1:80", WeightPercent: 100, Version: 1, Origin: "drain-0"}}, mustDecodeKey(t, testOpsKey), 1200)
	tampered := bytes.Replace(bytes.Clone(good), []byte("10.0.0.1:80"), []byte("10.0.0.9:80"), 1)
	tampered[len("dd\x00\x01\x00\x0b10.0.0.9:80")] = 1 // and drained
	before := []uint64{s0.Dropped(), s1.Dropped(), s2.Dropped()}
	for _, to := range []*App{a0, a1, a2} {
		for _, msg := range [][]byte{withGossipKey, withZeroKey, tampered, []byte("not a drain message")} {
			if err := plain.SendDirect(to.NodeName, drainKind, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	// every node refuses the forgeries and the wrong key's pushes
	for i, st := range []*drain.Store{s0, s1, s2} {
		lbxtest.WaitFor(t, 10*time.Second, fmt.Sprintf("drain-%d refuses the forgeries", i), func() (bool, string) {
			return st.Dropped() >= before[i]+5, fmt.Sprintf("%d refused, %d before", st.Dropped(), before[i])
		})
		for _, a := range []string{victim, "10.0.0.9:80"} {
			if e, ok := st.Get(a); ok {
				t.Errorf("drain-%d took a forged entry: %+v", i, e)
			}
		}
	}
	// the honest nodes' pushes reach the wrong-key member, which refuses
	// them too: the stores stay apart
	lbxtest.WaitFor(t, 10*time.Second, "drain-bad refuses the honest pushes", func() (bool, string) {
		return sBad.Dropped() > 0, ""
	})
	if _, ok := sBad.Get(addr); ok {
		t.Error("the member with another ops key took an honest entry")
	}

	// A node that joins afterwards gets the store from the pushes.
	late, sLate := drainNode(t, "drain-late", testOpsKey, a1)
	waitAlive(t, late, 6)
	waitEntry(t, sLate, "drain-late", addr, false, 15*time.Second)
	lbxtest.WaitFor(t, 15*time.Second, "drain-late has the reweight", func() (bool, string) {
		st, ok := sLate.Lookup("10.0.0.8:8080")
		return ok && st.WeightPercent == 40, fmt.Sprintf("%+v", st)
	})

	// the counts show in /lbx/cluster's node view... of the process's
	// store, which these nodes do not use: checked on the stores above.
	a0.Stop()
	if s0.Propagated() {
		t.Fatal("the store is still attached after Stop")
	}
}

// TestDrainLateJoinerGetsDrain: a drain made while a node is not yet in
// the cluster reaches it after it joins.
func TestDrainLateJoinerGetsDrain(t *testing.T) {
	a0, s0 := drainNode(t, "late-0", testOpsKey, nil)
	a1, _ := drainNode(t, "late-1", testOpsKey, a0)
	waitAlive(t, a0, 2)
	waitAlive(t, a1, 2)
	if _, err := s0.Set("10.0.0.5:80", true, 100); err != nil {
		t.Fatal(err)
	}
	a2, s2 := drainNode(t, "late-2", testOpsKey, a1)
	waitAlive(t, a2, 3)
	waitEntry(t, s2, "late-2", "10.0.0.5:80", true, 15*time.Second)
}
