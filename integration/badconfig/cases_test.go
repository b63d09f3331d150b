package badconfig

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
)

// TestBadConfigsKeepServing pushes the known-bad configs and a
// generated matrix over every option of every lbx module through POST
// /load while traffic flows: Caddy must refuse each bad one with an error
// that names the option, keep running, and keep serving the old config
// with no failed request.
func TestBadConfigsKeepServing(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs cmd/caddy")
	}
	s := newServer(t)
	cases := append(s.namedCases(), s.matrix()...)
	rejected, _ := s.run(cases)
	if rejected < len(cases)/3 {
		t.Errorf("only %d of %d cases were rejected; the matrix lost its teeth", rejected, len(cases))
	}
}

// namedCases are the findings of the hardening issue, each with the error
// it must give.
func (s *server) namedCases() []badCase {
	ewma := func(o map[string]any) bool {
		return o["policy"] == "ewma" && o["outlier"] != nil && o["weights"] != nil
	}
	panicPolicy := func(o map[string]any) bool { return o["policy"] == "panic" }
	hash := func(o map[string]any) bool { return o["policy"] == "consistent_hash" }
	partition := func(o map[string]any) bool {
		return o["handler"] == "partition" && o["upstreams"] != nil && o["proxy"] != nil
	}
	app := func(name string) func(cfg map[string]any) map[string]any {
		return func(cfg map[string]any) map[string]any { return cfg["apps"].(map[string]any)[name].(map[string]any) }
	}
	set := func(pred func(map[string]any) bool, path string, v any) func(map[string]any) {
		return func(cfg map[string]any) {
			for _, o := range find(cfg, pred) {
				setPath(o, path, v)
			}
		}
	}
	setApp := func(name, path string, v any) func(map[string]any) {
		return func(cfg map[string]any) { setPath(app(name)(cfg), path, v) }
	}
	return []badCase{
		s.jsonCase("ewma outlier interval -1s", "interval -1s", set(ewma, "outlier.interval", "-1s")),
		s.jsonCase("ewma outlier interval -1 (ns)", "interval -1ns", set(ewma, "outlier.interval", -1)),
		s.jsonCase("panic outlier interval -1s", "interval -1s", set(panicPolicy, "outlier.interval", "-1s")),
		s.jsonCase("panic slow_start window -1s", "window -1s", set(panicPolicy, "slow_start.window", "-1s")),
		s.jsonCase("consistent_hash outlier interval -1s", "interval -1s", set(hash, "outlier.interval", "-1s")),
		s.jsonCase("consistent_hash slow_start min_weight_percent 0", "min_weight_percent must be above 0%",
			set(hash, "slow_start.min_weight_percent", 0)),
		s.jsonCase("partition proxy ewma outlier interval -1s", "interval -1s",
			set(partition, "proxy.load_balancing.selection_policy.outlier.interval", "-1s")),
		s.jsonCase("ewma outlier interval 1ns", "interval 1ns", set(ewma, "outlier.interval", 1)),
		s.jsonCase("rebalance interval 1ns", "interval", setApp("rebalance", "interval", 1)),
		s.jsonCase("rebalance history 1000000h", "history", setApp("rebalance", "history", "1000000h")),
		s.jsonCase("rebalance threshold 1e18", "threshold", setApp("rebalance", "threshold", 1e18)),
		s.jsonCase("rebalance join_settle 1000000h", "join_settle", setApp("rebalance", "join_settle", "1000000h")),
		s.jsonCase("rebalance idle_close_after 500ms", "idle_close_after 500ms is below the minimum 1s",
			setApp("rebalance", "idle_close_after", "500ms")),
		s.jsonCase("rebalance idle_close_after 25h", "idle_close_after 25h0m0s is above the maximum 24h0m0s",
			setApp("rebalance", "idle_close_after", "25h")),
		s.jsonCase("rebalance cpu bogus", "cpu", setApp("rebalance", "cpu", "bogus")),
		s.jsonCase("rebalance cpu node with metric connections", "only used with metric cpu", setApp("rebalance", "cpu", "node")),
		s.jsonCase("cluster tags over 512 bytes", "tag", setApp("cluster", "tags.big", strings.Repeat("x", 600))),
		// Refused in Provision, before anything binds (192.0.2.1 is a
		// documentation address: binding it would fail with another error).
		s.jsonCase("cluster without a key beyond loopback", "no encrypt_key and bind 192.0.2.1:7946 is not loopback",
			setApp("cluster", "bind", "192.0.2.1:7946")),
		s.jsonCase("cluster encrypt_keys not base64", "encrypt_keys[1]: not valid base64",
			setApp("cluster", "encrypt_keys", []any{gossipKey, "not base64!"})),
		s.jsonCase("cluster encrypt_keys 5 bytes", "encrypt_keys[0]: decodes to 5 bytes; want 16, 24 or 32",
			setApp("cluster", "encrypt_keys", []any{"c2hvcnQ="})),
		s.jsonCase("cluster encrypt_keys duplicated", "encrypt_keys[1]: the same key as encrypt_keys[0]",
			setApp("cluster", "encrypt_keys", []any{gossipKey, gossipKey})),
		s.jsonCase("cluster encrypt_keys 17 keys", "encrypt_keys: 17 keys; at most 16",
			setApp("cluster", "encrypt_keys", slices.Repeat([]any{gossipKey}, 17))),
		s.jsonCase("cluster encrypt_keys with encrypt_key", "encrypt_key and encrypt_keys are both set", func(cfg map[string]any) {
			setApp("cluster", "encrypt_key", gossipKey)(cfg)
			setApp("cluster", "encrypt_keys", []any{gossipKey})(cfg)
		}),
		s.jsonCase("cluster encrypt_keys as a string", "encrypt_keys", setApp("cluster", "encrypt_keys", gossipKey)),
		s.jsonCase("cluster ops_key not base64", "ops_key: not valid base64", setApp("cluster", "ops_key", "not base64!")),
		s.jsonCase("cluster ops_key 5 bytes", "ops_key: decodes to 5 bytes; want 32", setApp("cluster", "ops_key", "c2hvcnQ=")),
		s.jsonCase("cluster ops_key all zero", "ops_key: decodes to 32 zero bytes",
			setApp("cluster", "ops_key", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")),
		s.jsonCase("cluster ops_key equal to the gossip key", "ops_key: the same key as a gossip key", func(cfg map[string]any) {
			setApp("cluster", "encrypt_key", gossipKey)(cfg)
			setApp("cluster", "ops_key", gossipKey)(cfg)
		}),
		s.jsonCase("partition poll_interval 1ns", "poll_interval", func(cfg map[string]any) {
			for _, o := range find(cfg, func(o map[string]any) bool { return o["handler"] == "partition" && o["naming_file"] != nil }) {
				o["poll_interval"] = 1
			}
		}),
		s.jsonCase("ewma decay as words", "decay", set(ewma, "decay", "soon")),
		s.jsonCase("ewma slow_start window as words", "window", set(ewma, "slow_start.window", "soon")),
		s.caddyfileCase("Caddyfile slow_start aggression NaN", "aggression NaN is not a finite number, at Caddyfile:",
			"aggression 1.5", "aggression NaN"),
		s.caddyfileCase("Caddyfile outlier interval 1ns", "interval 1ns is below the minimum 100ms, at Caddyfile:",
			"interval 10s\n\t\t\t\t\tsuccess_rate on", "interval 1ns\n\t\t\t\t\tsuccess_rate on"),
		s.caddyfileCase("Caddyfile partition to without a port", "Caddyfile:",
			"to "+s.vars["{B1}"]+" 0/2", "to localhost 0/2"),
		s.caddyfileCase("Caddyfile poll_interval 1ns", "Caddyfile:", "poll_interval 1s", "poll_interval 1ns"),
		s.caddyfileCase("Caddyfile max_merge_memory below a fan-out's reservation",
			"max_merge_memory 1048576 (1.0 MiB) is below what one fan-out may reserve, 2 × max_merged_body = 2097152 (2.0 MiB): raise max_merge_memory (default 1.0 GiB) or lower max_merged_body, at Caddyfile:",
			"max_merge_memory 1GiB", "max_merge_memory 1MiB\n\t\t\tmax_merged_body 1MiB"),
		s.caddyfileCase("Caddyfile duplicate rebalance block", "rebalance",
			"\trebalance {\n\t\tmetric", "\trebalance {\n\t}\n\trebalance {\n\t\tmetric"),
		s.caddyfileCase("Caddyfile rebalance interval 1ns", "Caddyfile:", "interval 1s\n\t\thistory", "interval 1ns\n\t\thistory"),
		s.caddyfileCase("Caddyfile rebalance history 1000000h", "Caddyfile:", "history 10s", "history 1000000h"),
		s.caddyfileCase("Caddyfile rebalance join_settle 0", `join_settle \"0\": want a positive duration such as 5s, or off, at Caddyfile:`, "boundary_timeout 30s", "boundary_timeout 30s\n\t\tjoin_settle 0"),
		s.caddyfileCase("Caddyfile encrypt_key twice the same key", "encrypt_keys[1]: the same key as encrypt_keys[0]", "node_name badconfig",
			"node_name badconfig\n\t\tencrypt_key "+gossipKey+" "+gossipKey),
		s.caddyfileCase("Caddyfile encrypt_key of 5 bytes", "encrypt_keys[1]: decodes to 5 bytes; want 16, 24 or 32 (AES-128, -192 or -256), at Caddyfile:", "node_name badconfig",
			"node_name badconfig\n\t\tencrypt_key "+gossipKey+" c2hvcnQ="),
		s.caddyfileCase("Caddyfile lbx_handoff with an argument", `lbx_handoff listener wrapper: unexpected argument \"on\"; it takes none, at Caddyfile:`, "\t\t\tlbx_handoff\n", "\t\t\tlbx_handoff on\n"),
		s.caddyfileCase("Caddyfile lbx_status with an argument", "unexpected argument", "\t\tlbx_status\n", "\t\tlbx_status verbose\n"),
		s.caddyfileCase("Caddyfile rebalance idle_close_after 1ms", "idle_close_after 1ms is below the minimum 1s, at Caddyfile:",
			"idle_close_after 2m", "idle_close_after 1ms"),
		s.caddyfileCase("Caddyfile rebalance cpu bogus", "Caddyfile:", "boundary_timeout 30s", "boundary_timeout 30s\n\t\tcpu bogus"),
	}
}

// gossipKey is a valid gossip key (32 bytes, base64) for the encrypt_key
// cases: each case is refused for another reason.
const gossipKey = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="

// find returns every object in v (depth first) for which pred holds.
func find(v any, pred func(map[string]any) bool) []map[string]any {
	var out []map[string]any
	switch x := v.(type) {
	case map[string]any:
		if pred(x) {
			out = append(out, x)
		}
		for _, k := range sortedKeys(x) {
			out = append(out, find(x[k], pred)...)
		}
	case []any:
		for _, e := range x {
			out = append(out, find(e, pred)...)
		}
	}
	return out
}

// setPath sets a dotted path of object keys under o, making objects as
// needed.
func setPath(o map[string]any, path string, v any) {
	keys := strings.Split(path, ".")
	for _, k := range keys[:len(keys)-1] {
		next, ok := o[k].(map[string]any)
		if !ok {
			next = map[string]any{}
			o[k] = next
		}
		o = next
	}
	o[keys[len(keys)-1]] = v
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Module objects of lbx, by their inline key and name; the matrix changes
// every option inside them.
var lbxModules = map[string][]string{
	"policy":  {"ewma", "panic", "cluster_load"},
	"handler": {"partition", "parallel", "rebalance_close", "selective", "lbx_status"},
	"source":  {"serf"},
	"wrapper": {"rebalance"},
	"merger":  {"json", "concat", "ndjson", "first"},
}

// moduleName returns the inline key and name of a module object, if o is
// one.
func moduleName(o map[string]any) (key, name string, ok bool) {
	for _, k := range []string{"policy", "handler", "source", "wrapper", "merger", "protocol", "provider"} {
		if n, isString := o[k].(string); isString {
			return k, n, true
		}
	}
	return "", "", false
}

func isLBX(o map[string]any) bool {
	k, n, ok := moduleName(o)
	return ok && slices.Contains(lbxModules[k], n)
}

// addressOptions take addresses and paths: the matrix gives them only a
// wrong type, never a value that would bind or dial somewhere else.
var addressOptions = map[string]bool{
	"bind": true, "advertise": true, "join": true, "dial": true, "naming_file": true, "node_name": true,
}

// mutation is one replacement value for an option, and what it is.
type mutation struct {
	what  string
	value any
}

// mutations returns the values the matrix tries for an option whose
// baseline value is v.
func mutations(key string, v any) []mutation {
	wrongType := mutation{"wrong type", map[string]any{"x": 1}}
	if addressOptions[key] {
		return []mutation{wrongType}
	}
	switch x := v.(type) {
	case float64:
		return []mutation{
			wrongType, {"a word", "x"}, {"NaN as a string", "NaN"}, {"negative", -1}, {"zero", 0},
			{"one", 1}, {"huge", 1e18}, {"larger than any int", 1e300}, {"fraction", 0.5},
			{"duration string negative", "-1s"}, {"duration string huge", "1000000h"},
		}
	case string:
		return []mutation{wrongType, {"empty", ""}, {"a word", "x y"}, {"number", 7}}
	case bool:
		return []mutation{{"wrong type", "yes"}}
	case []any:
		ms := []mutation{wrongType, {"empty", []any{}}, {"null element", []any{nil}}}
		if len(x) > 0 {
			ms = append(ms, mutation{"duplicated elements", append(slices.Clone(x), x...)})
		}
		return ms
	case map[string]any:
		return []mutation{{"wrong type", "x"}, {"empty", map[string]any{}}}
	}
	return []mutation{wrongType}
}

// matrix returns a case for every mutation of every option of every lbx
// module object in the baseline, plus an unknown option in each. A
// mutation may turn out valid (0 is often the default): the case then
// may load, and is undone.
func (s *server) matrix() []badCase {
	var base map[string]any
	if err := json.Unmarshal(s.baseJSON, &base); err != nil {
		s.t.Fatal(err)
	}
	var cases []badCase
	seen := map[string]bool{}
	var walk func(path []string, v any, inLBX bool)
	walk = func(path []string, v any, inLBX bool) {
		switch x := v.(type) {
		case map[string]any:
			_, _, isModule := moduleName(x)
			// partition's proxy is a stock reverse_proxy handler without
			// its inline key: Caddy's own options are not ours to test.
			stock := isModule || len(path) > 0 && path[len(path)-1] == "proxy"
			mine := isLBX(x) || (inLBX && !stock) || slices.Contains([]string{"apps.rebalance", "apps.cluster"}, strings.Join(path, "."))
			if mine {
				cases = append(cases, s.mutate(path, "lbx_no_such_option", "unknown option", 1, true))
			}
			for _, k := range sortedKeys(x) {
				if mine && !isInlineKey(x, k) {
					sig := strings.Join(append(generic(path), k), ".")
					if !seen[sig] {
						seen[sig] = true
						for _, m := range mutations(k, x[k]) {
							cases = append(cases, s.mutate(path, k, m.what, m.value, false))
						}
					}
				}
				walk(append(slices.Clone(path), k), x[k], mine)
			}
		case []any:
			// a selective group's routes are stock Caddy routes
			routes := len(path) > 0 && path[len(path)-1] == "routes"
			for i, e := range x {
				walk(append(slices.Clone(path), fmt.Sprint(i)), e, inLBX && !routes)
			}
		}
	}
	walk(nil, base, false)
	return cases
}

// isInlineKey reports whether k is the key that names o's module.
func isInlineKey(o map[string]any, k string) bool {
	key, _, ok := moduleName(o)
	return ok && k == key
}

// generic replaces array indexes in a path with "*", so that the same
// option of two list elements (two upstreams, two routes) is tried once.
func generic(path []string) []string {
	out := make([]string, len(path))
	for i, p := range path {
		if _, err := fmt.Sscan(p, new(int)); err == nil {
			p = "*"
		}
		out[i] = p
	}
	return out
}

// mutate returns a case with the option key of the object at path set to
// value. The error must name the option.
func (s *server) mutate(path []string, key, what string, value any, unknown bool) badCase {
	var cfg any
	if err := json.Unmarshal(s.baseJSON, &cfg); err != nil {
		s.t.Fatal(err)
	}
	o := cfg
	for _, p := range path {
		switch x := o.(type) {
		case map[string]any:
			o = x[p]
		case []any:
			var i int
			fmt.Sscan(p, &i)
			o = x[i]
		}
	}
	o.(map[string]any)[key] = value
	body, err := json.Marshal(cfg)
	if err != nil {
		s.t.Fatal(err)
	}
	name := fmt.Sprintf("%s.%s: %s (%s)", strings.Join(generic(path), "."), key, what, compact(value))
	c := badCase{name: name, contentType: "application/json", body: body, want: key, mayAccept: !unknown}
	if len(path) > 0 {
		// an entry of a map (a tag) may be named by the map's option
		c.orWant = path[len(path)-1]
	}
	return c
}

func compact(v any) string {
	b, _ := json.Marshal(v)
	if len(b) > 40 {
		return string(b[:40]) + "…"
	}
	return string(b)
}
