package cluster

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestDecryptAddr: the remote address of memberlist's lines about a
// message no key decrypts (net.go's packet and stream lines, as
// memberlist v0.7 writes them), and nothing from other lines.
func TestDecryptAddr(t *testing.T) {
	for _, tc := range []struct {
		line, addr string
		ok         bool
	}{
		{"memberlist: Decrypt packet failed: no installed keys could decrypt the message from=127.0.0.1:7946", "127.0.0.1:7946", true},
		{"memberlist: Failed to receive user message: no installed keys could decrypt the message from=[::1]:41000", "[::1]:41000", true},
		{"memberlist: Failed to read remote state: no installed keys could decrypt the message from=10.0.0.2:7946 extra", "10.0.0.2:7946", true},
		{"memberlist: Decrypt packet failed: no installed keys could decrypt the message", "unknown", true},
		{"memberlist: Decrypt packet failed: payload is too small to decrypt: 3 from=127.0.0.1:1", "", false},
		{"memberlist: Failed to decode ping from=127.0.0.1:1", "", false},
	} {
		addr, ok := decryptAddr(tc.line)
		if addr != tc.addr || ok != tc.ok {
			t.Errorf("%q: %q %v; want %q %v", tc.line, addr, ok, tc.addr, tc.ok)
		}
	}
}

// TestDecryptFailuresRecord: counts by address, the oldest address
// dropped beyond the bound, and one log line per interval.
func TestDecryptFailuresRecord(t *testing.T) {
	var d decryptFailures
	now := time.Now()
	if ok, n := d.record("a:1", now); !ok || n != 1 {
		t.Errorf("first failure: log %v (%d); want a line for 1", ok, n)
	}
	for i := range 10 {
		if ok, _ := d.record("a:1", now.Add(time.Duration(i)*time.Second)); ok {
			t.Errorf("failure %d within the interval: logged", i)
		}
	}
	if ok, n := d.record("b:2", now.Add(decryptLogInterval)); !ok || n != 11 {
		t.Errorf("after the interval: log %v (%d); want a line for 11", ok, n)
	}
	for i := range maxDecryptSources {
		d.record(fmt.Sprintf("c:%d", i), now.Add(time.Minute+time.Duration(i)))
	}
	v := d.view("heal")
	if v.Total != 12+maxDecryptSources || len(v.Sources) != maxDecryptSources || v.Sources[0].Addr != fmt.Sprintf("c:%d", maxDecryptSources-1) {
		t.Fatalf("view: total %d, %d sources, first %+v", v.Total, len(v.Sources), v.Sources[0])
	}
	for _, s := range v.Sources {
		if s.Addr == "a:1" {
			t.Errorf("the oldest address a:1 kept beyond %d sources", maxDecryptSources)
		}
	}
	var empty decryptFailures
	if empty.view("heal") != nil {
		t.Error("a view with no failure")
	}
}

// TestDecryptFailedLog: the member's log line on decrypt failures: once
// per interval, with the address, this node's keys and the heal.
func TestDecryptFailedLog(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	m := &member{logger: zap.New(core)}
	for range 5 {
		m.decryptFailed("127.0.0.1:7946")
	}
	lines := logs.FilterMessageSnippet("cannot decrypt gossip from a member").All()
	if len(lines) != 1 {
		t.Fatalf("%d log lines for 5 failures; want 1", len(lines))
	}
	ctx := lines[0].ContextMap()
	if ctx["from"] != "127.0.0.1:7946" || !strings.Contains(fmt.Sprint(ctx["heal"]), "curl -X POST 'localhost:2019/lbx/cluster/keys/install?local=1'") ||
		!strings.Contains(fmt.Sprint(ctx["this_node_keys"]), "clear text") {
		t.Errorf("log line %v; want the address, this node's keys and the heal", ctx)
	}
}

// TestDecryptFailuresReported: a member that makes a key its primary on
// its own (local=1) cannot be read by the other any more: the other
// counts the failures from its address (admin view, metric); installing the key there with local=1 lets it read
// again (its count stops rising).
func TestDecryptFailuresReported(t *testing.T) {
	apps := directCluster(t, "decrypt", 2, testGossipKey)
	for _, op := range []keyringOp{opInstall, opUse} {
		target := keyringPath(op) + "?bind=" + url.QueryEscape(apps[0].Key()) + "&local=1"
		code, rep, msg := keyringCallWith(t, apps[0], http.MethodPost, target, op, "application/json", keyBody(otherGossipKey))
		if code != http.StatusOK || !rep.Local || rep.Nodes != 1 {
			t.Fatalf("%s local: %d %+v %s", op, code, rep, msg)
		}
	}
	if got := keyIDs(apps[1]); len(got) != 1 {
		t.Fatalf("a local operation reached the other node: %v", got)
	}
	from := apps[0].gossipAddr()
	lbxtest.WaitFor(t, 15*time.Second, "decrypt-1 counts failures from decrypt-0", func() (bool, string) {
		v := apps[1].member.view()
		if v.DecryptFailures == nil {
			return false, "none"
		}
		for _, s := range v.DecryptFailures.Sources {
			if s.Addr == from && s.Count > 0 {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%+v", v.DecryptFailures.Sources)
	})
	v := apps[1].member.view()
	if !strings.Contains(v.DecryptFailures.Heal, "keys/install?local=1") {
		t.Errorf("heal %q names no command", v.DecryptFailures.Heal)
	}
	var metric float64
	for _, s := range collect(t, descDecryptFailures) {
		if s.labels["node"] == apps[1].NodeName {
			metric = s.value
		}
	}
	if metric < 1 {
		t.Errorf("caddy_lbx_cluster_decrypt_failures_total{node=%s} = %v; want ≥ 1", apps[1].NodeName, metric)
	}

	// The heal: the key on decrypt-1 too.
	target := keyringPath(opInstall) + "?bind=" + url.QueryEscape(apps[1].Key()) + "&local=1"
	if code, rep, msg := keyringCallWith(t, apps[1], http.MethodPost, target, opInstall, "application/json", keyBody(otherGossipKey)); code != http.StatusOK {
		t.Fatalf("install local on decrypt-1: %d %+v %s", code, rep, msg)
	}
	before := apps[1].member.decrypt.total.Load()
	exchangeAll(t, apps, []*directBox{listenDirectKind(t, apps[0], 1), listenDirectKind(t, apps[1], 1)}, "healed")
	if after := apps[1].member.decrypt.total.Load(); after != before {
		t.Errorf("decrypt failures rose from %d to %d after the heal", before, after)
	}
}
