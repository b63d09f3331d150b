// Package testutil holds helpers shared by lbx's end-to-end tests.
package testutil

import (
	"testing"
	"time"
)

// WaitFor polls cond every 10 ms until it returns true, or fails the test
// once timeout has passed, with what and cond's last explanation. It is
// how tests wait on a condition instead of sleeping and hoping.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() (ok bool, why string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s; last: %s", timeout, what, why)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
