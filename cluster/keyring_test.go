package cluster

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/hashicorp/memberlist"

	"github.com/caddy-lbx/lbx/internal/testutil"
)

// thirdGossipKey is a third 32-byte test key.
const thirdGossipKey = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk=" // abcdef0123456789…

// TestKeysBoundsJSON: encrypt_key and encrypt_keys, decoded as Caddy
// decodes them and provisioned: each bad value is refused naming the
// option (and the key's index), never the key.
func TestKeysBoundsJSON(t *testing.T) {
	many := make([]string, maxKeys+1)
	for i := range many {
		many[i] = `"` + base64.StdEncoding.EncodeToString([]byte(fmt.Sprintf("key %027d", i))) + `"`
	}
	for _, tc := range []struct{ json, want string }{
		{`"encrypt_key": "` + testGossipKey + `", "encrypt_keys": ["` + otherGossipKey + `"]`, "encrypt_key and encrypt_keys are both set"},
		{`"encrypt_keys": ["` + testGossipKey + `", "not base64!"]`, "encrypt_keys[1]: not valid base64"},
		{`"encrypt_keys": ["c2hvcnQ="]`, "encrypt_keys[0]: decodes to 5 bytes; want 16, 24 or 32"},
		{`"encrypt_keys": ["` + testGossipKey + `", "` + otherGossipKey + `", "` + testGossipKey + `"]`, "encrypt_keys[2]: the same key as encrypt_keys[0] (fingerprint " + keyID(mustDecodeKey(t, testGossipKey)) + ")"},
		{`"encrypt_keys": [` + strings.Join(many, ", ") + `]`, "encrypt_keys: 17 keys; at most 16"},
		{`"encrypt_keys": ["` + testGossipKey + `", ""]`, `encrypt_keys[1] is empty`},
		{`"encrypt_keys": ["{env.LBX_TEST_UNSET_KEY}"]`, `encrypt_keys[0] "{env.LBX_TEST_UNSET_KEY}" is empty once placeholders are replaced`},
		{`"encrypt_keys": "` + testGossipKey + `"`, "appJSON.encrypt_keys of type []string"},
	} {
		t.Run(tc.json, func(t *testing.T) {
			err := provisionJSON([]byte(`{"node_name": "keys", ` + tc.json + `}`))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v; want one containing %q", err, tc.want)
			}
			for _, k := range []string{testGossipKey, otherGossipKey} {
				if strings.Contains(err.Error(), k) {
					t.Errorf("error %q quotes a key", err)
				}
			}
		})
	}
	// Several good keys, primary first.
	a := &App{NodeName: "keys", EncryptKeys: []string{otherGossipKey, testGossipKey}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := a.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if len(a.keys) != 2 || keyID(a.keys[0]) != keyID(mustDecodeKey(t, otherGossipKey)) {
		t.Errorf("keys %d, primary %s; want 2, the first configured", len(a.keys), keyID(a.keys[0]))
	}
}

// TestKeysCaddyfile: encrypt_key takes one key (JSON encrypt_key) or
// several (encrypt_keys, primary first); bad ones are refused at their
// line.
func TestKeysCaddyfile(t *testing.T) {
	a := new(App)
	if err := a.UnmarshalCaddyfile(caddyfile.NewTestDispenser("cluster {\n encrypt_key " + testGossipKey + "\n}")); err != nil {
		t.Fatal(err)
	}
	if a.EncryptKey != testGossipKey || a.EncryptKeys != nil {
		t.Errorf("one key: encrypt_key %q, encrypt_keys %q", a.EncryptKey, a.EncryptKeys)
	}
	a = new(App)
	in := "cluster {\n encrypt_key " + otherGossipKey + " {env.LBX_NEXT} " + testGossipKey + "\n}"
	if err := a.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
		t.Fatal(err)
	}
	if want := []string{otherGossipKey, "{env.LBX_NEXT}", testGossipKey}; a.EncryptKey != "" || !slices.Equal(a.EncryptKeys, want) {
		t.Errorf("several keys: encrypt_key %q, encrypt_keys %q; want %q", a.EncryptKey, a.EncryptKeys, want)
	}
	checkCaddyfileErrors(t, []caddyfileCase{
		{"cluster {\n encrypt_key\n}", "encrypt_key: missing value"},
		{"cluster {\n encrypt_key " + testGossipKey + " bad!\n}", "encrypt_keys[1]: not valid base64"},
		{"cluster {\n encrypt_key c2hvcnQ=\n}", "encrypt_key: decodes to 5 bytes"},
		{"cluster {\n encrypt_key " + testGossipKey + " " + testGossipKey + "\n}", "encrypt_keys[1]: the same key as encrypt_keys[0]"},
		{"cluster {\n encrypt_key " + strings.Repeat(testGossipKey+" ", 17) + "\n}", "encrypt_keys: 17 keys; at most 16"},
		{"cluster {\n encrypt_key " + testGossipKey + "\n encrypt_key " + otherGossipKey + "\n}", "encrypt_key specified more than once"},
	})
}

// TestReconcileKeys: a changed key list installs its new keys on the
// keyring, uses its primary and removes what the previous list had and
// it drops; keys neither list has (the admin API's) stay. The rolling
// sequence [old] → [old, new] → [new, old] → [new] ends with new alone.
func TestReconcileKeys(t *testing.T) {
	old, next, admin := mustDecodeKey(t, testGossipKey), mustDecodeKey(t, otherGossipKey), mustDecodeKey(t, thirdGossipKey)
	kr, err := memberlist.NewKeyring(nil, old)
	if err != nil {
		t.Fatal(err)
	}
	ids := func() []string {
		var out []string
		for _, k := range kr.GetKeys() {
			out = append(out, keyID(k))
		}
		return out
	}
	oldID, nextID, adminID := keyID(old), keyID(next), keyID(admin)

	if !sameKeys([][]byte{old, next}, [][]byte{old, next}) || sameKeys([][]byte{old, next}, [][]byte{next, old}) ||
		!sameKeys([][]byte{old, next, admin}, [][]byte{old, admin, next}) || sameKeys(nil, [][]byte{old}) || !sameKeys(nil, nil) {
		t.Error("sameKeys: want the same primary and the same set, in any order after the primary")
	}

	steps := []struct {
		prev, next         [][]byte
		want               []string // the keyring after, primary first
		installed, removed []string
		primary            string
	}{
		{[][]byte{old}, [][]byte{old, next}, []string{oldID, nextID}, []string{nextID}, nil, ""},
		{[][]byte{old, next}, [][]byte{next, old}, []string{nextID, oldID}, nil, nil, nextID},
		{[][]byte{next, old}, [][]byte{next}, []string{nextID}, nil, []string{oldID}, ""},
	}
	for i, s := range steps {
		c := reconcileKeys(kr, s.prev, s.next)
		if c.err != nil || !slices.Equal(ids(), s.want) || !slices.Equal(c.installed, s.installed) ||
			!slices.Equal(c.removed, s.removed) || c.primary != s.primary {
			t.Errorf("step %d: keyring %v, change %+v; want keyring %v, installed %v, primary %q, removed %v",
				i, ids(), c, s.want, s.installed, s.primary, s.removed)
		}
	}
	// A key the admin API installed stays across a list change that does
	// not name it, and the list's dropped key goes.
	if err := kr.AddKey(admin); err != nil {
		t.Fatal(err)
	}
	c := reconcileKeys(kr, [][]byte{next}, [][]byte{old})
	if want := []string{oldID, adminID}; c.err != nil || !slices.Equal(ids(), want) {
		t.Errorf("after [new] → [old] with an admin key: keyring %v (%+v); want %v", ids(), c, want)
	}
}

// keyringCall runs op through the admin handler for a's member (by
// bind), with body {"key": key} unless rawBody is given, and returns the
// status, the report and the error's text.
func keyringCall(t *testing.T, a *App, method string, op keyringOp, body string) (int, keyringReport, string) {
	t.Helper()
	req := httptest.NewRequest(method, keyringPath(op)+"?bind="+url.QueryEscape(a.Key()), strings.NewReader(body))
	rec := httptest.NewRecorder()
	err := keyringHandler(op)(rec, req)
	if err != nil {
		var apiErr caddy.APIError
		if !errors.As(err, &apiErr) {
			t.Fatalf("%s %s: error %v is no caddy.APIError", method, op, err)
		}
		return apiErr.HTTPStatus, keyringReport{}, apiErr.Err.Error()
	}
	var rep keyringReport
	if err := json.Unmarshal(rec.Body.Bytes(), &rep); err != nil {
		t.Fatalf("%s %s: decoding %q: %v", method, op, rec.Body, err)
	}
	if strings.Contains(rec.Body.String(), testGossipKey) || strings.Contains(rec.Body.String(), otherGossipKey) {
		t.Errorf("%s %s: the answer quotes a key: %s", method, op, rec.Body)
	}
	code := rec.Code
	return code, rep, rep.Error
}

// keyBody is the body of an install, use or remove request.
func keyBody(key string) string { return `{"key": "` + key + `"}` }

// watchAlive polls every app's member list until the test ends and
// records every member seen neither alive nor absent: a rotation must not
// make serf suspect, fail or lose any member.
func watchAlive(t *testing.T, apps []*App) (seen func() []string) {
	t.Helper()
	var mu sync.Mutex
	var bad []string
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, a := range apps {
				ms, err := a.Members()
				mu.Lock()
				if err != nil {
					bad = append(bad, fmt.Sprintf("%s: %v", a.NodeName, err))
				}
				for _, m := range ms {
					if m.Status != StatusAlive {
						bad = append(bad, fmt.Sprintf("%s sees %s %s", a.NodeName, m.Name, m.Status))
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
	t.Cleanup(func() { close(stop); <-done })
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(bad)
	}
}

// exchangeAll has every app send a direct message to every other, each
// received: messages flow under the keyring as it is.
func exchangeAll(t *testing.T, apps []*App, boxes []*directBox, tag string) {
	t.Helper()
	for i, from := range apps {
		for j, to := range apps {
			if i != j {
				sendUntilReceived(t, from, to, 1, fmt.Sprintf("%s %s→%s", tag, from.NodeName, to.NodeName), boxes[j])
			}
		}
	}
}

// TestKeyringRotationAdmin: three real members rotate their gossip key
// through the admin API of one or another (install, use, remove): each
// step reaches every member, no member is ever seen other than alive,
// direct messages and tags keep flowing, removing the primary and bad
// keys are refused before any query, and a node with only the old key
// then cannot join, its join error naming that key's fingerprint.
func TestKeyringRotationAdmin(t *testing.T) {
	apps := directCluster(t, "rot", 3, testGossipKey)
	boxes := make([]*directBox, len(apps))
	for i, a := range apps {
		boxes[i] = listenDirectKind(t, a, 1)
	}
	notAlive := watchAlive(t, apps)
	oldID, newID := keyID(mustDecodeKey(t, testGossipKey)), keyID(mustDecodeKey(t, otherGossipKey))
	counts0 := keyringSeries(t)

	code, rep, msg := keyringCall(t, apps[0], http.MethodGet, opList, "")
	if code != http.StatusOK || rep.Nodes != 3 || rep.Responses != 3 || len(rep.Keys) != 1 || rep.Keys[0].Fingerprint != oldID || rep.Primary != oldID {
		t.Fatalf("list before: %d %+v %s; want 3 nodes with %s alone, primary", code, rep, msg, oldID)
	}

	step := func(a *App, op keyringOp, key, want string) {
		t.Helper()
		code, rep, msg := keyringCall(t, a, http.MethodPost, op, keyBody(key))
		t.Logf("%s %s via %s: %d %+v", op, rep.Key, a.NodeName, code, rep)
		if code != http.StatusOK || rep.Nodes != 3 || rep.Responses != 3 || len(rep.Errors) != 0 || rep.Key != want || rep.Node != a.NodeName {
			t.Fatalf("%s via %s: %d %+v %s; want 200 from 3 nodes, no error, key %s", op, a.NodeName, code, rep, msg, want)
		}
	}
	list := func(a *App, wantKeys int, primary string) {
		t.Helper()
		code, rep, msg := keyringCall(t, a, http.MethodGet, opList, "")
		if code != http.StatusOK || rep.Nodes != 3 || len(rep.Keys) != wantKeys || rep.Primary != primary {
			t.Fatalf("list via %s: %d %+v %s; want %d keys on 3 nodes, primary %s", a.NodeName, code, rep, msg, wantKeys, primary)
		}
		for _, k := range rep.Keys {
			if k.Nodes != 3 {
				t.Errorf("list via %s: key %s on %d nodes; want 3", a.NodeName, k.Fingerprint, k.Nodes)
			}
		}
	}

	// A key no node has cannot be used: every node says so, by name.
	code, rep, msg = keyringCall(t, apps[1], http.MethodPost, opUse, keyBody(otherGossipKey))
	if code != http.StatusBadGateway || rep.Responses != 3 || len(rep.Errors) != 3 || !strings.Contains(msg, "use key "+newID+": 3/3 nodes reported failure") {
		t.Errorf("use before install: %d %+v; want 502 with the 3 nodes' errors", code, rep)
	}
	for i, e := range rep.Errors {
		if want := fmt.Sprintf("rot-%d", i); e.Node != want || !strings.Contains(e.Message, "not in the keyring") {
			t.Errorf("use before install: error %d %+v; want %s's saying the key is not in the keyring", i, e, want)
		}
	}

	step(apps[0], opInstall, otherGossipKey, newID)
	list(apps[1], 2, oldID)
	exchangeAll(t, apps, boxes, "installed")

	// Refused before any query: the primary, a bad key, a bad body.
	for _, tc := range []struct {
		op         keyringOp
		body, want string
		code       int
	}{
		{opRemove, keyBody(testGossipKey), "key " + oldID + " is this node's primary key", http.StatusConflict},
		{opInstall, keyBody("c2hvcnQ="), "key: decodes to 5 bytes; want 16, 24 or 32", http.StatusBadRequest},
		{opUse, keyBody("not base64!"), "key: not valid base64", http.StatusBadRequest},
		{opInstall, `{"key": ""}`, "key is missing or empty", http.StatusBadRequest},
		{opInstall, `{"secret": "x"}`, `unknown field "secret"`, http.StatusBadRequest},
		{opInstall, `{"key": "` + strings.Repeat("A", 2000) + `"}`, "request body", http.StatusBadRequest},
	} {
		code, _, msg := keyringCall(t, apps[2], http.MethodPost, tc.op, tc.body)
		if code != tc.code || !strings.Contains(msg, tc.want) {
			t.Errorf("%s %.40s: %d %q; want %d with %q", tc.op, tc.body, code, msg, tc.code, tc.want)
		}
	}
	if code, _, _ := keyringCall(t, apps[2], http.MethodPost, opList, ""); code != http.StatusMethodNotAllowed {
		t.Errorf("POST list: %d; want 405", code)
	}
	if code, _, _ := keyringCall(t, apps[2], http.MethodGet, opInstall, ""); code != http.StatusMethodNotAllowed {
		t.Errorf("GET install: %d; want 405", code)
	}

	step(apps[1], opUse, otherGossipKey, newID)
	list(apps[2], 2, newID)
	exchangeAll(t, apps, boxes, "used")
	step(apps[2], opRemove, testGossipKey, oldID)
	list(apps[0], 1, newID)
	exchangeAll(t, apps, boxes, "removed")
	apps[0].Publish("lbx_after_rotation", "1")
	waitTag(t, apps[2], apps[0].NodeName, "lbx_after_rotation", "1")

	if bad := notAlive(); len(bad) > 0 {
		t.Errorf("members seen other than alive during the rotation: %v", bad[:min(len(bad), 10)])
	}
	counts := keyringSeries(t)
	for series, want := range map[string]float64{
		"list/ok": 4, "install/ok": 1, "use/ok": 1, "remove/ok": 1,
		"remove/refused": 1, "install/refused": 4, "use/refused": 1, "use/failed": 1,
	} {
		if got := counts[series] - counts0[series]; got != want {
			t.Errorf("caddy_lbx_cluster_keyring_operations_total{%s} rose by %v; want %v", series, got, want)
		}
	}

	// A node with the old key only cannot join any more, and says which
	// key it has.
	stale := testCluster(t, "rot-stale", func(a *App) {
		a.EncryptKey = testGossipKey
		a.Join = []string{apps[0].gossipAddr()}
	})
	testutil.WaitFor(t, 15*time.Second, "the stale node reports its join error", func() (bool, string) {
		st, _ := stale.Status()
		return st.JoinError != "", "no join error yet"
	})
	st, _ := stale.Status()
	t.Logf("stale node's join error: %s", st.JoinError)
	if !strings.Contains(st.JoinError, "this node's gossip keys: primary "+oldID) || !strings.Contains(st.JoinError, "encrypt_key") {
		t.Errorf("join error %q; want it to name encrypt_key and the primary %s", st.JoinError, oldID)
	}
	for _, a := range apps {
		ms, _ := a.Members()
		for _, m := range ms {
			if m.Name == stale.NodeName {
				t.Errorf("%s lists the stale node (%s)", a.NodeName, m.Status)
			}
		}
	}
}

// TestDescribeKeys: the join error's account of this node's keys.
func TestDescribeKeys(t *testing.T) {
	if got := describeKeys(nil); !strings.Contains(got, "clear text") {
		t.Errorf("no keyring: %q", got)
	}
	kr, err := memberlist.NewKeyring([][]byte{mustDecodeKey(t, otherGossipKey)}, mustDecodeKey(t, testGossipKey))
	if err != nil {
		t.Fatal(err)
	}
	want := "this node's gossip keys: primary " + keyID(mustDecodeKey(t, testGossipKey)) + ", also " + keyID(mustDecodeKey(t, otherGossipKey)) + ";"
	if got := describeKeys(kr); !strings.HasPrefix(got, want) {
		t.Errorf("two keys: %q; want it to start %q", got, want)
	}
}

// TestKeyringNoEncryption: a cluster without a key answers the admin
// API with a clear refusal: encryption cannot be turned on at runtime.
func TestKeyringNoEncryption(t *testing.T) {
	a := testCluster(t, "clear", nil)
	for _, op := range []keyringOp{opList, opInstall} {
		method, body := http.MethodPost, keyBody(testGossipKey)
		if op == opList {
			method, body = http.MethodGet, ""
		}
		code, _, msg := keyringCall(t, a, method, op, body)
		if code != http.StatusConflict || !strings.Contains(msg, "gossip is not encrypted") || !strings.Contains(msg, "restart") {
			t.Errorf("%s without encryption: %d %q; want 409 saying encryption is off until a restart", op, code, msg)
		}
	}
	req := httptest.NewRequest(http.MethodGet, keyringPath(opList)+"?bind=127.0.0.1:1", nil)
	err := keyringHandler(opList)(httptest.NewRecorder(), req)
	var apiErr caddy.APIError
	if !errors.As(err, &apiErr) || apiErr.HTTPStatus != http.StatusNotFound || !strings.Contains(err.Error(), `bind "127.0.0.1:1"`) {
		t.Errorf("unknown bind: %v; want 404 naming it", err)
	}
}

// reloadApp loads a new config for a's member, as a Caddy reload does:
// an app with a's name, bind and join, changed by mut, starts (and takes
// over the member) before a stops.
func reloadApp(t *testing.T, a *App, mut func(*App)) *App {
	t.Helper()
	next := &App{NodeName: a.NodeName, Bind: a.Bind, Join: a.Join}
	mut(next)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := next.Provision(ctx); err != nil {
		cancel()
		t.Fatalf("provision %s: %v", a.NodeName, err)
	}
	if err := next.Start(); err != nil {
		cancel()
		t.Fatalf("start %s: %v", a.NodeName, err)
	}
	if next.member != a.member {
		t.Fatalf("reload of %s did not keep its member", a.NodeName)
	}
	a.Stop()
	t.Cleanup(func() {
		next.Stop()
		cancel()
	})
	return next
}

// keyIDs lists the fingerprints of the keys of a's member, primary
// first.
func keyIDs(a *App) []string {
	var out []string
	for _, k := range a.member.keyring.GetKeys() {
		out = append(out, keyID(k))
	}
	return out
}

// TestKeyringRollingReload: three members rotate the key by config
// reloads alone, each in turn ([old, new] everywhere, then [new, old],
// then [new]), with no restart: nobody is ever seen other than alive and
// messages flow after every round. A reload that keeps the list keeps a
// key the admin API installed; one that changes it applies only the
// change.
func TestKeyringRollingReload(t *testing.T) {
	apps := directCluster(t, "roll", 3, testGossipKey)
	boxes := make([]*directBox, len(apps))
	for i, a := range apps {
		boxes[i] = listenDirectKind(t, a, 1)
	}
	// The apps a reload replaces still reach their member (by its pool
	// key), which the watcher reads.
	notAlive := watchAlive(t, slices.Clone(apps))
	oldID, newID, thirdID := keyID(mustDecodeKey(t, testGossipKey)), keyID(mustDecodeKey(t, otherGossipKey)), keyID(mustDecodeKey(t, thirdGossipKey))

	for round, keys := range [][]string{
		{testGossipKey, otherGossipKey},
		{otherGossipKey, testGossipKey},
		{otherGossipKey},
	} {
		for i := range apps {
			apps[i] = reloadApp(t, apps[i], func(a *App) { a.EncryptKeys = keys })
			boxes[i] = listenDirectKind(t, apps[i], 1)
		}
		exchangeAll(t, apps, boxes, fmt.Sprintf("round %d", round))
	}
	for _, a := range apps {
		if got := keyIDs(a); !slices.Equal(got, []string{newID}) {
			t.Errorf("%s's keyring after the rolling rotation: %v; want %s alone", a.NodeName, got, newID)
		}
	}

	// An unrelated reload (a tag) keeps a key the admin API installed.
	if code, rep, msg := keyringCall(t, apps[0], http.MethodPost, opInstall, keyBody(thirdGossipKey)); code != http.StatusOK {
		t.Fatalf("install: %d %+v %s", code, rep, msg)
	}
	apps[1] = reloadApp(t, apps[1], func(a *App) {
		a.EncryptKeys = []string{otherGossipKey}
		a.Tags = map[string]string{"zone": "b"}
	})
	if got := keyIDs(apps[1]); !slices.Equal(got, []string{newID, thirdID}) {
		t.Errorf("after an unrelated reload: %v; want %s, %s (the admin API's key kept)", got, newID, thirdID)
	}
	// A reload that changes the list applies the change only: the admin
	// API's key stays, the dropped one goes.
	apps[1] = reloadApp(t, apps[1], func(a *App) { a.EncryptKeys = []string{thirdGossipKey, testGossipKey} })
	if got := keyIDs(apps[1]); !slices.Equal(got, []string{thirdID, oldID}) {
		t.Errorf("after [new] → [third, old]: %v; want %s, %s", got, thirdID, oldID)
	}
	// encrypt_key (one key) is the same list as encrypt_keys with it.
	apps[1] = reloadApp(t, apps[1], func(a *App) { a.EncryptKey = thirdGossipKey })
	if got := keyIDs(apps[1]); !slices.Equal(got, []string{thirdID}) {
		t.Errorf("after [third, old] → encrypt_key third: %v; want %s", got, thirdID)
	}
	if bad := notAlive(); len(bad) > 0 {
		t.Errorf("members seen other than alive during the rolling rotation: %v", bad[:min(len(bad), 10)])
	}
}

// TestKeyringFailedReload: a config whose other apps fail to start is
// stopped while the config before it runs on (Caddy never stopped it):
// the keys go back to the running config's list. A reload that succeeds
// keeps the new list.
func TestKeyringFailedReload(t *testing.T) {
	b := testCluster(t, "failed-reload", func(a *App) { a.EncryptKey = testGossipKey })
	oldID, newID := keyID(mustDecodeKey(t, testGossipKey)), keyID(mustDecodeKey(t, otherGossipKey))

	next := &App{NodeName: b.NodeName, Bind: b.Bind, EncryptKeys: []string{otherGossipKey, testGossipKey}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := next.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	if got := keyIDs(b); !slices.Equal(got, []string{newID, oldID}) {
		t.Fatalf("while the new config starts: %v; want %s, %s", got, newID, oldID)
	}
	// The new config failed elsewhere: Caddy stops it, b runs on.
	if err := next.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := keyIDs(b); !slices.Equal(got, []string{oldID}) {
		t.Errorf("after the failed reload: %v; want the running config's %s alone", got, oldID)
	}
	// The same reload, succeeding, keeps the new list.
	b = reloadApp(t, b, func(a *App) { a.EncryptKeys = []string{otherGossipKey, testGossipKey} })
	if got := keyIDs(b); !slices.Equal(got, []string{newID, oldID}) {
		t.Errorf("after a reload that succeeds: %v; want %s, %s", got, newID, oldID)
	}
}

// TestKeyringReloadEncryptionToggle: a reload cannot turn encryption on
// or off on a running member: it warns, and the keyring is untouched.
func TestKeyringReloadEncryptionToggle(t *testing.T) {
	plain := testCluster(t, "toggle-plain", nil)
	plain = reloadApp(t, plain, func(a *App) { a.EncryptKey = testGossipKey })
	if st, _ := plain.Status(); st.Encrypted || plain.member.keyring != nil {
		t.Errorf("a reload turned encryption on: %+v", st)
	}
	enc := testCluster(t, "toggle-enc", func(a *App) { a.EncryptKey = testGossipKey })
	enc = reloadApp(t, enc, func(*App) {})
	if st, _ := enc.Status(); !st.Encrypted || !slices.Equal(keyIDs(enc), []string{keyID(mustDecodeKey(t, testGossipKey))}) {
		t.Errorf("a reload without a key changed the keyring: %+v, %v", st, keyIDs(enc))
	}
	// Back to a key list: compared with the last one applied.
	enc = reloadApp(t, enc, func(a *App) { a.EncryptKeys = []string{otherGossipKey, testGossipKey} })
	if got, want := keyIDs(enc), []string{keyID(mustDecodeKey(t, otherGossipKey)), keyID(mustDecodeKey(t, testGossipKey))}; !slices.Equal(got, want) {
		t.Errorf("keyring %v; want %v", got, want)
	}
}

// keyringSeries returns caddy_lbx_cluster_keyring_operations_total by
// "op/result", from one collection of the metrics collector.
func keyringSeries(t *testing.T) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, s := range collect(t, descKeyringOps) {
		out[s.labels["op"]+"/"+s.labels["result"]] = s.value
	}
	return out
}
