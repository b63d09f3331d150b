package cluster

import (
	"context"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// hugeTags do not fit in serf's 512 bytes on their own.
var hugeTags = `{"a": "` + strings.Repeat("x", 300) + `", "b": "` + strings.Repeat("y", 300) + `"}`

// TestAppBoundsJSON: every option of the app, decoded from JSON as Caddy
// decodes it, then provisioned: each bad value is refused with the
// option's name and why, before anything exists.
func TestAppBoundsJSON(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`"bind": "127.0.0.1:70000"`, `bind "127.0.0.1:70000": invalid port "70000"`},
		{`"bind": "127.0.0.1:-1"`, `bind "127.0.0.1:-1": invalid port "-1"`},
		{`"bind": "nohost"`, `bind "nohost": want host:port`},
		{`"advertise": "10.0.0.1:x"`, `advertise "10.0.0.1:x": invalid port "x"`},
		{`"join": ["10.0.0.1:0"]`, `join "10.0.0.1:0": port 0 cannot be joined`},
		{`"join": ["10.0.0.1:99999"]`, `join "10.0.0.1:99999": invalid port "99999"`},
		{`"join": "10.0.0.1:7946"`, "appJSON.join of type []string"},
		{`"node_name": "` + strings.Repeat("n", 129) + `"`, "node_name \"nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\"… is 129 bytes; at most 128"},
		{`"tags": ` + hugeTags, "tags take 612 bytes encoded, above serf's limit of 512"},
		{`"tags": {"lbx_x": "1"}`, `tag "lbx_x": keys starting with lbx_ are reserved`},
		{`"encrypt_key": 5`, "appJSON.encrypt_key of type string"},
		{`"bogus": 1`, `unknown field "bogus"`},
	} {
		t.Run(tc.json, func(t *testing.T) {
			raw := []byte(`{"node_name": "bounds", ` + tc.json + `}`)
			if strings.HasPrefix(tc.json, `"node_name"`) {
				raw = []byte(`{` + tc.json + `}`)
			}
			err := provisionJSON(raw)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v; want one containing %q", err, tc.want)
			}
		})
	}
}

// provisionJSON decodes the app from raw as Caddy does, and provisions
// it.
func provisionJSON(raw []byte) error {
	a := new(App)
	if err := caddy.StrictUnmarshalJSON(raw, a); err != nil {
		return err
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	return a.Provision(ctx)
}

// TestAppBoundsCaddyfile: the same bounds from the Caddyfile, each error
// with its line.
func TestAppBoundsCaddyfile(t *testing.T) {
	checkCaddyfileErrors(t, []caddyfileCase{
		{"cluster {\n join 10.0.0.1:7946 10.0.0.2:0\n}", `join "10.0.0.2:0": port 0 cannot be joined`},
		{"cluster {\n bind 127.0.0.1:70000\n}", `bind "127.0.0.1:70000": invalid port`},
		{"cluster {\n tags {\n  a " + strings.Repeat("x", 300) + "\n  b " + strings.Repeat("y", 300) + "\n }\n}", "above serf's limit of 512"},
	})
}

// TestRefreshBounds: refresh of dynamic serf, in JSON (the field named
// when it does not decode) and the Caddyfile.
func TestRefreshBounds(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`{"port": "80", "refresh": "1ns"}`, "dynamic serf: refresh 1ns is below the minimum 10ms"},
		{`{"port": "80", "refresh": "2h"}`, "dynamic serf: refresh 2h0m0s is above the maximum 1h0m0s"},
		{`{"port": "80", "refresh": "soon"}`, `refresh: time: invalid duration "soon"`},
		{`{"port": "80", "bogus": 1}`, `unknown field "bogus"`},
		{`{"port": "99999"}`, `port "99999": want a number from 1 to 65535`},
	} {
		var su SerfUpstreams
		err := caddy.StrictUnmarshalJSON([]byte(tc.json), &su)
		if err == nil {
			err = su.Validate()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("dynamic serf %s: error %v; want one containing %q", tc.json, err, tc.want)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{"serf 80 {\n refresh 1ns\n}", "dynamic serf: refresh 1ns is below the minimum 10ms, at Testfile:2"},
		{"serf 80 {\n refresh 2h\n}", "refresh 2h0m0s is above the maximum 1h0m0s, at Testfile:2"},
	} {
		err := new(SerfUpstreams).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
	}
}
