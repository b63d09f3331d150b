package cluster

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/hashicorp/memberlist"

	"github.com/caddy-lbx/lbx/lbxtest"
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
		{`"encrypt_key": "` + base64.StdEncoding.EncodeToString(make([]byte, 16)) + `"`, "encrypt_key: decodes to 16 zero bytes, which is no secret"},
		{`"encrypt_keys": ["` + testGossipKey + `", "` + base64.StdEncoding.EncodeToString(make([]byte, 32)) + `"]`, "encrypt_keys[1]: decodes to 32 zero bytes"},
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
	return keyringCallWith(t, a, method, keyringPath(op)+"?bind="+url.QueryEscape(a.Key()), op, "application/json", body)
}

// keyringCallWith is keyringCall with the path (and query) and the
// Content-Type given.
func keyringCallWith(t *testing.T, a *App, method, target string, op keyringOp, contentType, body string) (int, keyringReport, string) {
	t.Helper()
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
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

	// A key no node has cannot be used, nor removed: refused after the
	// list, before any change.
	code, _, msg = keyringCall(t, apps[1], http.MethodPost, opUse, keyBody(otherGossipKey))
	if code != http.StatusConflict || !strings.Contains(msg, "key "+newID+" is on 0 of 3 nodes") || !strings.Contains(msg, "install it on every node first") {
		t.Errorf("use before install: %d %q; want 409 saying 0 of 3 nodes have it", code, msg)
	}
	code, _, msg = keyringCall(t, apps[1], http.MethodPost, opRemove, keyBody(otherGossipKey))
	if code != http.StatusNotFound || !strings.Contains(msg, "no node has key "+newID) {
		t.Errorf("remove of a key no node has: %d %q; want 404 saying no node has it", code, msg)
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
		{opInstall, keyBody(thirdGossipKey) + ` GARBAGE`, "data after the JSON object", http.StatusBadRequest},
		{opInstall, keyBody(thirdGossipKey) + keyBody(testGossipKey), "data after the JSON object", http.StatusBadRequest},
		{opInstall, keyBody(base64.StdEncoding.EncodeToString(make([]byte, 32))), "key: decodes to 32 zero bytes", http.StatusBadRequest},
	} {
		code, _, msg := keyringCall(t, apps[2], http.MethodPost, tc.op, tc.body)
		if code != tc.code || !strings.Contains(msg, tc.want) {
			t.Errorf("%s %.40s: %d %q; want %d with %q", tc.op, tc.body, code, msg, tc.code, tc.want)
		}
	}
	for _, ct := range []string{"", "text/plain", "application/x-www-form-urlencoded", "application/json-patch+json"} {
		code, _, msg := keyringCallWith(t, apps[2], http.MethodPost, keyringPath(opInstall)+"?bind="+url.QueryEscape(apps[2].Key()), opInstall, ct, keyBody(thirdGossipKey))
		if code != http.StatusUnsupportedMediaType || !strings.Contains(msg, "Content-Type: application/json") {
			t.Errorf("install with Content-Type %q: %d %q; want 415 asking for application/json", ct, code, msg)
		}
	}
	if code, _, msg := keyringCallWith(t, apps[2], http.MethodPost, keyringPath(opInstall)+"?bind="+url.QueryEscape(apps[2].Key())+"&local=yes", opInstall, "application/json", keyBody(thirdGossipKey)); code != http.StatusBadRequest || !strings.Contains(msg, `local="yes"`) {
		t.Errorf("local=yes: %d %q; want 400 naming it", code, msg)
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
		"remove/refused": 2, "install/refused": 12, "use/refused": 2,
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
	lbxtest.WaitFor(t, 15*time.Second, "the stale node reports its join error", func() (bool, string) {
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

// TestKeyringNoEncryption: a cluster without a key lists no keys, with
// 200 and unencrypted set (the README's first look at the keys must not
// read as an error), and refuses a change clearly: encryption cannot be
// turned on at runtime.
func TestKeyringNoEncryption(t *testing.T) {
	a := testCluster(t, "clear", nil)
	code, rep, msg := keyringCall(t, a, http.MethodGet, opList, "")
	if code != http.StatusOK || !rep.Unencrypted || len(rep.Keys) != 0 || rep.Error != "" {
		t.Errorf("list without encryption: %d %+v %q; want 200, unencrypted, no keys, no error", code, rep, msg)
	}
	for _, op := range []keyringOp{opInstall, opUse, opRemove} {
		code, _, msg := keyringCall(t, a, http.MethodPost, op, keyBody(testGossipKey))
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
// the primary it set goes back, and no key is removed, not even the one
// it installed (another member may use it by then). The keys a list
// drops are removed only once the previous config stopped. A reload that
// succeeds keeps the new list.
func TestKeyringFailedReload(t *testing.T) {
	b := testCluster(t, "failed-reload", func(a *App) { a.EncryptKey = testGossipKey })
	oldID, newID := keyID(mustDecodeKey(t, testGossipKey)), keyID(mustDecodeKey(t, otherGossipKey))

	failed := func(keys []string, during []string) {
		t.Helper()
		next := &App{NodeName: b.NodeName, Bind: b.Bind, EncryptKeys: keys}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		if err := next.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		if err := next.Start(); err != nil {
			t.Fatal(err)
		}
		if got := keyIDs(b); !slices.Equal(got, during) {
			t.Fatalf("while the config %v starts: %v; want %v", keys, got, during)
		}
		// The new config failed elsewhere: Caddy stops it, b runs on.
		if err := next.Stop(); err != nil {
			t.Fatal(err)
		}
	}
	failed([]string{otherGossipKey, testGossipKey}, []string{newID, oldID})
	if got := keyIDs(b); !slices.Equal(got, []string{oldID, newID}) {
		t.Errorf("after the failed reload: %v; want the running config's primary %s back, and %s kept", got, oldID, newID)
	}
	// A list that drops the old key removes nothing while the running
	// config runs, and nothing when it fails.
	failed([]string{otherGossipKey}, []string{newID, oldID})
	if got := keyIDs(b); !slices.Equal(got, []string{oldID, newID}) {
		t.Errorf("after the failed reload to [new]: %v; want %s, %s", got, oldID, newID)
	}
	// The same reload, succeeding: the old key goes once b stopped.
	b = reloadApp(t, b, func(a *App) { a.EncryptKeys = []string{otherGossipKey} })
	if got := keyIDs(b); !slices.Equal(got, []string{newID}) {
		t.Errorf("after a reload to [new] that succeeds: %v; want %s alone", got, newID)
	}
}

// TestKeyChangeUndo: what attach stages, commit and undo do to a bare
// keyring: undo puts back the primary only while the change's primary is
// still in use, and removes nothing; commit leaves a key that became the
// primary since.
func TestKeyChangeUndo(t *testing.T) {
	old, next, third := mustDecodeKey(t, testGossipKey), mustDecodeKey(t, otherGossipKey), mustDecodeKey(t, thirdGossipKey)
	oldID, nextID, thirdID := keyID(old), keyID(next), keyID(third)
	newKR := func(primary []byte, others ...[]byte) *memberlist.Keyring {
		kr, err := memberlist.NewKeyring(others, primary)
		if err != nil {
			t.Fatal(err)
		}
		return kr
	}
	// [old] → [next]: next installed and primary, old pending.
	kr := newKR(old)
	c := stageKeys(kr, [][]byte{old}, [][]byte{next})
	if got := keyFingerprints(kr); c.err != nil || !slices.Equal(got, []string{nextID, oldID}) || len(c.remove) != 1 || c.primary != nextID {
		t.Fatalf("staged: %v %+v; want %s, %s with %s pending", got, c, nextID, oldID, oldID)
	}
	if restored, err := c.undo(kr); err != nil || restored != oldID || !slices.Equal(keyFingerprints(kr), []string{oldID, nextID}) {
		t.Errorf("undo: %q %v, keyring %v; want %s back as primary, %s kept", restored, err, keyFingerprints(kr), oldID, nextID)
	}
	// The admin API changed the primary after the stage: undo leaves it.
	kr = newKR(old)
	c = stageKeys(kr, [][]byte{old}, [][]byte{next, old})
	if err := kr.AddKey(third); err != nil {
		t.Fatal(err)
	}
	if err := kr.UseKey(third); err != nil {
		t.Fatal(err)
	}
	if restored, _ := c.undo(kr); restored != "" || keyFingerprints(kr)[0] != thirdID || len(keyFingerprints(kr)) != 3 {
		t.Errorf("undo after the primary changed: %q, keyring %v; want %s kept as primary, 3 keys", restored, keyFingerprints(kr), thirdID)
	}
	// A pending removal of what became the primary is skipped.
	kr = newKR(old, next)
	c = stageKeys(kr, [][]byte{old, next}, [][]byte{old})
	if err := kr.UseKey(next); err != nil {
		t.Fatal(err)
	}
	c.commit(kr)
	if got := keyFingerprints(kr); !slices.Equal(got, []string{nextID, oldID}) || len(c.removed) != 0 {
		t.Errorf("commit of the primary's removal: %v, removed %v; want both kept", got, c.removed)
	}
}

// TestKeyringFailedReloadAfterRotation (issue 22, finding 2): two nodes
// rotate from old to new through the admin API (install, use, remove),
// then one loads a config with encrypt_key new that fails to start, and
// then others that fail too (new with a third key, and the running
// config's own old key): the
// keyrings stay [new], primary new, on both, and neither ever sees the
// other other than alive, for longer than serf's failure detection.
func TestKeyringFailedReloadAfterRotation(t *testing.T) {
	apps := directCluster(t, "split2", 2, testGossipKey)
	notAlive := watchAlive(t, slices.Clone(apps))
	newID := keyID(mustDecodeKey(t, otherGossipKey))
	for _, st := range []struct {
		op  keyringOp
		key string
	}{{opInstall, otherGossipKey}, {opUse, otherGossipKey}, {opRemove, testGossipKey}} {
		if code, rep, msg := keyringCall(t, apps[0], http.MethodPost, st.op, keyBody(st.key)); code != http.StatusOK {
			t.Fatalf("%s: %d %+v %s", st.op, code, rep, msg)
		}
	}
	failedReload := func(a *App, mut func(*App)) {
		t.Helper()
		next := &App{NodeName: a.NodeName, Bind: a.Bind, Join: a.Join}
		mut(next)
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		if err := next.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		if err := next.Start(); err != nil {
			t.Fatal(err)
		}
		if err := next.Stop(); err != nil {
			t.Fatal(err)
		}
	}
	failedReload(apps[0], func(a *App) { a.EncryptKey = otherGossipKey })
	failedReload(apps[1], func(a *App) { a.EncryptKeys = []string{otherGossipKey, thirdGossipKey} })
	failedReload(apps[0], func(a *App) { a.EncryptKey = testGossipKey }) // the running config's own list
	for _, a := range apps {
		if got := keyIDs(a); !slices.Equal(got, []string{newID}) && !(a == apps[1] && len(got) == 2 && got[0] == newID) {
			t.Errorf("%s's keyring after the failed reloads: %v; want primary %s (and no key removed)", a.NodeName, got, newID)
		}
	}
	// Longer than serf's failure detection (a probe each second, a
	// suspicion of a few seconds), every member stays alive and messages
	// flow.
	boxes := []*directBox{listenDirectKind(t, apps[0], 1), listenDirectKind(t, apps[1], 1)}
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		exchangeAll(t, apps, boxes, "after the failed reloads "+time.Now().Format("05.000"))
		time.Sleep(500 * time.Millisecond)
	}
	if bad := notAlive(); len(bad) > 0 {
		t.Errorf("members seen other than alive: %v", bad[:min(len(bad), 10)])
	}
}

// TestKeyringConcurrentOps (issue 22, finding 3): use K on one node and
// remove K on the other at the same moment, several times: each is done
// or refused with a clear reason (another operation in progress, or the
// step that the other's result made unsafe), never both half done, and
// the two nodes keep reading each other for longer than serf's failure
// detection. A lease held by a node refuses an operation asked on
// another, naming the holder.
func TestKeyringConcurrentOps(t *testing.T) {
	apps := directCluster(t, "conc", 2, testGossipKey)
	notAlive := watchAlive(t, slices.Clone(apps))
	oldID := keyID(mustDecodeKey(t, testGossipKey))
	if code, rep, msg := keyringCall(t, apps[0], http.MethodPost, opInstall, keyBody(otherGossipKey)); code != http.StatusOK {
		t.Fatalf("install: %d %+v %s", code, rep, msg)
	}
	clear := regexp.MustCompile(`another key operation \((use|remove) [0-9a-f]{8}\) is in progress \(held by node conc-[01]\)|is on 0 of 2 nodes|is the primary key of [12] of 2 nodes|no node has key`)
	busy := 0
	for round := range 4 {
		var wg sync.WaitGroup
		var codes [2]int
		var msgs [2]string
		start := make(chan struct{})
		for i, op := range []keyringOp{opUse, opRemove} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				codes[i], _, msgs[i] = keyringCall(t, apps[i], http.MethodPost, op, keyBody(otherGossipKey))
			}()
		}
		close(start)
		wg.Wait()
		t.Logf("round %d: use on conc-0: %d %q; remove on conc-1: %d %q", round, codes[0], msgs[0], codes[1], msgs[1])
		for i := range codes {
			if codes[i] == http.StatusOK {
				continue
			}
			if (codes[i] != http.StatusConflict && codes[i] != http.StatusNotFound) || !clear.MatchString(msgs[i]) {
				t.Errorf("round %d: node %d answered %d %q; want 200, or 409/404 with a clear reason", round, i, codes[i], msgs[i])
			}
			if strings.Contains(msgs[i], "is in progress") {
				busy++
			}
		}
		// The keyrings agree: the same primary, each has the other's.
		k0, k1 := keyIDs(apps[0]), keyIDs(apps[1])
		if k0[0] != k1[0] || !slices.Equal(slices.Sorted(slices.Values(k0)), slices.Sorted(slices.Values(k1))) {
			t.Fatalf("round %d: keyrings differ: %v and %v", round, k0, k1)
		}
		// Back to old primary with the new key installed, for the next
		// round.
		if k0[0] != oldID {
			if code, rep, msg := keyringCall(t, apps[0], http.MethodPost, opUse, keyBody(testGossipKey)); code != http.StatusOK {
				t.Fatalf("use old: %d %+v %s", code, rep, msg)
			}
		}
		if len(k0) == 1 {
			if code, rep, msg := keyringCall(t, apps[0], http.MethodPost, opInstall, keyBody(otherGossipKey)); code != http.StatusOK {
				t.Fatalf("install again: %d %+v %s", code, rep, msg)
			}
		}
	}
	t.Logf("%d of 8 operations refused as in progress", busy)

	// A lease another node holds refuses an operation, naming it.
	op := keyLockRequest{Holder: apps[1].NodeName, ID: "test", Op: "install 00000000"}
	if a := apps[1].member.lease.takeLocal(op, time.Now()); !a.Granted {
		t.Fatalf("taking conc-1's lease: %+v", a)
	}
	code, _, msg := keyringCall(t, apps[0], http.MethodPost, opUse, keyBody(otherGossipKey))
	if want := "another key operation (install 00000000) is in progress (held by node conc-1)"; code != http.StatusConflict || !strings.Contains(msg, want) {
		t.Errorf("use while conc-1 holds the lease: %d %q; want 409 with %q", code, msg, want)
	}
	apps[1].member.lease.release(op)
	// conc-0 released its own lease on every member: conc-1 may go.
	if code, _, msg := keyringCall(t, apps[1], http.MethodPost, opUse, keyBody(otherGossipKey)); code != http.StatusOK {
		t.Errorf("use on conc-1 after the refusal: %d %q; want 200 (the refused operation released its lease)", code, msg)
	}

	boxes := []*directBox{listenDirectKind(t, apps[0], 1), listenDirectKind(t, apps[1], 1)}
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		exchangeAll(t, apps, boxes, "after the concurrent operations "+time.Now().Format("05.000"))
		time.Sleep(500 * time.Millisecond)
	}
	if bad := notAlive(); len(bad) > 0 {
		t.Errorf("members seen other than alive: %v", bad[:min(len(bad), 10)])
	}
}

// TestKeyLease: the lease's rules on one member.
func TestKeyLease(t *testing.T) {
	var l keyLease
	now := time.Now()
	a1 := keyLockRequest{Holder: "a", ID: "1", Op: "use x"}
	a2 := keyLockRequest{Holder: "a", ID: "2", Op: "remove y"}
	b1 := keyLockRequest{Holder: "b", ID: "1", Op: "install z"}
	if !l.takeLocal(a1, now).Granted {
		t.Fatal("a free lease is not taken")
	}
	if got := l.takeLocal(a2, now); got.Granted || got.Holder != "a" || got.Op != "use x" {
		t.Errorf("a second local operation: %+v; want busy, held by a for use x", got)
	}
	if !l.grant(a1, now).Granted || !l.grant(a2, now).Granted {
		t.Error("the holder's own query is not granted")
	}
	if got := l.grant(b1, now); got.Granted || got.Holder != "a" {
		t.Errorf("another node's query: %+v; want busy, held by a", got)
	}
	l.release(b1) // not the holder: nothing
	if l.grant(b1, now).Granted {
		t.Error("a release by another node freed the lease")
	}
	if !l.grant(b1, now.Add(keyLeaseTTL)).Granted {
		t.Error("an expired lease is not granted")
	}
	l.release(b1)
	if !l.grant(a1, now).Granted {
		t.Error("a released lease is not granted")
	}
	if err := errKeyOpBusy("n1", "use 1a2b3c4d"); !strings.Contains(err.Error(), "another key operation (use 1a2b3c4d) is in progress (held by node n1)") {
		t.Errorf("busy error: %v", err)
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

// TestJoinedByLaterPeer: a node whose join address answers nothing (its
// peers are not up yet) fails its join and says so, then reads as joined,
// with no join error, once another node starts and joins it, although its
// own join never succeeds: it stops retrying once it sees a member. Without
// the rule in status it stays "joined": false with the stale error (issue
// 25's first rough edge).
func TestJoinedByLaterPeer(t *testing.T) {
	nobody := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	first := testCluster(t, "early", func(a *App) {
		a.EncryptKey = testGossipKey
		a.Join = []string{nobody}
	})
	lbxtest.WaitFor(t, 15*time.Second, "the early node reports its failed join", func() (bool, string) {
		st, _ := first.Status()
		return st.JoinError != "" && !st.Joined, fmt.Sprintf("%+v", st)
	})
	testCluster(t, "late", func(a *App) {
		a.EncryptKey = testGossipKey
		a.Join = []string{first.gossipAddr()}
	})
	lbxtest.WaitFor(t, 15*time.Second, "the early node reads as joined", func() (bool, string) {
		st, _ := first.Status()
		return st.Joined && st.JoinError == "", fmt.Sprintf("%+v", st)
	})
}
