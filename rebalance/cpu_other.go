//go:build !unix

package rebalance

import (
	"errors"
	"time"
)

// processCPUTime is not available on this platform.
func processCPUTime() (time.Duration, error) {
	return 0, errors.New("process CPU time is not available on this platform")
}
