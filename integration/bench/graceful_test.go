package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

func TestParseGracefulFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-scenario", "x"}, "-scenario"},
		{[]string{"-runs", "0"}, "-runs"},
		{[]string{"-get", "10", "-post", "10", "-python", "10"}, "at least 60"},
		{[]string{"-scenario", "rolling-restart", "-get", "5", "-post", "0", "-python", "0"}, "at least 10 per node"},
		{[]string{"-scenario", "reload", "-get", "0", "-post", "0", "-python", "0"}, "no clients"},
		{[]string{"-get", "-1"}, "negative"},
		{[]string{"-front", "nginx"}, "-front"},
		{[]string{"-scenario", "reload", "-builds", "apache"}, "-builds"},
		{[]string{"-burn", "65"}, "-burn"},
		{[]string{"-every", "1ms"}, "-every"},
		{[]string{"extra"}, "unexpected"},
	} {
		_, err := parseGracefulFlags(c.args, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v; want an error with %q", c.args, err, c.want)
		}
	}
	cfg, err := parseGracefulFlags(nil, &bytes.Buffer{})
	if err != nil || cfg.mix.Total() != 1000 || cfg.mix.Every != 500*time.Millisecond || len(cfg.fronts) != 2 || cfg.reloads != 100 || cfg.nodes != 6 {
		t.Fatalf("defaults: %+v, %v", cfg, err)
	}
	cfg, err = parseGracefulFlags([]string{"-scenario", "reload", "-get", "3"}, &bytes.Buffer{})
	if err != nil || cfg.mix.GET != 3 || cfg.mix.POST != 64 || cfg.mix.Python != 16 || len(cfg.builds) != 3 {
		t.Fatalf("reload's defaults: %+v, %v", cfg, err)
	}
	cfg, err = parseGracefulFlags([]string{"-quick", "-scenario", "reload", "-post", "5"}, &bytes.Buffer{})
	if err != nil || cfg.runs != 1 || cfg.reloads != 10 || cfg.mix.GET != 12 || cfg.mix.POST != 5 || len(cfg.builds) != 3 {
		t.Fatalf("-quick: %+v, %v", cfg, err)
	}
}

// TestGracefulRows: each kind's ids are checked against the backend's
// count, the "all" row sums them, and the medians take each count's
// median over the runs.
func TestGracefulRows(t *testing.T) {
	ctr := fleet.NewIDCounter()
	for _, id := range []string{"get-0-0", "get-0-1", "get-0-1", "post-0-0", "post-0-2"} {
		ctr.Count(id)
	}
	tallies := []fleet.Tally{
		{Client: fleet.ClientGoGET, Prefix: "get", Clients: 1, Requests: 3, Failures: map[string]int{fleet.KindEOF: 1}, Reused: 1, Stale: 1, Lost: []string{"get-0-2"}},
		{Client: fleet.ClientGoPOST, Prefix: "post", Clients: 1, Requests: 3, Failures: map[string]int{fleet.KindReset: 1}, Reused: 1, Lost: []string{"post-0-2"}},
	}
	rows, _ := gracefulRows("random", tallies, ctr)
	if len(rows) != 3 {
		t.Fatalf("%d rows; want 3", len(rows))
	}
	get, post, all := rows[0], rows[1], rows[2]
	if get.Lost != 1 || get.Reached != 0 || get.Duplicated != 1 {
		t.Errorf("GET row %+v; want 1 lost, not reached, 1 duplicated", get)
	}
	if post.Lost != 1 || post.Reached != 1 || post.Duplicated != 0 {
		t.Errorf("POST row %+v; want 1 lost that reached the backend", post)
	}
	if all.Client != "all" || all.Requests != 6 || all.Failed != 2 || all.Stale != 1 || all.Lost != 2 || all.Reached != 1 || all.Duplicated != 1 ||
		all.Kinds[fleet.KindEOF] != 1 || all.Kinds[fleet.KindReset] != 1 {
		t.Errorf("all row %+v", all)
	}
	run := func(failed, shed int) gracefulRun {
		return gracefulRun{Rows: []gracefulRow{{Group: "random", Client: "all", Failed: failed, Shed: shed, Ideal: 10, Kinds: map[string]int{fleet.KindEOF: failed}}}}
	}
	med := medianGracefulRows([]gracefulRun{run(5, 12), run(1, 30), run(9, 11)})
	if len(med) != 1 || med[0].Failed != 5 || med[0].Shed != 12 || med[0].Kinds[fleet.KindEOF] != 5 {
		t.Errorf("medians %+v; want 5 failed, 12 shed", med)
	}
	rows[2].Shed, rows[2].Ideal = 4, 3.2
	var out bytes.Buffer
	writeGracefulTable(&out, gracefulScaleOut, rows)
	for _, want := range []string{
		"| random | Go raw POST | 1 | 3 | 1 | 1 (0) | 0 | 1 | 0 | 0 | 0 | 1 (1) | 0 |  |  |  |",
		"| random | **all** | 2 | 6 | 2 | 2 (1) | 1 | 1 | 0 | 0 | 0 | 2 (1) | 1 | 4 | 3 | 1.25× |",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no row %q in\n%s", want, out.String())
		}
	}
}

// TestGracefulReloadSmall runs `bench graceful -scenario reload` briefly
// with lbx_handoff: the node starts, proxies to the counting backend,
// takes every reload, and every kind of client sends requests that the
// backend counts. It does not ask for zero failures: that is what the
// full run measures.
func TestGracefulReloadSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy processes")
	}
	bin := testCaddy(t)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	runs, err := runGraceful(ctx, []string{"-caddy", bin, "-scenario", "reload", "-quick", "-builds", buildHandoff,
		"-reloads", "2", "-gap", "100ms", "-get", "2", "-post", "2", "-python", "2", "-every", "100ms"}, "bench graceful", &out, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Log(out.String())
	if len(runs) != 1 {
		t.Fatalf("%d runs; want 1", len(runs))
	}
	for _, r := range runs[0].Rows {
		if r.Requests == 0 || r.Requests == r.Failed {
			t.Errorf("%s, %s: %d requests, %d failed; want requests served", r.Group, r.Client, r.Requests, r.Failed)
		}
		if r.Duplicated != 0 {
			t.Errorf("%s, %s: %d duplicated", r.Group, r.Client, r.Duplicated)
		}
	}
	if !strings.Contains(out.String(), "| lbx_handoff | **all** | 6 |") {
		t.Error("no all row for lbx_handoff with 6 clients")
	}
}

// TestDrainNote: a failure counts as the drain's from the node's SIGTERM
// to one period after its restart, and not otherwise.
func TestDrainNote(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	at := func(ms int) fleet.ClientError {
		return fleet.ClientError{At: t0.Add(time.Duration(ms) * time.Millisecond)}
	}
	restarts := []fleet.RestartResult{{Stopped: t0.Add(time.Second), Started: t0.Add(3 * time.Second)}}
	errs := []fleet.ClientError{at(500), at(1000), at(2000), at(3400), at(3600), at(9000)}
	got := drainNote("random", errs, restarts, 500*time.Millisecond)
	if !strings.Contains(got, "random: 3 of the 6 failures came while a node drained or was down") {
		t.Errorf("note %q; want 3 of 6", got)
	}
}
