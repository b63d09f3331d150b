package main

import (
	"bytes"
	"encoding/json"
	"runtime"
	"strings"
	"testing"
	"time"
)

// testHeader is a finished run's header with every field set.
func testHeader() runHeader {
	return runHeader{Started: "2026-12-07T02:00:00Z", Elapsed: "1m0s", Estimate: "2m0s", CPUs: 2, LoadStart: "0.50", LoadEnd: "0.70"}
}

// TestRunHeaderJSON checks that the embedded header's fields stand at the
// top level of every report's JSON under their keys, and come back.
func TestRunHeaderJSON(t *testing.T) {
	h := testHeader()
	noEstimate := h
	noEstimate.Estimate = ""
	for _, tc := range []struct {
		name string
		rep  any
		back func([]byte) (runHeader, error)
		want map[string]any
	}{
		{"hash", &hashReport{runHeader: h}, func(b []byte) (runHeader, error) {
			var r hashReport
			err := json.Unmarshal(b, &r)
			return r.runHeader, err
		}, nil},
		{"shared", &sharedReport{runHeader: h}, func(b []byte) (runHeader, error) {
			var r sharedReport
			err := json.Unmarshal(b, &r)
			return r.runHeader, err
		}, nil},
		{"scenarios", &scenReport{runHeader: h, GOMAXPROC: 3}, func(b []byte) (runHeader, error) {
			var r scenReport
			err := json.Unmarshal(b, &r)
			return r.runHeader, err
		}, map[string]any{"gomaxprocs": 3.0}},
		{"run", &report{runHeader: noEstimate}, func(b []byte) (runHeader, error) {
			var r report
			err := json.Unmarshal(b, &r)
			return r.runHeader, err
		}, map[string]any{"estimate": nil}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := json.Marshal(tc.rep)
			if err != nil {
				t.Fatal(err)
			}
			var top map[string]any
			if err := json.Unmarshal(b, &top); err != nil {
				t.Fatal(err)
			}
			want := map[string]any{
				"started": "2026-12-07T02:00:00Z", "elapsed": "1m0s", "estimate": "2m0s", "cpus": 2.0,
				"loadavg_start": "0.50", "loadavg_end": "0.70", "runHeader": nil, "began": nil,
			}
			for k, v := range tc.want {
				want[k] = v
			}
			for k, v := range want {
				got, ok := top[k]
				switch {
				case v == nil && ok:
					t.Errorf("key %q present (%v), want none", k, got)
				case v != nil && got != v:
					t.Errorf("key %q = %v, want %v", k, got, v)
				}
			}
			got, err := tc.back(b)
			if err != nil {
				t.Fatal(err)
			}
			wantHdr := h
			if tc.name == "run" {
				wantHdr = noEstimate
			}
			if got != wantHdr {
				t.Errorf("round trip %+v, want %+v", got, wantHdr)
			}
		})
	}
}

// TestRunHeaderStartFinish checks what startRun, estimated and finish
// record.
func TestRunHeaderStartFinish(t *testing.T) {
	began := time.Now().Add(-90 * time.Second)
	h := startRun(began)
	if want := began.UTC().Format(time.RFC3339); h.Started != want {
		t.Errorf("Started %q, want %q", h.Started, want)
	}
	if h.CPUs != runtime.NumCPU() {
		t.Errorf("CPUs %d, want %d", h.CPUs, runtime.NumCPU())
	}
	if h.Elapsed != "" || h.Estimate != "" || h.LoadEnd != "" {
		t.Errorf("started header already has an end: %+v", h)
	}
	h.estimated(2*time.Minute + 400*time.Millisecond)
	if h.Estimate != "2m0s" {
		t.Errorf("Estimate %q, want 2m0s", h.Estimate)
	}
	h.finish()
	// 90 s ago, rounded to the second; a slow machine may add one.
	if h.Elapsed != "1m30s" && h.Elapsed != "1m31s" {
		t.Errorf("Elapsed %q, want 1m30s", h.Elapsed)
	}
	if (h.LoadStart == "") != (h.LoadEnd == "") {
		t.Errorf("load average known at one end only: %q, %q", h.LoadStart, h.LoadEnd)
	}
}

// TestRunHeaderMarkdown checks each report's header sentence and versions
// line, in each report's own wording.
func TestRunHeaderMarkdown(t *testing.T) {
	h := testHeader()
	versions := map[string]string{"go": "go1.26", "caddy": "v2.11.9", "nginx": "1.26", "haproxy": "3.0"}
	for _, tc := range []struct {
		name string
		rep  markdownReport
		want []string
	}{
		{"hash", &hashReport{runHeader: h, Versions: versions}, []string{
			"Started 2026-12-07T02:00:00Z; total wall time 1m0s (estimated 2m0s). Machine: 2 CPUs; load average 0.50 at start, 0.70 at end. " +
				"Versions: go: go1.26; caddy: v2.11.9; haproxy: 3.0.\n\n",
		}},
		{"shared", &sharedReport{runHeader: h, Versions: versions}, []string{
			"Started 2026-12-07T02:00:00Z; total wall time 1m0s (estimated 2m0s). Machine: 2 CPUs; load average 0.50 at start, 0.70 at end. " +
				"Versions: go: go1.26; caddy: v2.11.9.\n\n",
		}},
		{"scenarios", &scenReport{runHeader: h, GOMAXPROC: 3, Versions: versions}, []string{
			"Started 2026-12-07T02:00:00Z; total wall time 1m0s (estimated 2m0s). Machine: 2 CPUs (GOMAXPROCS 3); load average 0.50 at start, 0.70 at end. " +
				"Versions: go: go1.26; caddy: v2.11.9; nginx: 1.26; haproxy: 3.0.\n\n",
		}},
		{"run", &report{runHeader: runHeader{Started: h.Started, Elapsed: h.Elapsed, CPUs: 2}, Versions: versions}, []string{
			"Started 2026-12-07T02:00:00Z, took 1m0s. 2 CPUs; load average — at start, — at end. " +
				"Versions: go: go1.26; caddy: v2.11.9; nginx: 1.26; haproxy: 3.0.\n\n",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if err := tc.rep.writeMarkdown(&out); err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("report lacks %q:\n%s", w, out.String())
				}
			}
		})
	}
}
