package main

import (
	"fmt"
	"runtime"
	"strings"
	"time"
)

// runHeader is what every report of a measured run (bench, scenarios,
// shared, hash) says about the run itself: when it started, how long it
// took against its estimate, and how busy the machine was. Reports embed
// it, so its JSON keys stand among theirs.
type runHeader struct {
	// Started is the run's start, RFC 3339 in UTC.
	Started string `json:"started"`
	// Elapsed is the run's wall time, to the second.
	Elapsed string `json:"elapsed"`
	// Estimate is the wall time the run expected before it began; left
	// out where the run makes no estimate (bench run).
	Estimate string `json:"estimate,omitempty"`
	// CPUs is runtime.NumCPU() of the machine.
	CPUs int `json:"cpus"`
	// LoadStart and LoadEnd are the 1-, 5- and 15-minute load averages
	// when the report is begun and when the run ends; left out where
	// unknown.
	LoadStart string `json:"loadavg_start,omitempty"`
	LoadEnd   string `json:"loadavg_end,omitempty"`

	began time.Time
}

// startRun begins a report's header for a run that began at began (taken
// before the tools are built, so that Elapsed counts the build too); the
// load average is read now.
func startRun(began time.Time) runHeader {
	return runHeader{
		Started:   began.UTC().Format(time.RFC3339),
		CPUs:      runtime.NumCPU(),
		LoadStart: loadAverage(),
		began:     began,
	}
}

// estimated records the run's expected wall time.
func (h *runHeader) estimated(est time.Duration) { h.Estimate = est.Round(time.Second).String() }

// finish records the end of the run: its wall time and the load average.
func (h *runHeader) finish() {
	h.LoadEnd = loadAverage()
	h.Elapsed = time.Since(h.began).Round(time.Second).String()
}

// writeMarkdown writes the header's sentence, "Started …; total wall time
// … (estimated …). Machine: N CPUs…; load average … at start, … at end. ",
// to b; machineNote follows the CPU count (empty for none).
func (h *runHeader) writeMarkdown(b *strings.Builder, machineNote string) {
	fmt.Fprintf(b, "Started %s; total wall time %s (estimated %s). Machine: %d CPUs%s; load average %s at start, %s at end. ",
		h.Started, h.Elapsed, h.Estimate, h.CPUs, machineNote, orDash(h.LoadStart), orDash(h.LoadEnd))
}

// writeVersions writes "Versions: k: v; …." for those of keys that
// versions has, in the order of keys, and ends the paragraph.
func writeVersions(b *strings.Builder, versions map[string]string, keys ...string) {
	var vs []string
	for _, k := range keys {
		if v, ok := versions[k]; ok {
			vs = append(vs, k+": "+v)
		}
	}
	fmt.Fprintf(b, "Versions: %s.\n\n", strings.Join(vs, "; "))
}
