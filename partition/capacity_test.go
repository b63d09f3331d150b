package partition

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// TestLargeLayoutFollowsHealth checks that a layout judged by its audit
// (more than exactSlots replicas) still sends no request to a scheme
// without capacity, notices an ejection (through the ejection epoch)
// without a new naming version, and names a bounded number of partitions
// in its 503 text.
func TestLargeLayoutFollowsHealth(t *testing.T) {
	l, hosts := chooseCase(t, "unusable", 5000)
	defer hosts.Release()
	if l.audited.Load() == nil {
		t.Fatalf("a layout of %d slots has no audit (exactSlots %d)", l.slots, exactSlots)
	}
	now := monoclock.Now()
	for i := range 200 {
		s := l.choose(func(n int) int { return (i * 7) % n }, now)
		if s == nil || s.count != 3 {
			t.Fatalf("draw %d chose a scheme of %d partitions; want the live scheme of 3", i, schemeCount(s))
		}
	}
	// Eject the only replica of p1 of the live scheme: within a deadline
	// no scheme has capacity any more.
	live := l.schemes[0].parts[1][0]
	live.stats.Eject(monoclock.Now(), 0, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures)
	deadline := time.Now().Add(5 * time.Second)
	for l.choose(func(n int) int { return 0 }, monoclock.Now()) != nil {
		if time.Now().After(deadline) {
			t.Fatal("the ejection was not seen within 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	msg := l.describe(monoclock.Now())
	if want := "no usable replica for p1 (1 ejected)"; !strings.Contains(msg, want) {
		t.Errorf("describe: %q; want it to contain %q", msg, want)
	}
	if len(msg) > 400 || !strings.Contains(msg, "p3 (1249 ejected)") {
		t.Errorf("describe (%d bytes): %q; want the empty partitions with their ejected counts, bounded", len(msg), msg)
	}
}

// TestDrawUpstreams checks the aperture: a large partition hands the
// policy at most aperture distinct candidates, usable ones first; a
// partition whose only usable replica is one of thousands still finds
// it; retries get replicas not tried yet.
func TestDrawUpstreams(t *testing.T) {
	l, hosts := chooseCase(t, "live", 5000)
	defer hosts.Release()
	part := l.schemes[0].parts[0]
	st := &subState{replicas: part, sample: l.audited.Load().schemes[0].parts[0].sample}
	req, _ := http.NewRequestWithContext(context.WithValue(context.Background(), subStateKey{}, st), http.MethodGet, "/", nil)
	ups, err := source{}.GetUpstreams(req)
	if err != nil {
		t.Fatal(err)
	}
	if len(ups) != aperture {
		t.Fatalf("%d candidates from a partition of %d; want %d", len(ups), len(part), aperture)
	}
	seen := map[string]bool{}
	for _, u := range ups {
		if seen[u.Dial] {
			t.Fatalf("candidate %s handed twice", u.Dial)
		}
		seen[u.Dial] = true
	}

	// All but one ejected: that one is found (through the audit's sample
	// once the draws miss).
	now := monoclock.Now()
	for _, r := range part[1:] {
		r.stats.Eject(now, 0, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures)
	}
	l.audited.Store(l.takeAudit(monoclock.Now()))
	st = &subState{replicas: part, sample: l.audited.Load().schemes[0].parts[0].sample}
	req, _ = http.NewRequestWithContext(context.WithValue(context.Background(), subStateKey{}, st), http.MethodGet, "/", nil)
	ups, _ = source{}.GetUpstreams(req)
	if len(ups) != 1 || ups[0].Dial != part[0].dial {
		t.Fatalf("with one usable replica: %d candidates (first %v); want only %s", len(ups), ups, part[0].dial)
	}
	// Once it was tried, a retry gets others (not tried), not it again.
	st.tried = append(st.tried, part[0].hostport)
	st.given = nil
	ups, _ = source{}.GetUpstreams(req)
	if len(ups) == 0 || len(ups) > aperture {
		t.Fatalf("retry: %d candidates; want 1..%d", len(ups), aperture)
	}
	for _, u := range ups {
		if u.Dial == part[0].dial {
			t.Fatalf("retry handed the replica already tried")
		}
	}
}

func schemeCount(s *scheme) int {
	if s == nil {
		return 0
	}
	return s.count
}

// TestChooseConcurrent chooses and hands out candidates from several
// goroutines while replicas are ejected (each ejection starts a
// background audit), for the race detector (go test -race).
func TestChooseConcurrent(t *testing.T) {
	l, hosts := chooseCase(t, "live", 5000)
	defer hosts.Release()
	part := l.schemes[0].parts[0]
	done := make(chan struct{})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := g
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				sc := l.choose(func(n int) int { x++; return x % n }, monoclock.Now())
				if sc == nil {
					continue
				}
				st := &subState{replicas: sc.parts[0], sample: sc.sample(0)}
				req, _ := http.NewRequestWithContext(context.WithValue(context.Background(), subStateKey{}, st), http.MethodGet, "/", nil)
				if ups, _ := (source{}).GetUpstreams(req); len(ups) == 0 || len(ups) > aperture {
					t.Errorf("%d candidates", len(ups))
					return
				}
			}
		}()
	}
	for i, r := range part[:200] {
		r.stats.Eject(monoclock.Now(), 0, func(int64) time.Duration { return time.Minute }, hoststate.ReasonConsecutiveFailures)
		if i%20 == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	// The audit catches up with the ejections within a deadline.
	deadline := time.Now().Add(5 * time.Second)
	for {
		l.current(monoclock.Now())
		if a := l.audited.Load(); a.schemes[0].capacity == len(part)-200 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("audit capacity %d; want %d", a.schemes[0].capacity, len(part)-200)
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(done)
	wg.Wait()
}
