package main

import (
	"bytes"
	"context"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/caddy-lbx/lbx/integration/fleetsim"
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
		!slices.Equal(cfg.scenarios, fleetsim.Scenarios) || cfg.timeline != "" || cfg.plot != "" || cfg.parallel < 1 {
		t.Errorf("defaults: %+v", cfg)
	}
	cfg, err = parseFleetsimFlags([]string{"-sizes", "20, 40", "-conns", "300", "-views", "exact,flow", "-balancers", "leastconn",
		"-scenarios", "scale-in-10,rolling-restart", "-seeds", "5", "-seed", "9", "-parallel", "1", "-timeline", "t.csv", "-plot", "docs/t.png"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.sizes, []int{20, 40}) || !slices.Equal(cfg.conns, []int{300}) || cfg.seeds != 5 || cfg.firstSeed != 9 || cfg.parallel != 1 ||
		!slices.Equal(cfg.views, []fleetsim.ViewKind{fleetsim.Exact, fleetsim.Flow}) ||
		!slices.Equal(cfg.balancers, []fleetsim.Balancer{fleetsim.LeastConn}) ||
		!slices.Equal(cfg.scenarios, []fleetsim.Scenario{fleetsim.ScaleIn10, fleetsim.RollingRestart}) || cfg.timeline != "t.csv" || cfg.plot != "docs/t.png" {
		t.Errorf("set: %+v", cfg)
	}
	for _, args := range [][]string{
		{"-sizes", "1"}, {"-sizes", "10,x"}, {"-sizes", "20000"}, {"-conns", "0"}, {"-views", "flow,gossip"},
		{"-balancers", "roundrobin"}, {"-scenarios", "double"}, {"-seeds", "0"}, {"-parallel", "0"}, {"extra"}, {"-nope"},
		{"-plot", "t.csv"},
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

// TestFleetsimPlotRun: -timeline and -plot, alone or together, record the
// 1000-node ×2 flow run behind random with the most connections; without
// it in the run, -plot is refused before anything runs.
func TestFleetsimPlotRun(t *testing.T) {
	cfg, err := parseFleetsimFlags([]string{"-sizes", "300,1000", "-conns", "100,1000", "-scenarios", "scale-in-10,scale-out-double"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	cases := fleetsimCases(cfg)
	if i, err := recordedCase(cfg, cases); i != -1 || err != nil {
		t.Errorf("neither flag: case %d, %v; want none", i, err)
	}
	for _, flags := range [][2]string{{"t.csv", ""}, {"", "t.png"}, {"t.csv", "t.png"}} {
		cfg.timeline, cfg.plot = flags[0], flags[1]
		i, err := recordedCase(cfg, cases)
		if err != nil {
			t.Fatalf("%q: %v", flags, err)
		}
		if c := cases[i]; c.scenario != fleetsim.Double || c.size != 1000 || c.conns != 1000 || c.view != fleetsim.Flow || c.balancer != fleetsim.Random {
			t.Errorf("%q: case %+v", flags, c)
		}
	}

	path := filepath.Join(t.TempDir(), "p.png")
	if err := runFleetsim(context.Background(), []string{"-sizes", "12", "-plot", path}, "", io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "-plot") {
		t.Errorf("-plot without the 1000-node run: %v; want an error", err)
	}
	if _, err := os.Stat(path); err == nil {
		t.Error("-plot refused, yet the file was made")
	}
}

// TestFleetsimPlotSpread: each interval's min, median and max of the old
// nodes (slots below the fleet's size before the scenario) and of the
// added ones, and the average, on fixed input; then the chart of a few
// intervals draws.
func TestFleetsimPlotSpread(t *testing.T) {
	nan := math.NaN()
	for _, c := range []struct {
		conns      []int
		nodes      int
		old, added [3]float64
		avg        float64
	}{
		{[]int{5, 0, 7, 3}, 2, [3]float64{0, 2.5, 5}, [3]float64{3, 5, 7}, 3.75},
		{[]int{9, 1, 4, 0, 0, 2}, 3, [3]float64{1, 4, 9}, [3]float64{0, 0, 2}, 8.0 / 3},
		// Before the first added node joins (-join-every).
		{[]int{4, 6}, 3, [3]float64{4, 5, 6}, [3]float64{nan, nan, nan}, 5},
	} {
		s := spreadOf(7, c.conns, c.nodes)
		same := func(a, b [3]float64) bool {
			for i := range a {
				if a[i] != b[i] && !(math.IsNaN(a[i]) && math.IsNaN(b[i])) {
					return false
				}
			}
			return true
		}
		if s.t != 7 || !same(s.old, c.old) || !same(s.added, c.added) || math.Abs(s.avg-c.avg) > 1e-9 {
			t.Errorf("%v of %d nodes: %+v; want old %v, added %v, average %v", c.conns, c.nodes, s, c.old, c.added, c.avg)
		}
	}

	cfg, err := parseFleetsimFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var spreads []connSpread
	for i := range 50 {
		conns := make([]int, 8)
		for k := range conns {
			if k < 4 {
				conns[k] = 100 - i - k
			} else {
				conns[k] = i + k
			}
		}
		spreads = append(spreads, spreadOf(i, conns, 4))
	}
	c := &fleetsimCase{scenario: fleetsim.Double, size: 4, conns: 100, view: fleetsim.Flow, balancer: fleetsim.Random}
	ch := fleetsimChart(cfg, c, fleetsim.Result{Converged: true, Intervals: 40}, spreads)
	if len(ch.Series) != 7 || ch.Series[1].Y[10] != 88.5 || ch.Series[4].Y[10] != 15.5 || ch.Series[6].Y[10] != 52 || !ch.Series[6].Dashed {
		t.Errorf("series: %+v", ch.Series)
	}
	if len(ch.Band) != 50 || math.Abs(ch.Band[10].Hi-52*1.2) > 1e-9 || len(ch.Marks) != 1 || ch.Marks[0].X != 40 {
		t.Errorf("band %v, marks %v", ch.Band, ch.Marks)
	}
	if !strings.HasPrefix(ch.Title, "4 nodes × 100 connections, ×2 behind a random balancer, flow view") {
		t.Errorf("title %q", ch.Title)
	}
	if err := ch.WritePNG(io.Discard); err != nil {
		t.Error(err)
	}
}
