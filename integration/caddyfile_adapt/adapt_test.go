// Package caddyfileadapt holds lbx's golden Caddyfile adapt tests, where
// Caddy keeps its own (caddytest/integration/caddyfile_adapt): each
// testdata/*.caddyfiletest file is a Caddyfile and what it adapts to.
package caddyfileadapt

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-lbx/lbx"
)

// update rewrites the JSON expectations of the golden files with what the
// adapter makes of them now: `go -C integration test ./caddyfile_adapt -run TestAdapt -update`,
// then read the diff before committing it.
var update = flag.Bool("update", false, "rewrite the JSON expectations of the golden files")

// goldenSeparator splits a .caddyfiletest file into its Caddyfile and its
// expectation, as in Caddy's caddytest/integration/caddyfile_adapt.
const goldenSeparator = "----------"

// TestAdapt adapts the Caddyfile of each testdata/*.caddyfiletest file and
// compares the result with the expectation below the line of ten dashes:
// JSON, compared after indenting both sides the same way, or otherwise a
// substring that the adapter's error must contain (the message and its
// "Caddyfile:N" line). A Caddyfile that adapts must also be formatted as
// `caddy fmt` would (the adapter warns otherwise), and produce no warnings.
func TestAdapt(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.caddyfiletest"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no testdata/*.caddyfiletest files")
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".caddyfiletest"), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			input, want, err := splitGolden(data)
			if err != nil {
				t.Fatal(err)
			}
			got, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(input, nil)

			if !strings.HasPrefix(want, "{") {
				if err == nil {
					t.Fatalf("adapted without error; want an error containing:\n%s", want)
				}
				if !strings.Contains(err.Error(), want) {
					t.Fatalf("wrong error\n got: %v\nwant it to contain: %s", err, want)
				}
				return
			}

			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			for _, w := range warnings {
				t.Errorf("warning: %s:%d: %s: %s", file, w.Line, w.Directive, w.Message)
			}
			gotJSON, err := indentJSON(got)
			if err != nil {
				t.Fatalf("adapter output: %v\n%s", err, got)
			}
			if *update {
				out := strings.TrimRight(string(input), "\n") + "\n" + goldenSeparator + "\n" + gotJSON + "\n"
				if err := os.WriteFile(file, []byte(out), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			wantJSON, err := indentJSON([]byte(want))
			if err != nil {
				t.Fatalf("expected JSON in %s: %v", file, err)
			}
			if gotJSON != wantJSON {
				t.Errorf("adapted JSON differs from %s\n%s\n--- got:\n%s", file, lineDiff(wantJSON, gotJSON), gotJSON)
			}
		})
	}
}

// splitGolden returns the Caddyfile part of a .caddyfiletest file, which
// keeps its line numbers (the file's own), and the expectation, trimmed.
func splitGolden(data []byte) ([]byte, string, error) {
	text := strings.ReplaceAll(string(data), "\r\n", "\n")
	input, want, ok := strings.Cut(text, "\n"+goldenSeparator+"\n")
	if !ok {
		return nil, "", errMissingSeparator
	}
	want = strings.TrimSpace(want)
	if want == "" {
		return nil, "", errEmptyExpectation
	}
	return []byte(strings.TrimRight(input, " \t\n") + "\n"), want, nil
}

var (
	errMissingSeparator = errors.New("no line of ten dashes (" + goldenSeparator + ") between the Caddyfile and the expectation")
	errEmptyExpectation = errors.New("nothing below the line of ten dashes: want JSON or an error substring")
)

// indentJSON returns b re-indented with tabs, so that layout differences
// between the adapter's compact output and the hand-written file do not
// matter but key order and values do.
func indentJSON(b []byte) (string, error) {
	var compact, out bytes.Buffer
	if err := json.Compact(&compact, b); err != nil {
		return "", err
	}
	if err := json.Indent(&out, compact.Bytes(), "", "\t"); err != nil {
		return "", err
	}
	return out.String(), nil
}

// lineDiff marks the lines of want and got from the first one that
// differs, which is enough to locate a change in an indented document.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	i := 0
	for i < len(w) && i < len(g) && w[i] == g[i] {
		i++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "first difference at line %d:\n", i+1)
	for j := i; j < len(w) && j < i+5; j++ {
		b.WriteString("- " + w[j] + "\n")
	}
	for j := i; j < len(g) && j < i+5; j++ {
		b.WriteString("+ " + g[j] + "\n")
	}
	return b.String()
}
