package selective

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestTimeoutCoversRequestBody: timeout bounds the whole call, reading the
// request body included. A client that sends its body over longer than
// the timeout gets 408 at about the timeout, and no group sees the
// request; a body within the timeout is answered as usual. A body larger
// than max_replay_body, which streams to one group, is bounded too.
func TestTimeoutCoversRequestBody(t *testing.T) {
	e := newEnv(t)
	a, b := e.backend("a"), e.backend("b")
	const timeout = 500 * time.Millisecond
	e.load(fmt.Sprintf("\tselective {\n%s\t\ttimeout %v\n\t\tmax_replay_body 1KiB\n\t}", groupsOf("", a, b), timeout))
	addr := fmt.Sprintf("127.0.0.1:%d", httpPort)

	// 1000 bytes (kept for replay) over 4 s: far from complete at the
	// deadline.
	res, err := lbxtest.SlowBody(addr, "/", 1000, 4*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != 408 {
		t.Fatalf("slow body: status %d %q, want 408", res.Status, res.Body)
	}
	t.Logf("slow body: %d after %v, %d of its bytes sent", res.Status, res.Elapsed.Round(time.Millisecond), res.Sent)
	if res.Elapsed < timeout-50*time.Millisecond || res.Elapsed > timeout+1500*time.Millisecond {
		t.Errorf("slow body answered after %v, want about the timeout %v", res.Elapsed, timeout)
	}
	if res.Sent >= 1000 {
		t.Errorf("the whole body was sent (%d bytes) before the answer", res.Sent)
	}
	if !res.Close {
		t.Errorf("no Connection: close on the 408 (the rest of the body is not read)")
	}
	if n := a.arrived.Load() + b.arrived.Load(); n != 0 {
		t.Errorf("groups saw %d requests whose body never arrived", n)
	}

	// A body sent over 100 ms, within the timeout, works.
	res, err = lbxtest.SlowBody(addr, "/", 1000, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != 200 {
		t.Fatalf("body within the timeout: status %d %q, want 200", res.Status, res.Body)
	}
	if n := a.hits.Load() + b.hits.Load(); n != 1 {
		t.Errorf("groups answered %d requests with the whole body, want 1", n)
	}

	// 20 KB, over max_replay_body, streams to one group: the deadline
	// still ends it at about the timeout, and the group's request is
	// cancelled.
	res, err = lbxtest.SlowBody(addr, "/", 20000, 4*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != 408 {
		t.Errorf("slow streamed body: status %d %q, want 408", res.Status, res.Body)
	}
	if res.Elapsed > timeout+1500*time.Millisecond {
		t.Errorf("slow streamed body answered after %v, want about the timeout %v", res.Elapsed, timeout)
	}
	if res.Sent >= 20000 {
		t.Errorf("the whole body was sent (%d bytes) before the answer", res.Sent)
	}
	if !res.Close {
		t.Errorf("no Connection: close on the streamed body's 408")
	}
	waitFor(t, 5*time.Second, "the group's streamed request to break off", func() (bool, string) {
		n := a.partial.Load() + b.partial.Load()
		return n == 1, fmt.Sprintf("%d requests broke off", n)
	})
}
