// Package lbxtest holds helpers shared by lbx's tests: those of more than
// one package, and the integration module's (as caddytest does for
// Caddy's). It is test code: no Caddy module of lbx imports it.
package lbxtest

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
