//go:build unix

package rebalance

import (
	"syscall"
	"time"
)

// processCPUTime returns the CPU time (user + system) this process has
// used so far.
func processCPUTime() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}
