//go:build !linux

package main

import (
	"errors"
	"syscall"
	"time"
)

// cpuSupported reports whether groupCPU can measure anything here: it
// reads /proc, which only Linux has.
const cpuSupported = false

func sysProcAttr() *syscall.SysProcAttr { return nil }

// signalGroup is not supported here; the caller falls back to signalling
// the process itself.
func signalGroup(int, syscall.Signal) error {
	return errors.ErrUnsupported
}

func groupCPU(int) (time.Duration, error) {
	return 0, errors.ErrUnsupported
}

func groupsCPU(...int) (time.Duration, error) {
	return 0, errors.ErrUnsupported
}

func loadAverage() string { return "" }

func cpuPressure() (time.Duration, bool) { return 0, false }

// processCPU is not measured here.
func processCPU() time.Duration { return 0 }

// processRSS is not available here.
func processRSS(int) (int64, error) { return 0, errors.New("RSS not available on this OS") }
