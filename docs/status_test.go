package docs_test

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestStatusSitesLoopback checks the status sites the docs and the
// examples show: every server that serves lbx_status without allow_remote
// listens on loopback addresses only, so that the documented examples
// cannot be reached on another address (issue 22, finding 4: a site
// address of http://127.0.0.1:P alone listens on *:P). The handler's own
// refusal of remote clients is status's TestHandlerPrivateByDefault.
func TestStatusSitesLoopback(t *testing.T) {
	chdirRoot(t)
	t.Setenv("LBX_GOSSIP_KEY", gossipKey)

	// The checker must catch the form the finding was about.
	bad, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte("http://127.0.0.1:2020 {\n\thandle /lbx/* {\n\t\tlbx_status\n\t}\n}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if open, n := publicStatusListeners(t, bad); len(open) == 0 || n != 1 {
		t.Fatalf("the unbound status site reads as %d status servers listening on %v; want 1 on *:2020", n, open)
	}

	var sources []struct{ name, body string }
	for _, file := range markdownFiles(t) {
		for _, b := range readBlocks(t, file) {
			if (b.lang == "caddy" || b.lang == "caddyfile") && len(b.tags) == 0 {
				sources = append(sources, struct{ name, body string }{b.name, string(b.body)})
			}
		}
	}
	examples, err := filepath.Glob(filepath.Join("examples", "*Caddyfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range examples {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		sources = append(sources, struct{ name, body string }{file, string(data)})
	}

	sites := 0
	for _, src := range sources {
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src.body), map[string]any{"filename": src.name})
		if err != nil {
			t.Errorf("%s: adapting: %v", src.name, err) // TestCodeBlocks says more
			continue
		}
		open, n := publicStatusListeners(t, cfg)
		sites += n
		for _, addr := range open {
			t.Errorf("%s: a server with lbx_status (no allow_remote) listens on %s: bind it to 127.0.0.1", src.name, addr)
		}
	}
	// docs/status.md and examples/Caddyfile have one each: a search that
	// found none would pass everything.
	if sites < 2 {
		t.Errorf("found %d servers with a private lbx_status; want at least 2 (docs/status.md, examples/Caddyfile)", sites)
	}
}

// publicStatusListeners returns the listen addresses beyond loopback of
// the servers of cfg that serve lbx_status without allow_remote, and how
// many such servers there are.
func publicStatusListeners(t *testing.T, cfg []byte) (open []string, servers int) {
	t.Helper()
	var top struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Listen []string        `json:"listen"`
					Routes json.RawMessage `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(cfg, &top); err != nil {
		t.Fatal(err)
	}
	for _, srv := range top.Apps.HTTP.Servers {
		var routes any
		if err := json.Unmarshal(srv.Routes, &routes); err != nil && len(srv.Routes) > 0 {
			t.Fatal(err)
		}
		if !hasPrivateStatus(routes) {
			continue
		}
		servers++
		for _, l := range srv.Listen {
			if !loopbackListener(l) {
				open = append(open, l)
			}
		}
	}
	slices.Sort(open)
	return open, servers
}

// hasPrivateStatus reports whether v, a piece of a server's routes, holds
// an lbx_status handler without allow_remote.
func hasPrivateStatus(v any) bool {
	switch v := v.(type) {
	case map[string]any:
		if v["handler"] == "lbx_status" && v["allow_remote"] != true {
			return true
		}
		for _, x := range v {
			if hasPrivateStatus(x) {
				return true
			}
		}
	case []any:
		if slices.ContainsFunc(v, hasPrivateStatus) {
			return true
		}
	}
	return false
}

// loopbackListener reports whether a server's listen address is a
// loopback IP literal (a host name, an empty host or a wildcard is not).
func loopbackListener(l string) bool {
	na, err := caddy.ParseNetworkAddress(l)
	if err != nil {
		return false
	}
	if na.IsUnixNetwork() {
		return true
	}
	ip := net.ParseIP(na.Host)
	return ip != nil && ip.IsLoopback()
}
