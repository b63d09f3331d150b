package rebalance

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestMain fails the run if, once every test is done, goroutines of serf,
// memberlist or this package (other than TestMain's own) are still
// running after a grace of 10 s: every node must have left and stopped.
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		var leaked []string
		deadline := time.Now().Add(10 * time.Second)
		for {
			leaked = leakedGoroutines()
			if len(leaked) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if len(leaked) > 0 {
			fmt.Fprintf(os.Stderr, "%d goroutines leaked:\n%s\n", len(leaked), strings.Join(leaked, "\n\n"))
			code = 1
		}
	}
	os.Exit(code)
}

// leakedGoroutines returns the stacks of goroutines running serf,
// memberlist or this package's code, other than the caller's.
func leakedGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "rebalance.TestMain") || strings.Contains(g, "rebalance.leakedGoroutines") {
			continue
		}
		if strings.Contains(g, "hashicorp/serf") || strings.Contains(g, "hashicorp/memberlist") || strings.Contains(g, "lbx/rebalance.") {
			out = append(out, g)
		}
	}
	return out
}
