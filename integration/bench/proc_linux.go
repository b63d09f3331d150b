//go:build linux

package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTick is the unit of the CPU times in /proc/<pid>/stat (USER_HZ,
// which Linux fixes at 100 per second for userspace).
const clockTick = 10 * time.Millisecond

// cpuSupported reports whether groupCPU can measure anything here.
const cpuSupported = true

// sysProcAttr puts a child in its own process group (so it and any
// children of its own can be signalled together) and asks the kernel to
// kill it if the benchmark dies without stopping it.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// signalGroup sends sig to the process group led by pid.
func signalGroup(pid int, sig syscall.Signal) error {
	return syscall.Kill(-pid, sig)
}

// groupCPU returns the user + system CPU time used so far by every live
// process in the process group pgid (all threads included).
func groupCPU(pgid int) (time.Duration, error) {
	return groupsCPU(pgid)
}

// groupsCPU returns the user + system CPU time used so far by every live
// process in the process groups pgids together, in one pass over /proc
// (a pass reads every process's stat file: one per group would cost a
// dozen nodes a dozen passes).
func groupsCPU(pgids ...int) (time.Duration, error) {
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		return 0, err
	}
	var ticks int64
	found := make(map[int]bool, len(pgids))
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // the process exited meanwhile
		}
		pgrp, t, err := parseStat(b)
		if err != nil || !slices.Contains(pgids, pgrp) {
			continue
		}
		ticks += t
		found[pgrp] = true
	}
	for _, g := range pgids {
		if !found[g] {
			return 0, fmt.Errorf("no process in group %d", g)
		}
	}
	return time.Duration(ticks) * clockTick, nil
}

// parseStat extracts the process group and utime+stime (in clock ticks)
// from the contents of /proc/<pid>/stat. The command name (field 2) may
// contain spaces and parentheses, so fields are counted from the last ')'.
func parseStat(b []byte) (pgrp int, ticks int64, err error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("malformed stat line")
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state); pgrp is field 5, utime 14, stime 15.
	if len(f) < 13 {
		return 0, 0, fmt.Errorf("short stat line")
	}
	pg, err1 := strconv.Atoi(string(f[2]))
	ut, err2 := strconv.ParseInt(string(f[11]), 10, 64)
	st, err3 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return 0, 0, fmt.Errorf("malformed stat numbers")
	}
	return pg, ut + st, nil
}

// loadAverage returns the 1-, 5- and 15-minute load averages of
// /proc/loadavg, space-separated, or "" if unknown.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := bytes.Fields(b)
	if len(f) < 3 {
		return ""
	}
	return string(bytes.Join(f[:3], []byte(" ")))
}

// cpuPressure returns the kernel's cumulative CPU pressure stall time
// (/proc/pressure/cpu, "some": time during which at least one runnable task
// was waiting for a CPU). Its growth over a window, divided by the window,
// tells how contended the machine was.
func cpuPressure() (time.Duration, bool) {
	b, err := os.ReadFile("/proc/pressure/cpu")
	if err != nil {
		return 0, false
	}
	for line := range bytes.Lines(b) {
		f := bytes.Fields(line)
		if len(f) == 0 || string(f[0]) != "some" {
			continue
		}
		for _, kv := range f[1:] {
			if v, ok := bytes.CutPrefix(kv, []byte("total=")); ok {
				us, err := strconv.ParseInt(string(v), 10, 64)
				return time.Duration(us) * time.Microsecond, err == nil
			}
		}
	}
	return 0, false
}

// processCPU returns the process's user and system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// processRSS returns the resident set size of process pid, from
// /proc/<pid>/status (VmRSS).
func processRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("VmRSS of %d: %w", pid, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("no VmRSS for process %d", pid)
}
