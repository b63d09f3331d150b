package selective

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A backup in a one-group pool goes to an idle replica, never to the one
// trying the call nor to one busy with other work: with `first` (wrapped
// by panic, which tracks what a request tried) call 1 goes to a, its
// backup to b; call 2 goes to a too, and its backup must skip a (its own)
// and b (busy with call 1's backup) for c, the only idle one. Leaving out
// only the running replica, as before, sends it to b, which answers after
// a second.
func TestBackupSameGroupGoesToIdleReplica(t *testing.T) {
	e := newEnv(t)
	a, b, c := e.backend("a"), e.backend("b"), e.backend("c")
	a.delay.Store(int64(time.Second))
	b.delay.Store(int64(time.Second))
	e.load(fmt.Sprintf(`	selective {
		group only {
			reverse_proxy %s %s %s {
				lb_policy panic {
					policy first
				}
			}
		}
		backup_request 50ms
		status_header
	}`, a.addr, b.addr, c.addr))
	var wg sync.WaitGroup
	var first reply
	wg.Add(1)
	go func() {
		defer wg.Done()
		first = e.get("/")
	}()
	waitFor(t, 5*time.Second, "call 1 and its backup at a and b", func() (bool, string) {
		return a.hits.Load() == 1 && b.hits.Load() == 1, fmt.Sprint(a.hits.Load(), b.hits.Load())
	})
	start := time.Now()
	r := e.get("/")
	took := time.Since(start)
	wg.Wait()
	if r.status != 200 || r.body != "c" || !strings.Contains(r.header.Get("X-Selective"), "backup=won") {
		t.Fatalf("call 2: %d %q (%s) after %v; want c's answer by the backup", r.status, r.body, r.header.Get("X-Selective"), took)
	}
	if first.status != 200 || (first.body != "a" && first.body != "b") {
		t.Errorf("call 1: %d %q; want a's or b's answer", first.status, first.body)
	}
	if c.hits.Load() != 1 || b.hits.Load() != 1 || a.hits.Load() != 2 {
		t.Errorf("hits a %d, b %d, c %d; want 2, 1, 1", a.hits.Load(), b.hits.Load(), c.hits.Load())
	}
}

// A group of one replica never gets a second attempt of the same call:
// the backup has nowhere to go (backup=busy) and the replica sees the
// request once.
func TestBackupGroupOfOneSendsNone(t *testing.T) {
	e := newEnv(t)
	slow := e.backend("slow")
	slow.delay.Store(int64(300 * time.Millisecond))
	e.load(fmt.Sprintf(`	selective {
		group only {
			reverse_proxy %s
		}
		backup_request 20ms
		status_header
	}`, slow.addr))
	for range 3 {
		r := e.get("/")
		if r.status != 200 || r.body != "slow" || !strings.Contains(r.header.Get("X-Selective"), "backup=busy") {
			t.Fatalf("got %d %q (%s); want slow's answer, with no backup (backup=busy)", r.status, r.body, r.header.Get("X-Selective"))
		}
	}
	if n := slow.hits.Load(); n != 3 {
		t.Fatalf("the replica saw %d requests for 3 calls; want 3", n)
	}
	if h := e.admin().Handlers[0]; h.BackupBusy != 3 {
		t.Errorf("admin backup_busy %d; want 3", h.BackupBusy)
	}
}

// queueBackend is a backend with one worker: requests wait their turn,
// and each takes work (the bench harness's kind of backend).
type queueBackend struct {
	name string
	addr string
	mu   sync.Mutex
	work atomic.Int64 // ns
	hits atomic.Int64
}

func (e *env) queueBackend(name string) *queueBackend {
	b := &queueBackend{name: name}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.hits.Add(1)
		b.mu.Lock()
		defer b.mu.Unlock()
		select {
		case <-time.After(time.Duration(b.work.Load())):
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, b.name)
	}))
	b.addr = srv.Listener.Addr().String()
	e.t.Cleanup(srv.Close)
	return b
}

// A call queued at a replica that is making progress (finishing the
// requests ahead of it every 20ms) sends no backup at 200ms, although
// another replica is idle: it is counted as queued, and the idle replica
// gets nothing. A call at a replica that finishes nothing — busy with
// that call alone, or frozen with a queue — is stuck and is hedged.
// Before the stuck test, every queued call that waited past the delay
// sent its backup to the idle replica.
func TestBackupOnlyWhenStuck(t *testing.T) {
	e := newEnv(t)
	a, b := e.queueBackend("a"), e.queueBackend("b")
	a.work.Store(int64(20 * time.Millisecond))
	e.load(fmt.Sprintf(`	selective {
		group only {
			reverse_proxy %s %s {
				lb_policy panic {
					policy first
				}
			}
		}
		backup_request 200ms
		status_header
	}`, a.addr, b.addr))
	calls := func(n int) []reply {
		replies := make([]reply, n)
		var wg sync.WaitGroup
		for i := range replies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				replies[i] = e.do(http.MethodGet, "/")
			}()
		}
		wg.Wait()
		return replies
	}
	queued := 0
	for i, r := range calls(15) {
		if r.err != nil || r.status != 200 || r.body != "a" {
			t.Fatalf("queued call %d: %v %d %q; want a's answer", i, r.err, r.status, r.body)
		}
		if strings.Contains(r.header.Get("X-Selective"), "backup=queued") {
			queued++
		}
	}
	if n := b.hits.Load(); n != 0 || queued == 0 {
		t.Fatalf("calls queued at a progressing replica: the idle one got %d backups, %d calls said backup=queued; want none and some", n, queued)
	}
	if h := e.admin().Handlers[0]; h.BackupQueued != uint64(queued) {
		t.Errorf("admin backup_queued %d; want %d", h.BackupQueued, queued)
	}

	// One call, alone at a replica that takes a second over it: stuck.
	a.work.Store(int64(time.Second))
	r := e.get("/")
	if r.body != "b" || !strings.Contains(r.header.Get("X-Selective"), "backup=won") {
		t.Fatalf("a call alone at a stuck replica: %q (%s); want b's answer by the backup", r.body, r.header.Get("X-Selective"))
	}
	// Three calls at a frozen replica: none finishes, so each is stuck.
	won := 0
	for _, r := range calls(3) {
		if r.body == "b" {
			won++
		}
	}
	if won == 0 {
		t.Fatalf("calls queued at a frozen replica: no answer from b; want backups sent")
	}
}

// When the group the policy picks for a backup has no spare replica, the
// backup goes to another replica of the group already trying the call:
// group b's only replica is the one the first attempt is at (Caddy counts
// requests per address), so the backup goes to a2 in group a. Before,
// the backup was given up as busy.
func TestBackupFallsBackToSameGroup(t *testing.T) {
	e := newEnv(t)
	a1, a2 := e.backend("a1"), e.backend("a2")
	a1.delay.Store(int64(time.Second))
	e.load(fmt.Sprintf(`	selective {
		group a {
			reverse_proxy %s %s {
				lb_policy panic {
					policy first
				}
			}
		}
		group b {
			reverse_proxy %s
		}
		policy failover
		backup_request 50ms
		status_header
	}`, a1.addr, a2.addr, a1.addr))
	r := e.get("/")
	if r.body != "a2" || !strings.Contains(r.header.Get("X-Selective"), "a; attempts=2; tried=a; backup=won") {
		t.Fatalf("got %q (%s); want a2's answer by a backup in group a", r.body, r.header.Get("X-Selective"))
	}
	if n := a1.hits.Load(); n != 1 {
		t.Errorf("a1 saw %d requests; want 1 (no backup to the replica trying the call)", n)
	}
}
