package partition

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"
)

// TestUnhealthyReplicaRemovesCapacity: with passive health checks, a
// replica Caddy marks down leaves its partition without usable replicas,
// so its scheme's capacity drops to 0 and requests go to the other
// scheme.
func TestUnhealthyReplicaRemovesCapacity(t *testing.T) {
	e := newEnv(t)
	e.loadDeadReplica()

	failures := 0
	for i := range 200 {
		res := e.get("/")
		if res.status != http.StatusOK {
			failures++
			if failures > 1 {
				t.Fatalf("request %d failed again (status %d %q): the dead replica's scheme must have lost its capacity", i, res.status, res.body)
			}
		}
	}
	if failures != 1 {
		t.Logf("the dead scheme was never chosen in 200 draws (p = 2^-200 if capacities were equal)")
	}
}

// TestClientDisconnectCancelsPartitions: when the client goes away, every
// sub-request is cancelled, down to the backend connection.
func TestClientDisconnectCancelsPartitions(t *testing.T) {
	e := newEnv(t)
	s0, s1 := e.backend("s0"), e.backend("s1")
	for _, b := range []*backend{s0, s1} {
		b.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) { b.waitCancelled(r) })
	}
	e.load(partitionSite([]string{s0.addr + " 0/2", s1.addr + " 1/2"}, "timeout 30s"))

	e.leaveMidway(t, s0, s1)
}

// leaveMidway sends a request, goes away once both backends have it, and
// waits for both to see their request cancelled.
func (e *env) leaveMidway(t *testing.T, s0, s1 *backend) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.url("/"), nil)
	done := make(chan error, 1)
	go func() {
		_, err := e.do(req)
		done <- err
	}()
	waitFor(t, 5*time.Second, "both parts to reach their backends", func() (bool, string) {
		return s0.hits.Load() == 1 && s1.hits.Load() == 1, fmt.Sprintf("hits %d %d", s0.hits.Load(), s1.hits.Load())
	})
	cancel()
	if err := <-done; err == nil {
		t.Error("the client request should have been aborted")
	}
	waitFor(t, 5*time.Second, "both backends to see their request cancelled", func() (bool, string) {
		return s0.cancelled.Load() == 1 && s1.cancelled.Load() == 1, fmt.Sprintf("cancelled %d %d", s0.cancelled.Load(), s1.cancelled.Load())
	})
}

// TestRetryOnAnotherReplica: a partition whose first replica refuses
// connections is answered by its other replica within the same request.
func TestRetryOnAnotherReplica(t *testing.T) {
	e := newEnv(t)
	good0, good1 := e.backend("good0"), e.backend("good1")
	deadAddr := e.deadAddr() // connection refused
	// lb_policy first always tries the dead replica first.
	e.load(partitionSite([]string{good0.addr + " 0/2", deadAddr + " 1/2", good1.addr + " 1/2"}, "fail_limit 1", "lb_policy first"))
	for i := range 20 {
		if res := e.get("/"); res.status != http.StatusOK {
			t.Fatalf("request %d: status %d %q; a retry on the live replica must answer", i, res.status, res.body)
		}
	}
	if good1.hits.Load() != 20 {
		t.Errorf("good1 answered %d of 20", good1.hits.Load())
	}
}
