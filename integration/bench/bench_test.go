package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestQuick runs the benchmark end to end in -quick mode: it builds
// cmd/caddy (once for the package's tests), starts the backends and two
// Caddy proxies, and sends a few
// seconds of load through each. It checks that the command works and that
// ewma served every request, never how fast anything was.
func TestQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs load for several seconds")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := run(ctx, []string{"-quick", "-caddy", testCaddy(t)}, "go test ./integration/bench", &out, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())

	if len(rep.Scenarios) != 1 || rep.Scenarios[0].Name != "A" {
		t.Fatalf("scenarios %+v, want just A", rep.Scenarios)
	}
	rows := rep.Scenarios[0].Rows
	if len(rows) != 2 {
		t.Fatalf("%d rows, want 2 (ewma, least_conn)", len(rows))
	}
	for _, r := range rows {
		if r.Throughput <= 0 || r.P50ms <= 0 {
			t.Errorf("row %s has no measurements: %+v", r.Policy, r)
		}
	}
	var ewmaCases int
	for _, c := range rep.Cases {
		if c.Policy != "ewma" {
			continue
		}
		ewmaCases++
		if c.Summary.Requests == 0 {
			t.Error("ewma case sent no requests")
		}
		if c.Summary.Errors != 0 {
			t.Errorf("ewma case had %d errors (%d timeouts)", c.Summary.Errors, c.Summary.Timeouts)
		}
	}
	if ewmaCases != 1 {
		t.Errorf("%d ewma cases, want 1", ewmaCases)
	}
	for _, want := range []string{"Command: `go test ./integration/bench`", "## Scenario A", "| lbx ewma |", "| Caddy least_conn |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

func TestParseFlags(t *testing.T) {
	c, err := parseFlags([]string{"-quick", "-policies", "ewma,random_choose2,nginx_least_conn", "-runs", "2"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.scenarios) != 1 || c.scenarios[0].name != "A" || c.duration != 3*time.Second || c.runs != 2 {
		t.Errorf("quick defaults not applied, or explicit flags overridden: %+v", c)
	}
	var keys []string
	for _, p := range c.policies {
		keys = append(keys, p.key)
	}
	if got := strings.Join(keys, ","); got != "ewma,random_choose_2,nginx" {
		t.Errorf("policies %s", got)
	}
	refusesAll(t, "parseFlags", parseFlags, [][]string{
		{"-policies", "fastest"},
		{"-scenarios", "D"},
		{"-rate", "0"},
		{"-runs", "0"},
		{"-jitter", "2"},
		{"extra"},
	})
}

func TestMedian(t *testing.T) {
	for _, c := range []struct {
		in   []float64
		want float64
	}{{[]float64{3}, 3}, {[]float64{5, 1, 3}, 3}, {[]float64{4, 1, 3, 2}, 2.5}} {
		if got := median(c.in); got != c.want {
			t.Errorf("median(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}

// testWriter sends the benchmark's progress lines to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
