package cluster

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestUnmarshalCaddyfileErrors covers every error path of the global
// option, each with the line it names.
func TestUnmarshalCaddyfileErrors(t *testing.T) {
	checkCaddyfileErrors(t, []caddyfileCase{
		{"cluster extra", `cluster: unexpected argument "extra"; options go in a block`},
		{"cluster {\n node_name\n}", "node_name: missing value"},
		{"cluster {\n node_name a b\n}", `node_name: one value expected, got another: "b"`},
		{"cluster {\n bind a b\n}", "bind: one value expected"},
		{"cluster {\n join\n}", "join: missing value"},
		{"cluster {\n tags x\n}", `tags: unexpected argument "x"`},
		{"cluster {\n tags {\n  zone\n }\n}", "zone: missing value"},
		{"cluster {\n tags {\n  zone a\n  zone b\n }\n}", "cluster: tags: zone specified more than once, at Testfile:4"},
		{"cluster {\n tags {\n  lbx_load 1\n }\n}", `tag "lbx_load": keys starting with lbx_ are reserved`},
		{"cluster {\n bind 127.0.0.1:1\n bind 127.0.0.1:2\n}", "cluster: bind specified more than once"},
		{"cluster {\n metric cpu\n}", `cluster: unknown option "metric" (want node_name, bind, advertise, join, encrypt_key, tags, insecure_plaintext_gossip or ops_key)`},
		{"cluster {\n ops_key\n}", "ops_key: missing value"},
		{"cluster {\n ops_key c2hvcnQ=\n}", "ops_key: decodes to 5 bytes; want 32"},
		{"cluster {\n encrypt_key " + testGossipKey + "\n ops_key " + testGossipKey + "\n}", "ops_key: the same key as a gossip key"},
	})
}

// caddyfileCase is a `cluster` global option the Caddyfile refuses, and
// what the error must contain.
type caddyfileCase struct{ in, want string }

// checkCaddyfileErrors reads each case's option: each must be refused
// with its error, which names its line.
func checkCaddyfileErrors(t *testing.T, cases []caddyfileCase) {
	t.Helper()
	for _, tc := range cases {
		err := new(App).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%.80q: error %v; want one containing %q", tc.in, err, tc.want)
		}
		if err != nil && !strings.Contains(err.Error(), "Testfile:") {
			t.Errorf("%.80q: error %q does not name its line", tc.in, err)
		}
	}
}

// TestProvisionErrors covers the checks Provision makes before anything
// exists: each error names the bad value.
func TestProvisionErrors(t *testing.T) {
	long := strings.Repeat("x", 600)
	for _, tc := range []struct {
		app  App
		want string
	}{
		{App{NodeName: "n", Bind: "nohost"}, `bind "nohost": want host:port`},
		{App{NodeName: "n", Bind: "127.0.0.1:99999"}, `bind "127.0.0.1:99999": invalid port "99999"`},
		{App{NodeName: "n", Advertise: "x"}, `advertise "x": want host:port`},
		{App{NodeName: "n", Join: []string{"10.0.0.1"}}, `join "10.0.0.1": want host:port`},
		{App{NodeName: "n", EncryptKey: "not base64!"}, "encrypt_key: not valid base64"},
		{App{NodeName: "n", EncryptKey: "c2hvcnQ="}, "encrypt_key: decodes to 5 bytes; want 16, 24 or 32"},
		{App{NodeName: "n", EncryptKey: "{env.LBX_TEST_UNSET_KEY}"}, `encrypt_key "{env.LBX_TEST_UNSET_KEY}" is empty once placeholders are replaced`},
		{App{NodeName: "n", Tags: map[string]string{"lbx_x": "1"}}, `tag "lbx_x": keys starting with lbx_ are reserved`},
		{App{NodeName: strings.Repeat("n", 129)}, "is 129 bytes; at most 128"},
		{App{NodeName: "n", Join: []string{"10.0.0.1:0"}}, `join "10.0.0.1:0": port 0 cannot be joined`},
		{App{NodeName: "n", Tags: map[string]string{"big": long}}, "above serf's limit of 512"},
		{App{NodeName: "n", Tags: map[string]string{"": "x"}}, "key and value must not be empty"},
		{App{NodeName: "n"}, "no encrypt_key and bind 0.0.0.0:7946 is not loopback: anyone who reaches that port joins the cluster"},
		{App{NodeName: "n", Bind: "10.0.0.1:7946"}, "set encrypt_key (make one with `head -c32 /dev/urandom | base64`), bind to loopback, or set insecure_plaintext_gossip"},
		{App{NodeName: "n", Bind: ":7946"}, "bind :7946 is not loopback"},
		{App{NodeName: "n", Bind: "127.0.0.1:0", OpsKey: "not base64!"}, "ops_key: not valid base64"},
		{App{NodeName: "n", Bind: "127.0.0.1:0", OpsKey: "c2hvcnQ="}, "ops_key: decodes to 5 bytes; want 32"},
		{App{NodeName: "n", Bind: "127.0.0.1:0", OpsKey: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}, "ops_key: decodes to 32 zero bytes"},
		{App{NodeName: "n", Bind: "127.0.0.1:0", OpsKey: "{env.LBX_TEST_UNSET_KEY}"}, `ops_key "{env.LBX_TEST_UNSET_KEY}" is empty once placeholders are replaced`},
		{App{NodeName: "n", Bind: "127.0.0.1:0", EncryptKeys: []string{otherGossipKey, testGossipKey}, OpsKey: testGossipKey}, "ops_key: the same key as a gossip key"},
	} {
		a := tc.app
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		err := a.Provision(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v; want one containing %q", tc.app.NodeName[:1], err, tc.want)
		}
	}
}

// TestCheckTagsFit: the tags another module will publish count toward
// serf's limit.
func TestCheckTagsFit(t *testing.T) {
	a := &App{Tags: map[string]string{"role": strings.Repeat("r", 400)}}
	if err := a.CheckTagsFit(nil); err != nil {
		t.Fatalf("400 bytes of tags alone: %v", err)
	}
	err := a.CheckTagsFit(map[string]string{"lbx_load": strings.Repeat("9", 120)})
	if err == nil || !strings.Contains(err.Error(), "with the ones lbx publishes") {
		t.Fatalf("with 120 more bytes: %v; want a refusal naming the published tags", err)
	}
}

// TestProvisionDefaults: the no-options form (`cluster` alone) binds
// 0.0.0.0:7946 under the host name, with no key and no tags, and opens
// nothing until Start; with no key it needs insecure_plaintext_gossip
// (TestProvisionErrors), which a loopback bind does not.
func TestProvisionDefaults(t *testing.T) {
	host, err := os.Hostname()
	if err != nil {
		t.Skip(err)
	}
	for _, bind := range []string{"127.0.0.1:7946", "localhost:7946", "[::1]:7946"} {
		a := &App{NodeName: "n", Bind: bind}
		if err := a.Validate(); err != nil {
			t.Errorf("bind %s without a key: %v; want it accepted (loopback)", bind, err)
		}
	}
	a := &App{InsecurePlaintextGossip: true}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := a.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if a.NodeName != host || a.Bind != "0.0.0.0:7946" || a.Key() != "0.0.0.0:7946" || a.keys != nil {
		t.Errorf("defaults: node_name %q (host %q), bind %q, key %q, encrypted %v", a.NodeName, host, a.Bind, a.Key(), a.keys != nil)
	}
	if a.pooledMember() != nil {
		t.Error("Provision started a serf member")
	}
}
