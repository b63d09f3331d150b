package rebalance

import (
	"testing"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestMain fails the run if, once every test is done, goroutines of serf,
// memberlist, this package or the connection tracker under it are still
// running after a grace of 10 s: every node must have left and stopped.
func TestMain(m *testing.M) {
	lbxtest.RunCheckingLeaks(m, "hashicorp/serf", "hashicorp/memberlist", "lbx/rebalance.", "lbx/internal/conntrack.")
}
