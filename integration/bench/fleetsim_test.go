package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/caddy-lbx/lbx/internal/fleetsim"
)

// TestFleetsimFlags: the defaults, every list flag, and the errors.
func TestFleetsimFlags(t *testing.T) {
	cfg, err := parseFleetsimFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.sizes, []int{100, 300, 1000}) || !slices.Equal(cfg.conns, []int{100, 1000}) || cfg.seeds != 3 || cfg.firstSeed != 1 ||
		!slices.Equal(cfg.views, []fleetsim.ViewKind{fleetsim.Flow, fleetsim.Tags, fleetsim.Exact}) ||
		!slices.Equal(cfg.balancers, []fleetsim.Balancer{fleetsim.Random, fleetsim.LeastConn}) ||
		!slices.Equal(cfg.scenarios, fleetsim.Scenarios) || cfg.timeline != "" || cfg.parallel < 1 {
		t.Errorf("defaults: %+v", cfg)
	}
	cfg, err = parseFleetsimFlags([]string{"-sizes", "20, 40", "-conns", "300", "-views", "exact,flow", "-balancers", "leastconn",
		"-scenarios", "scale-in-10,rolling-restart", "-seeds", "5", "-seed", "9", "-parallel", "1", "-timeline", "t.csv"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.sizes, []int{20, 40}) || !slices.Equal(cfg.conns, []int{300}) || cfg.seeds != 5 || cfg.firstSeed != 9 || cfg.parallel != 1 ||
		!slices.Equal(cfg.views, []fleetsim.ViewKind{fleetsim.Exact, fleetsim.Flow}) ||
		!slices.Equal(cfg.balancers, []fleetsim.Balancer{fleetsim.LeastConn}) ||
		!slices.Equal(cfg.scenarios, []fleetsim.Scenario{fleetsim.ScaleIn10, fleetsim.RollingRestart}) || cfg.timeline != "t.csv" {
		t.Errorf("set: %+v", cfg)
	}
	for _, args := range [][]string{
		{"-sizes", "1"}, {"-sizes", "10,x"}, {"-sizes", "20000"}, {"-conns", "0"}, {"-views", "flow,gossip"},
		{"-balancers", "roundrobin"}, {"-scenarios", "double"}, {"-seeds", "0"}, {"-parallel", "0"}, {"extra"}, {"-nope"},
	} {
		if _, err := parseFleetsimFlags(args, io.Discard); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}

// TestFleetsimSmall runs the command on a small fleet: a table per
// scenario with a row per view and balancer; -timeline without the
// 1000-node run is refused.
func TestFleetsimSmall(t *testing.T) {
	var out bytes.Buffer
	err := runFleetsim(context.Background(), []string{"-sizes", "12", "-conns", "200", "-seeds", "2", "-scenarios", "scale-out-double,scale-in-10"}, "bench fleetsim", &out, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	s := out.String()
	if strings.Count(s, "\n## ") != 2 || strings.Count(s, "| 12 | 200 |") != 12 {
		t.Errorf("want 2 tables of 6 rows:\n%s", s)
	}
	path := filepath.Join(t.TempDir(), "t.csv")
	if err := runFleetsim(context.Background(), []string{"-sizes", "12", "-timeline", path}, "", io.Discard, io.Discard); err == nil {
		t.Error("-timeline without the 1000-node run: no error")
	}
	if _, err := os.Stat(path); err == nil {
		t.Error("-timeline refused, yet the file was made")
	}
}

// TestFleetsimTimeline: a header of node names, then a line per interval,
// as wide as the first (nodes that join later would not fit, and do not
// happen after interval 0).
func TestFleetsimTimeline(t *testing.T) {
	path := filepath.Join(t.TempDir(), "t.csv")
	record, finish, err := timelineWriter(path)
	if err != nil {
		t.Fatal(err)
	}
	record(0, []int{5, 0, 7})
	record(1, []int{4, 1, 7})
	if err := finish(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := "interval,n00000,n00001,n00002\n0,5,0,7\n1,4,1,7\n"; string(b) != want {
		t.Errorf("timeline:\n%s\nwant:\n%s", b, want)
	}
}
