package integration

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// keyringReport is the part of a keyring admin answer the test reads.
type keyringReport struct {
	Op        string `json:"op"`
	Key       string `json:"key"`
	Nodes     int    `json:"nodes"`
	Responses int    `json:"responses"`
	Errors    []struct {
		Node, Message string
	} `json:"errors"`
	Keys []struct {
		Fingerprint string `json:"fingerprint"`
		Nodes       int    `json:"nodes"`
		PrimaryOn   int    `json:"primary_on"`
	} `json:"keys"`
	Primary string `json:"primary"`
	Error   string `json:"error"`
}

// clusterNodeView is the part of a node's GET /lbx/cluster the test
// reads.
type clusterNodeView struct {
	Name            string `json:"node_name"`
	JoinError       string `json:"join_error"`
	DecryptFailures *struct {
		Total   int `json:"total"`
		Sources []struct {
			Addr  string `json:"addr"`
			Count int    `json:"count"`
		} `json:"sources"`
	} `json:"decrypt_failures"`
	Members []struct {
		Name, Status string
		Tags         map[string]string
	} `json:"members"`
}

// nodeClusterView reads n's GET /lbx/cluster (one member per process).
func nodeClusterView(n *fleet.Node) (clusterNodeView, error) {
	var body struct {
		Nodes []clusterNodeView `json:"nodes"`
	}
	if err := n.AdminDo(http.MethodGet, "/lbx/cluster", "", nil, &body); err != nil {
		return clusterNodeView{}, err
	}
	if len(body.Nodes) != 1 {
		return clusterNodeView{}, fmt.Errorf("%s: %d members in /lbx/cluster; want 1", n.Name, len(body.Nodes))
	}
	return body.Nodes[0], nil
}

// fingerprint is the key's fingerprint as lbx shows it: the first 4
// bytes of the SHA-256 of the decoded key, in hex.
func fingerprint(t *testing.T, b64 string) string {
	t.Helper()
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(raw)
	return hex.EncodeToString(sum[:4])
}

// TestKeyringRotationFleet is the gossip-key rotation's acceptance run
// with 5 real cmd/caddy nodes behind a TCP balancer, under client
// traffic, while a watcher reads every node's /lbx/cluster:
//
//   - through the admin API, one call on one node each: install a new
//     key (every node then lists 2 keys), use it, remove the old one;
//     then a reload of one node with a new tag (its config still says
//     the old key: an unrelated reload must not undo the admin API's
//     keys) reaches every node;
//   - through rolling config reloads, each node in turn (out of the
//     balancer while it reloads): [new, third], [third, new], [third];
//
// after each admin API step, a config that fails to start (a site on a
// port the test holds) is loaded on two nodes, with the key list an
// operator would write at that step (issue 22: a failed reload after a
// runtime rotation split the cluster), and the keyrings stay as they
// were; at the use step, two operators act at once on two nodes (use
// and remove of the new key), and each of them is done or refused with
// a clear reason (409), the cluster's keyrings agreeing after;
//
// no node ever sees a member other than alive, none reports a message it
// could not decrypt, and no request fails (but
// a new connection reset at a reload, which lbx_handoff cannot keep:
// fleet.ClientError.ReloadReset; never during the admin API's rotation).
// Then a 6th node configured with the old key only cannot join: it sees
// itself alone, no node lists it, and its join error names the old key
// by fingerprint.
func TestKeyringRotationFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs 6 cmd/caddy processes")
	}
	bin := drainBuildCaddy(t)
	f, err := fleet.New(bin, t.TempDir(), fleet.FrontRandom, rbSettings, 250*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := f.Close(); err != nil {
			t.Errorf("stopping the fleet: %v", err)
		}
	}()
	const size = 5
	for i := range size {
		if _, err := f.AddNode(fmt.Sprintf("k%d", i+1), true); err != nil {
			t.Fatal(err)
		}
	}
	nodes := f.Nodes()
	waitAllAlive := func(what string) {
		t.Helper()
		if _, err := f.WaitFor(30*time.Second, what, func(s fleet.Snapshot) (bool, string) {
			for i, v := range s.Views {
				if v.Alive() != size {
					return false, fmt.Sprintf("%s sees %d alive", s.Nodes[i].Name, v.Alive())
				}
			}
			return true, ""
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitAllAlive("every node sees 5 alive")

	clientCount := 200
	if raceEnabled {
		clientCount = 50
	}
	clients := fleet.StartClients(f.Front.Addr(), clientCount, 200*time.Millisecond)
	clientsClosed := false
	defer func() {
		if !clientsClosed {
			clients.Close()
		}
	}()
	if _, err := f.WaitFor(30*time.Second, "every client connected", func(fleet.Snapshot) (bool, string) {
		return clients.Connects.Load() >= int64(clientCount), fmt.Sprintf("%d connects", clients.Connects.Load())
	}); err != nil {
		t.Fatal(err)
	}

	// The watcher: every node's view of every member, every 100 ms.
	var mu sync.Mutex
	var notAlive []string
	polls := 0
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, n := range nodes {
				v, err := nodeClusterView(n)
				mu.Lock()
				polls++
				if err != nil {
					notAlive = append(notAlive, err.Error())
				}
				for _, m := range v.Members {
					if m.Status != "alive" {
						notAlive = append(notAlive, fmt.Sprintf("%s: %s sees %s %s", time.Now().Format("15:04:05.000"), n.Name, m.Name, m.Status))
					}
				}
				mu.Unlock()
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	stopWatch := func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		<-done
	}
	defer stopWatch()

	// phases mark when each step began, to place a failed request.
	type phase struct {
		name string
		at   time.Time
	}
	phases := []phase{{"traffic", time.Now()}}
	mark := func(name string) { phases = append(phases, phase{name, time.Now()}) }
	phaseOf := func(at time.Time) string {
		name := ""
		for _, p := range phases {
			if !at.Before(p.at) {
				name = p.name
			}
		}
		return name
	}

	oldKey, newKey, thirdKey := f.Key, fleet.NewKey(), fleet.NewKey()
	oldID, newID, thirdID := fingerprint(t, oldKey), fingerprint(t, newKey), fingerprint(t, thirdKey)
	t.Logf("keys: old %s, new %s, third %s", oldID, newID, thirdID)

	// keyringTry sends a keyring request to n once.
	keyringTry := func(n *fleet.Node, method, path, body string) (keyringReport, error) {
		var rep keyringReport
		var reqBody io.Reader
		if body != "" {
			reqBody = strings.NewReader(body)
		}
		err := n.AdminDo(method, path, "application/json", reqBody, &rep)
		return rep, err
	}
	// keyringDo sends a keyring request to n. A 502 in which no member
	// failed but some member's answer did not arrive (UDP, on a machine
	// loaded many times over), or a 409 because a member's answer to the
	// key lease did not arrive (or its release was lost: the lease's TTL
	// is 30 s), is sent again, up to 40 s: each step may be repeated
	// (docs/operations.md). Every retry is logged and counted.
	retries := 0
	keyringDo := func(n *fleet.Node, method, path, body string) keyringReport {
		t.Helper()
		deadline := time.Now().Add(40 * time.Second)
		for {
			rep, err := keyringTry(n, method, path, body)
			if err == nil {
				return rep
			}
			var ae *fleet.AdminError
			lease := errors.As(err, &ae) && ae.Status == http.StatusConflict &&
				(strings.Contains(string(ae.Body), "could not take the key operation lease") || strings.Contains(string(ae.Body), "is in progress"))
			lost := errors.As(err, &ae) && ae.Status == http.StatusBadGateway && json.Unmarshal(ae.Body, &rep) == nil &&
				len(rep.Errors) == 0 && rep.Responses < rep.Nodes
			if (!lease && !lost) || time.Now().After(deadline) {
				t.Fatal(err)
			}
			retries++
			t.Logf("%s %s through %s: %v; again", method, path, n.Name, err)
			time.Sleep(200 * time.Millisecond)
		}
	}
	op := func(n *fleet.Node, name, key, wantID string) {
		t.Helper()
		start := time.Now()
		rep := keyringDo(n, http.MethodPost, "/lbx/cluster/keys/"+name, `{"key": "`+key+`"}`)
		t.Logf("%s %s through %s: %d nodes, %d responses, %d errors, in %v", name, rep.Key, n.Name, rep.Nodes, rep.Responses, len(rep.Errors), time.Since(start).Round(time.Millisecond))
		if rep.Nodes != size || rep.Responses != size || len(rep.Errors) != 0 || rep.Error != "" || rep.Key != wantID {
			t.Fatalf("%s through %s: %+v; want %d nodes answering, no error, key %s", name, n.Name, rep, size, wantID)
		}
	}
	// list checks, through every node, that the cluster has exactly want
	// (each on every node) and primary on every node.
	list := func(want []string, primary string) {
		t.Helper()
		for _, n := range nodes {
			rep := keyringDo(n, http.MethodGet, "/lbx/cluster/keys", "")
			var got []string
			for _, k := range rep.Keys {
				got = append(got, k.Fingerprint)
				if k.Nodes != size {
					t.Errorf("list through %s: key %s on %d nodes; want %d", n.Name, k.Fingerprint, k.Nodes, size)
				}
			}
			slices.Sort(got)
			if !slices.Equal(got, slices.Sorted(slices.Values(want))) || rep.Primary != primary || rep.Responses != size {
				t.Fatalf("list through %s: keys %v, primary %q, %d responses; want %v, primary %s, %d", n.Name, got, rep.Primary, rep.Responses, want, primary, size)
			}
		}
	}

	// failLoad loads on n its config with keys and a site on a port the
	// test holds: Caddy refuses it, the running config stays. Caddy
	// starts the apps in map order: the cluster app before the failing
	// http app (its change to the keyring undone at its stop) or not at
	// all; two nodes each, so that both orders are likely exercised, and
	// the result must not depend on it.
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	failLoads := 0
	failLoad := func(n *fleet.Node, keys ...string) {
		t.Helper()
		spec := n.Spec
		spec.Keys = keys
		cfg := n.Caddyfile(spec) + fmt.Sprintf("\nhttp://%s {\n\trespond \"never\"\n}\n", held.Addr())
		err := n.Load(cfg)
		var ae *fleet.AdminError
		if !errors.As(err, &ae) || !strings.Contains(string(ae.Body), "address already in use") {
			t.Fatalf("the failing config on %s: %v; want Caddy to refuse it (address already in use)", n.Name, err)
		}
		failLoads++
	}
	failStep := func(what string, nodesAt []int, keys ...string) {
		t.Helper()
		mark("failed reloads after " + what)
		for _, i := range nodesAt {
			failLoad(nodes[i], keys...)
		}
	}

	// Through the admin API, with failed reloads after each step.
	mark("admin API rotation")
	list([]string{oldID}, oldID)
	op(nodes[0], "install", newKey, newID)
	failStep("install", []int{1, 3}, newKey, oldKey)
	list([]string{oldID, newID}, oldID)

	// Two operators at once on two nodes: use the new key on one, remove
	// it on the other. Each is done, or refused (409) with the reason.
	mark("two operators at once")
	type result struct {
		rep keyringReport
		err error
	}
	var both [2]result
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i, name := range []string{"use", "remove"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			both[i].rep, both[i].err = keyringTry(nodes[2+i], http.MethodPost, "/lbx/cluster/keys/"+name, `{"key": "`+newKey+`"}`)
		}()
	}
	close(start)
	wg.Wait()
	refusedClearly := 0
	for i, r := range both {
		who := fmt.Sprintf("%s on %s", []string{"use", "remove"}[i], nodes[2+i].Name)
		if r.err == nil {
			t.Logf("%s: done (%d nodes, %d responses)", who, r.rep.Nodes, r.rep.Responses)
			continue
		}
		var ae *fleet.AdminError
		if errors.As(r.err, &ae) && ae.Status == http.StatusBadGateway && json.Unmarshal(ae.Body, &r.rep) == nil && len(r.rep.Errors) == 0 {
			// Answers lost on a loaded machine: the keyrings' agreement,
			// checked next, says whether it split anything.
			t.Logf("%s: %d of %d members answered: %v", who, r.rep.Responses, r.rep.Nodes, r.err)
			continue
		}
		if !errors.As(r.err, &ae) || ae.Status != http.StatusConflict ||
			!regexp.MustCompile(`another key operation \((use|remove) [0-9a-f]{8}\) is in progress \(held by node k[1-5]\)|is on 0 of 5 nodes|is the primary key of [1-5] of 5 nodes|could not take the key operation lease`).Match(ae.Body) {
			t.Fatalf("%s: %v; want 200, or 409 with a clear reason", who, r.err)
		}
		refusedClearly++
		t.Logf("%s: refused: %s", who, strings.TrimSpace(string(ae.Body)))
	}
	// The keyrings agree whatever happened; then on to the rotation's
	// next state: the new key installed and primary everywhere.
	agreed := keyringDo(nodes[0], http.MethodGet, "/lbx/cluster/keys", "")
	if agreed.Primary == "" || agreed.Responses != size {
		t.Fatalf("after the two operators: %+v; want one primary on all %d nodes", agreed, size)
	}
	for _, k := range agreed.Keys {
		if k.Nodes != size {
			t.Fatalf("after the two operators: key %s on %d nodes; want %d", k.Fingerprint, k.Nodes, size)
		}
	}
	if agreed.Primary != newID {
		if len(agreed.Keys) == 1 {
			op(nodes[0], "install", newKey, newID)
		}
		op(nodes[2], "use", newKey, newID)
	}
	failStep("use", []int{0, 4}, newKey)
	list([]string{oldID, newID}, newID)
	op(nodes[4], "remove", oldKey, oldID)
	failStep("remove", []int{1, 2}, newKey)
	list([]string{newID}, newID)
	// How many failed reloads reached the cluster app (Caddy's map order
	// started it before the failing http app): each says so in its log.
	undone := 0
	for _, n := range nodes {
		undone += strings.Count(n.Proc.Log(), "the newer config failed to start")
	}
	t.Logf("%d of %d failed reloads started the cluster app before the failing one", undone, failLoads)
	// No node failed to decrypt a message of another.
	for _, n := range nodes {
		v, err := nodeClusterView(n)
		if err != nil {
			t.Fatal(err)
		}
		if v.DecryptFailures != nil {
			t.Errorf("%s reports decrypt failures during the admin API rotation: %+v", n.Name, *v.DecryptFailures)
		}
	}

	// reload loads spec on n out of the balancer, and records when. The
	// kernel resets new connections still queued on the old socket as it
	// closes (fleet.ClientError.ReloadReset): out of the balancer, only
	// those dialed just before. Those are the reload's, not the rotation's.
	var reloads [][2]time.Time
	reload := func(n *fleet.Node, spec fleet.NodeSpec) {
		t.Helper()
		if err := f.Front.Remove(n.HTTP); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := f.Front.Add(n.HTTP); err != nil {
				t.Error(err)
			}
		}()
		start := time.Now()
		if err := n.Reload(spec); err != nil {
			t.Fatal(err)
		}
		reloads = append(reloads, [2]time.Time{start, time.Now()})
	}
	// atReload reports whether e is such a reset, from a reload's start
	// to a second after its end (the client records it when its request
	// returns, which a loaded machine delays), as fleet.Phase2Split
	// counts them.
	atReload := func(e fleet.ClientError) bool {
		for _, w := range reloads {
			if e.ReloadReset() && !e.At.Before(w[0]) && !e.At.After(w[1].Add(time.Second)) {
				return true
			}
		}
		return false
	}

	// An unrelated reload (a tag; the config still says the old key)
	// keeps the keyring, and its gossip reaches every node.
	mark("unrelated reload")
	spec := nodes[1].Spec
	spec.Tags = map[string]string{"rotated": "1"}
	reload(nodes[1], spec)
	if _, err := f.WaitFor(20*time.Second, "every node sees k2's new tag", func(s fleet.Snapshot) (bool, string) {
		for i, v := range s.Views {
			if _, _, tags, ok := v.Member(nodes[1].Name); !ok || tags["rotated"] != "1" {
				return false, s.Nodes[i].Name + " does not see it yet"
			}
		}
		return true, ""
	}); err != nil {
		t.Fatal(err)
	}
	list([]string{newID}, newID)

	// Through rolling config reloads, each node in turn.
	for _, keys := range [][]string{{newKey, thirdKey}, {thirdKey, newKey}, {thirdKey}} {
		for _, n := range nodes {
			mark(fmt.Sprintf("reload %s with %d keys", n.Name, len(keys)))
			spec := n.Spec
			spec.Keys = keys
			reload(n, spec)
		}
		mark("after reloads")
		var ids []string
		for _, k := range keys {
			ids = append(ids, fingerprint(t, k))
		}
		list(ids, ids[0])
	}
	waitAllAlive("every node sees 5 alive after the rotations")

	// A node with the old key only.
	mark("stale node")
	staleSpec := f.Spec("k6-stale")
	staleSpec.Key = oldKey
	stale, err := f.AddNode("k6-stale", false, staleSpec)
	if err != nil {
		t.Fatal(err)
	}
	var sv clusterNodeView
	if _, err := f.WaitFor(20*time.Second, "the stale node reports a join error", func(fleet.Snapshot) (bool, string) {
		sv, err = nodeClusterView(stale)
		return err == nil && sv.JoinError != "", fmt.Sprint(err)
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("stale node's join error: %s", sv.JoinError)
	if !strings.Contains(sv.JoinError, "primary "+oldID) {
		t.Errorf("the stale node's join error %q does not name its key %s", sv.JoinError, oldID)
	}
	alive := 0
	for _, m := range sv.Members {
		if m.Status == "alive" {
			alive++
		}
	}
	if alive != 1 {
		t.Errorf("the stale node sees %d alive; want itself alone", alive)
	}
	for _, n := range nodes {
		v, err := nodeClusterView(n)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range v.Members {
			if m.Name == stale.Name {
				t.Errorf("%s lists the stale node (%s)", n.Name, m.Status)
			}
		}
	}

	stopWatch()
	clients.Close()
	clientsClosed = true
	reqs, errs, retried := clients.Stats()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("clients: %d requests, %d failed, %d written twice by Go's transport; watcher: %d reads, %d not-alive sightings; %d keyring requests sent again; %d failed reloads injected; %d of 2 concurrent operations refused",
		reqs, len(errs), retried, polls, len(notAlive), retries, failLoads, refusedClearly)
	for _, e := range errs {
		if atReload(e) {
			t.Logf("a new connection reset at a reload (%s): %v", phaseOf(e.At), e)
			continue
		}
		t.Errorf("a request failed during %q: %v", phaseOf(e.At), e)
	}
	if len(notAlive) > 0 {
		t.Errorf("members seen other than alive (or views not read) during the rotation: %v", notAlive[:min(len(notAlive), 10)])
	}
	if reqs < clientCount || polls < size {
		t.Errorf("%d requests, %d watcher reads: the run did not exercise the fleet", reqs, polls)
	}
}
