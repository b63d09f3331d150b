package main

import (
	"bytes"
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
	for _, name := range fleet.FrontNames {
		c, err := parseRebalanceFlags([]string{"-front", name, "-runs", "2"}, &bytes.Buffer{})
		if err != nil || c.front != name || c.runs != 2 {
			t.Errorf("-front %s -runs 2: %+v, %v", name, c, err)
		}
	}
	for _, bad := range [][]string{
		{"-front", "haproxy"},
		{"-front", ""},
		{"-front", "leastconn"},
		{"-from", "2"},
		{"-nodes", "13"},
		{"-runs", "0"},
		{"-clients", "59"},
		{"-down", "-1s"},
		{"extra"},
	} {
		if _, err := parseRebalanceFlags(bad, &bytes.Buffer{}); err == nil {
			t.Errorf("parseRebalanceFlags(%q) accepted", bad)
		}
	}
}
