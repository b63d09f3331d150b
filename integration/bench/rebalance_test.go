package main

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// TestParseRebalanceFlags: the front defaults to random, every front name
// is taken, and an unknown front or an out-of-bounds value is refused.
func TestParseRebalanceFlags(t *testing.T) {
	c, err := parseRebalanceFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if c.front != fleet.FrontRandom || c.from != 3 || c.scenario != "scale-out" {
		t.Errorf("defaults: front %q, from %d, scenario %q", c.front, c.from, c.scenario)
	}
	if c.plot != "docs/rebalance-scaleout.png" {
		t.Errorf("default plot %q", c.plot)
	}
	for args, want := range map[string]string{
		"-scenario rolling-restart":             "docs/rebalance-rolling-restart.png",
		"-scenario rolling-restart -plot x.png": "x.png",
		"-plot none":                            "",
	} {
		c, err := parseRebalanceFlags(strings.Fields(args), &bytes.Buffer{})
		if err != nil || c.plot != want {
			t.Errorf("%s: plot %q, %v; want %q", args, c.plot, err, want)
		}
	}
	for _, name := range fleet.FrontNames {
		c, err := parseRebalanceFlags([]string{"-front", name, "-runs", "2"}, &bytes.Buffer{})
		if err != nil || c.front != name || c.runs != 2 {
			t.Errorf("-front %s -runs 2: %+v, %v", name, c, err)
		}
	}
	refusesAll(t, "parseRebalanceFlags", parseRebalanceFlags, [][]string{
		{"-front", "haproxy"},
		{"-front", ""},
		{"-front", "leastconn"},
		{"-from", "2"},
		{"-nodes", "13"},
		{"-runs", "0"},
		{"-clients", "59"},
		{"-down", "-1s"},
		{"extra"},
	})
}

// refusesAll checks that parse, a command's flag parser named name,
// refuses every argument list in bad.
func refusesAll[C any](t *testing.T, name string, parse func([]string, io.Writer) (C, error), bad [][]string) {
	t.Helper()
	for _, args := range bad {
		if _, err := parse(args, &bytes.Buffer{}); err == nil {
			t.Errorf("%s(%q) accepted", name, args)
		}
	}
}
