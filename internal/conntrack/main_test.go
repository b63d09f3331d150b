package conntrack

import (
	"testing"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestMain fails the run if, once every test is done, goroutines of this
// package are still running after a grace of 10 s: every close a shed
// started must have ended.
func TestMain(m *testing.M) {
	lbxtest.RunCheckingLeaks(m, "lbx/internal/conntrack.")
}
