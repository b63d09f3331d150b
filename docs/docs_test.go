// Package docs_test checks the code blocks of README.md and docs/*.md:
// every Caddyfile block adapts without a warning and is `caddy fmt`
// clean, every JSON block parses, and the configs that can be validated
// validate. A block is named by its file and the line of its opening
// fence, e.g. docs/ewma.md:40.
//
// The info string of a fence says what a block is (GitHub reads only its
// first word):
//
//	```caddy                a whole Caddyfile
//	```caddy fragment       the body of a site block (directives)
//	```json                 a whole Caddy JSON config
//	```json fragment        a piece of JSON; it must parse
//	```json fragment handler  one HTTP handler object; also validated,
//	                        as the only handler of a server
//	```json fragment policy   one selection_policy object; also validated,
//	                        in a reverse_proxy to three upstreams
//
// Syntax summaries with <placeholders> are ```text blocks, not checked.
//
// caddy.Validate provisions every module without starting any app, so it
// binds no socket: Caddy's HTTP app and lbx's cluster and rebalance apps
// listen and join only in Start. Gossip bind addresses in the docs must be
// addresses this machine does not have, so that an app that bound in
// Provision would fail the test rather than listen. The exception is
// reverse_proxy's active health checks, which Caddy starts probing in
// Provision: a config with them is adapted and checked but not validated
// (the test logs it).
package docs_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-lbx/lbx"
)

// gossipKey is the value of LBX_GOSSIP_KEY while the blocks are
// validated, so that examples reading their encrypt_key from the
// environment ({env.LBX_GOSSIP_KEY}) have a valid one: 32 bytes, base64.
const gossipKey = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="

// opsKey is the value of LBX_OPS_KEY, for examples with
// ops_key {env.LBX_OPS_KEY}: 32 bytes, base64, not the gossip key.
const opsKey = "b3BzLWtleS1vZi10aGUtdGVzdHMtMzItYnl0ZXMtISE="

// block is a fenced code block of a Markdown file.
type block struct {
	file string
	line int      // of the opening fence
	name string   // file:line of the opening fence
	lang string   // the info string's first word
	tags []string // the info string's other words
	body []byte   // the lines between the fences, each ending in "\n"
}

func (b block) has(tag string) bool { return slices.Contains(b.tags, tag) }

// fence opens or closes a code block: up to three spaces, then three or
// more backticks, then the info string.
var fence = regexp.MustCompile("^( {0,3})(```+)(.*)$")

// readBlocks returns the fenced code blocks of a Markdown file. The
// indentation of an opening fence (a block inside a list item) is removed
// from the block's lines.
func readBlocks(t *testing.T, file string) []block {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var (
		blocks []block
		open   *block
		indent string
		ticks  string
	)
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		m := fence.FindStringSubmatch(line)
		switch {
		case open == nil && m != nil:
			words := strings.Fields(m[3])
			open = &block{file: file, line: n, name: fmt.Sprintf("%s:%d", file, n)}
			if len(words) > 0 {
				open.lang, open.tags = words[0], words[1:]
			}
			indent, ticks = m[1], m[2]
		case open != nil && m != nil && len(m[2]) >= len(ticks) && strings.TrimSpace(m[3]) == "":
			blocks = append(blocks, *open)
			open = nil
		case open != nil:
			open.body = append(open.body, strings.TrimPrefix(line, indent)+"\n"...)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if open != nil {
		t.Fatalf("%s: code block never closed", open.name)
	}
	return blocks
}

// markdownFiles are the files whose blocks are checked, relative to the
// repository root.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join("docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{"README.md"}, docs...)
}

// chdirRoot makes the repository root the working directory, so that
// relative paths in the examples (examples/partition.server_list) are
// found as they are when Caddy runs from a checkout.
func chdirRoot(t *testing.T) {
	t.Helper()
	t.Chdir("..")
	if _, err := os.Stat("go.mod"); err != nil {
		t.Fatalf("not at the repository root: %v", err)
	}
}

// TestCodeBlocks checks every caddy and json block of README.md and
// docs/*.md.
func TestCodeBlocks(t *testing.T) {
	chdirRoot(t)
	t.Setenv("LBX_GOSSIP_KEY", gossipKey)
	t.Setenv("LBX_OPS_KEY", opsKey)
	storage := t.TempDir()

	checked := 0
	for _, file := range markdownFiles(t) {
		for _, b := range readBlocks(t, file) {
			switch {
			case b.lang == "caddy" || b.lang == "caddyfile":
				checked++
				t.Run(b.name, func(t *testing.T) { checkCaddyfile(t, b, storage) })
			case strings.HasPrefix(b.lang, "caddy"):
				t.Errorf("%s: info string %q: want caddy or caddyfile", b.name, b.lang)
			case b.lang == "json":
				checked++
				t.Run(b.name, func(t *testing.T) { checkJSON(t, b, storage) })
			}
		}
	}
	// A parser that found nothing would pass everything.
	if checked < 20 {
		t.Errorf("found only %d caddy and json blocks; is the fence parser broken?", checked)
	}
}

// checkCaddyfile checks a Caddyfile block: formatted as `caddy fmt`
// formats it, adapted without error or warning, and validated.
func checkCaddyfile(t *testing.T, b block, storage string) {
	input := b.body
	offset := 0 // lines the wrapping adds above the block
	switch {
	case len(b.tags) == 0:
	case len(b.tags) == 1 && b.has("fragment"):
		// Indenting every line by one tab keeps a formatted fragment
		// formatted, so the adapter's formatting check stays meaningful.
		var w bytes.Buffer
		w.WriteString(":8080 {\n")
		for _, line := range strings.SplitAfter(string(b.body), "\n") {
			if strings.TrimSpace(line) != "" {
				w.WriteString("\t")
			}
			w.WriteString(line)
		}
		w.WriteString("}\n")
		input, offset = w.Bytes(), 1
	default:
		t.Fatalf("info string caddy %s: the only tag a Caddyfile block takes is fragment", strings.Join(b.tags, " "))
	}

	if got := caddyfile.Format(b.body); !bytes.Equal(got, b.body) {
		t.Errorf("not formatted as `caddy fmt` formats it:\n%s", lineDiff(b, string(got)))
	}

	// The adapter numbers the lines of its input; errors and warnings are
	// reported at the Markdown file's lines.
	fileLine := func(n int) int { return b.line + n - offset }
	adapted, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(input, map[string]any{"filename": b.file})
	for _, w := range warnings {
		t.Errorf("adapter warning at %s:%d: %s", b.file, fileLine(w.Line), w.Message)
	}
	if err != nil {
		at := regexp.MustCompile(regexp.QuoteMeta(b.file) + `:(\d+)`)
		msg := at.ReplaceAllStringFunc(err.Error(), func(m string) string {
			n, _ := strconv.Atoi(at.FindStringSubmatch(m)[1])
			return fmt.Sprintf("%s:%d", b.file, fileLine(n))
		})
		t.Fatalf("adapting: %s", msg)
	}
	validate(t, adapted, storage)
}

// checkJSON checks a JSON block: it parses, and a whole config, a
// handler or a selection policy validates.
func checkJSON(t *testing.T, b block, storage string) {
	if !json.Valid(b.body) {
		var v any
		t.Fatalf("not valid JSON: %v", json.Unmarshal(b.body, &v))
	}
	switch {
	case len(b.tags) == 0:
		// A whole config: nothing but Caddy's top-level keys.
		dec := json.NewDecoder(bytes.NewReader(b.body))
		dec.DisallowUnknownFields()
		if err := dec.Decode(new(caddy.Config)); err != nil {
			t.Fatalf("not a Caddy config (mark a piece of one ```json fragment): %v", err)
		}
		validate(t, b.body, storage)
	case slices.Equal(b.tags, []string{"fragment"}):
	case slices.Equal(b.tags, []string{"fragment", "handler"}):
		validate(t, []byte(`{"apps": {"http": {"servers": {"srv0": {
			"listen": [":8080"],
			"routes": [{"handle": [`+string(b.body)+`]}]
		}}}}}`), storage)
	case slices.Equal(b.tags, []string{"fragment", "policy"}):
		validate(t, []byte(`{"apps": {"http": {"servers": {"srv0": {
			"listen": [":8080"],
			"routes": [{"handle": [{
				"handler": "reverse_proxy",
				"upstreams": [{"dial": "10.0.0.1:80"}, {"dial": "10.0.0.2:80"}, {"dial": "10.0.0.3:80"}],
				"load_balancing": {"selection_policy": `+string(b.body)+`}
			}]}]
		}}}}}`), storage)
	default:
		t.Fatalf("info string json %s: want no tag, fragment, fragment handler or fragment policy", strings.Join(b.tags, " "))
	}
}

// validate loads cfg with caddy.Validate, which provisions and validates
// every module and then cleans up, starting nothing. Logs are discarded
// and storage goes to a temporary directory unless the config says
// otherwise.
func validate(t *testing.T, cfg []byte, storage string) {
	t.Helper()
	var decoded any
	if err := json.Unmarshal(cfg, &decoded); err != nil {
		t.Fatalf("config: %v", err)
	}
	if probes := activeHealthChecks(decoded, "config"); probes != "" {
		t.Logf("not validated: %s has active health checks, which reverse_proxy starts probing in Provision", probes)
		return
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(cfg, &top); err != nil {
		t.Fatalf("config: %v", err)
	}
	checkGossipBind(t, top)
	if _, ok := top["logging"]; !ok {
		top["logging"] = json.RawMessage(`{"logs": {"default": {"writer": {"output": "discard"}}}}`)
	}
	if _, ok := top["storage"]; !ok {
		s, _ := json.Marshal(map[string]string{"module": "file_system", "root": storage})
		top["storage"] = s
	}
	full, err := json.Marshal(top)
	if err != nil {
		t.Fatal(err)
	}
	var c caddy.Config
	if err := json.Unmarshal(full, &c); err != nil {
		t.Fatalf("decoding the config: %v", err)
	}
	if err := caddy.Validate(&c); err != nil {
		t.Errorf("caddy.Validate: %v\nconfig: %s", err, cfg)
	}
}

// checkGossipBind makes sure that validating the config cannot open a
// gossip socket: the cluster app binds only in Start, and a bind address
// this machine does not have (10.0.0.1, a documentation address) turns a
// Provision that bound anyway into an error instead of a listener.
func checkGossipBind(t *testing.T, top map[string]json.RawMessage) {
	t.Helper()
	var apps map[string]struct {
		Bind *string `json:"bind"`
	}
	if json.Unmarshal(top["apps"], &apps) != nil {
		return
	}
	for _, name := range []string{"cluster", "rebalance"} {
		app, ok := apps[name]
		if !ok || (name == "rebalance" && app.Bind == nil) {
			continue
		}
		bind := "0.0.0.0:7946" // the default
		if app.Bind != nil {
			bind = *app.Bind
		}
		host, _, err := net.SplitHostPort(bind)
		ip := net.ParseIP(host)
		if err != nil || ip == nil || ip.IsLoopback() || ip.IsUnspecified() {
			t.Errorf("%s app: bind %q: give a documentation address such as 10.0.0.1:7946, which this machine cannot listen on", name, bind)
		}
	}
}

// activeHealthChecks returns the JSON path of the first health_checks
// object with an active member in v (a decoded config), or "".
func activeHealthChecks(v any, path string) string {
	switch v := v.(type) {
	case map[string]any:
		if hc, ok := v["health_checks"].(map[string]any); ok && hc["active"] != nil {
			return path + ".health_checks"
		}
		for _, k := range slices.Sorted(maps.Keys(v)) {
			if p := activeHealthChecks(v[k], path+"."+k); p != "" {
				return p
			}
		}
	case []any:
		for i, el := range v {
			if p := activeHealthChecks(el, fmt.Sprintf("%s[%d]", path, i)); p != "" {
				return p
			}
		}
	}
	return ""
}

// lineDiff shows the first line of b that formatting changes.
func lineDiff(b block, got string) string {
	w, g := strings.Split(string(b.body), "\n"), strings.Split(got, "\n")
	for i := 0; i < len(w) || i < len(g); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return fmt.Sprintf("%s:%d:\n  as written: %q\n  caddy fmt:  %q", b.file, b.line+1+i, wl, gl)
		}
	}
	return "(only trailing space differs)"
}

// TestModulePages checks that every module page has the template's
// sections, in order.
func TestModulePages(t *testing.T) {
	chdirRoot(t)
	sections := []string{"Summary", "Caddyfile syntax", "JSON", "Semantics", "Admin / metrics / events", "Limits"}
	for _, page := range []string{"ewma", "outlier", "panic", "consistent_hash", "partition", "parallel", "selective", "cluster", "rebalance", "handoff", "status"} {
		file := filepath.Join("docs", page+".md")
		data, err := os.ReadFile(file)
		if err != nil {
			t.Error(err)
			continue
		}
		var got []string
		for _, line := range strings.Split(string(data), "\n") {
			if h, ok := strings.CutPrefix(line, "## "); ok {
				got = append(got, strings.TrimSpace(h))
			}
		}
		if !slices.Equal(got, sections) {
			t.Errorf("%s: sections %q; want %q", file, got, sections)
		}
	}
}

// link is a Markdown link target: a path, an anchor, or both.
var link = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestLinks checks that every relative link of README.md and docs/*.md
// points at a file that exists, and an anchor at a heading of it.
func TestLinks(t *testing.T) {
	chdirRoot(t)
	anchors := map[string]map[string]bool{}
	headingsOf := func(file string) map[string]bool {
		if a, ok := anchors[file]; ok {
			return a
		}
		a, seen := map[string]bool{}, map[string]int{}
		data, _ := os.ReadFile(file)
		inCode := false
		for _, line := range strings.Split(string(data), "\n") {
			if fence.MatchString(line) {
				inCode = !inCode
			}
			if inCode || !strings.HasPrefix(line, "#") {
				continue
			}
			slug := githubSlug(strings.TrimLeft(line, "#"))
			if n := seen[slug]; n > 0 {
				// GitHub numbers repeated headings: x, x-1, x-2.
				a[fmt.Sprintf("%s-%d", slug, n)] = true
			} else {
				a[slug] = true
			}
			seen[slug]++
		}
		anchors[file] = a
		return a
	}
	for _, file := range markdownFiles(t) {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		inCode := false
		for n, line := range strings.Split(string(data), "\n") {
			if fence.MatchString(line) {
				inCode = !inCode
			}
			if inCode {
				continue
			}
			for _, m := range link.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, anchor, _ := strings.Cut(target, "#")
				dest := file
				if path != "" {
					dest = filepath.Join(filepath.Dir(file), path)
					if _, err := os.Stat(dest); err != nil {
						t.Errorf("%s:%d: link %s: %v", file, n+1, target, err)
						continue
					}
				}
				if anchor != "" && !headingsOf(dest)[anchor] {
					t.Errorf("%s:%d: link %s: %s has no heading with that anchor", file, n+1, target, dest)
				}
			}
		}
	}
}

// githubSlug returns the anchor GitHub gives a heading: lower case,
// punctuation dropped, spaces turned into hyphens.
func githubSlug(heading string) string {
	var b strings.Builder
	for _, r := range strings.TrimSpace(strings.ToLower(heading)) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}
