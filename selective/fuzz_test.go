package selective

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// FuzzHandlerJSON pushes hostile handler objects through what POST /load
// does before it starts anything (decode, provision, validate, clean up):
// it must never panic, and never allocate or spend in proportion to a
// number in the config.
func FuzzHandlerJSON(f *testing.F) {
	group := `{"name":"a","routes":[{"handle":[{"handler":"reverse_proxy","upstreams":[{"dial":"127.0.0.1:9"}]}]}]}`
	for _, s := range []string{
		`{"handler":"selective"}`,
		`{"handler":"selective","groups":[` + group + `]}`,
		`{"handler":"selective","groups":[` + group + `,` + group + `]}`,
		`{"handler":"selective","groups":[` + group + `],"max_retry":1000000000}`,
		`{"handler":"selective","groups":[` + group + `],"policy":{"policy":"hash"}}`,
		`{"handler":"selective","groups":[` + group + `],"policy":{"policy":"failover","threshold":-1}}`,
		`{"handler":"selective","groups":[` + group + `],"backup_request":-1,"backup_budget":1e308}`,
		`{"handler":"selective","groups":[` + group + `],"retry_on":["dial","999"],"timeout":"1ns"}`,
		`{"handler":"selective","groups":[` + group + `],"max_replay_body":9223372036854775807}`,
		`{"handler":"selective","groups":[null]}`,
		`{"handler":"selective","groups":[{"name":"b","weight":-5,"routes":[]}]}`,
		`{"handler":"selective","groups":[{"name":"b","routes":[{"handle":[{"handler":"selective","groups":[` + group + `]}]}]}]}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, handler string) {
		lbxtest.ValidateHostile(t, lbxtest.HandlerConfig([]byte(handler)))
	})
}

// FuzzCaddyfile adapts hostile selective blocks: the adapter must never
// panic, and an error must say where it is.
func FuzzCaddyfile(f *testing.F) {
	for _, s := range []string{
		"group a {\n\t\treverse_proxy 127.0.0.1:9\n\t}\n\tpolicy hash {http.request.header.X}",
		"group a weight 3 {\n\t\trespond ok\n\t}\n\tbackup_request 10ms\n\tbackup_budget 5%",
		"group {\n\t}",
		"group a weight {\n\t}",
		"policy failover 150%",
		"retry_on 503 dial error timeout 99",
		"status_header",
		"max_replay_body 1KiB",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		if strings.ContainsAny(body, "\x00") {
			return
		}
		input := ":8080\n\nselective {\n\t" + body + "\n}\n"
		_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
		if err != nil && !strings.Contains(err.Error(), "Caddyfile:") && !strings.Contains(err.Error(), "selective") {
			t.Fatalf("an error that names neither the line nor the directive: %v", err)
		}
	})
}
