package lbxtest

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// leakGrace is how long RunCheckingLeaks waits for goroutines to end after
// the tests passed.
const leakGrace = 10 * time.Second

// RunCheckingLeaks runs m's tests and exits with their code, or with 1 if
// they passed but, 10 s later, goroutines whose stacks contain one of
// patterns (package paths such as "lbx/rebalance.") are still running:
// every member must have left, every connection closed and every timer
// fired. Call it from TestMain.
func RunCheckingLeaks(m *testing.M, patterns ...string) {
	code := m.Run()
	if code == 0 {
		var leaked []string
		deadline := time.Now().Add(leakGrace)
		for {
			leaked = Goroutines(patterns...)
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

// Goroutines returns the stacks of the goroutines, other than the
// caller's, that contain one of patterns (package paths, or function names
// such as "serfnet.(*Transport)"): a test counts its own kind of
// goroutine, which unrelated ones starting or ending do not change.
func Goroutines(patterns ...string) []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	// The caller's goroutine comes first.
	_, others, _ := strings.Cut(string(buf), "\n\n")
	var out []string
	for _, g := range strings.Split(others, "\n\n") {
		for _, p := range patterns {
			if strings.Contains(g, p) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}
