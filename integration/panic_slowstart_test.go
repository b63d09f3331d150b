package integration

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestPanicSlowStartHealthyAgain: behind the panic wrapper, round_robin
// gives a backend that Caddy's active health checks marked unhealthy, and
// then healthy again, a share that rises over the slow-start window,
// measured per second: well below full in the first second, full after
// the window.
//
// Under round_robin and under least_conn with requests held long enough
// that several are in flight: a returning upstream holds fewer, so
// least_conn offers it at nearly every choice, which a draw alone would
// not hold to the ramp.
func TestPanicSlowStartHealthyAgain(t *testing.T) {
	for _, tc := range []struct {
		policy string
		delay  time.Duration
	}{
		{"round_robin", 2 * time.Millisecond},
		{"least_conn", 25 * time.Millisecond},
	} {
		t.Run(tc.policy, func(t *testing.T) { panicSlowStartHealthyAgain(t, tc.policy, tc.delay) })
	}
}

func panicSlowStartHealthyAgain(t *testing.T, policy string, delay time.Duration) {
	e := newEnv(t)
	bs := e.startBackends(4)
	back := bs[3]
	for _, b := range bs {
		b.delay.Store(int64(delay))
	}
	const window = 5 * time.Second
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy panic {
		slow_start %v
		policy %s
	}
	health_uri /health
	health_interval 50ms
	health_fails 1
	health_passes 1
}`, dials(bs...), window, policy))
	waitFor(t, 10*time.Second, "every backend to serve", func() (bool, string) {
		e.drive("/", 20, 2)
		hits := []int64{bs[0].hits.Load(), bs[1].hits.Load(), bs[2].hits.Load(), bs[3].hits.Load()}
		return hits[0] > 0 && hits[1] > 0 && hits[2] > 0 && hits[3] > 0, fmt.Sprint("requests served: ", hits)
	})
	if p, _ := report(t).pool(bs...); p.Upstreams[3].SlowStart != nil {
		t.Fatalf("a backend of a new pool ramps: %+v", p.Upstreams[3])
	}

	back.healthCode.Store(http.StatusServiceUnavailable)
	// waitPool sends a request each time: the policy's count sees it down
	e.waitPool("/", "the backend unhealthy", func(p poolInfo) bool { return !p.Upstreams[3].Healthy }, bs...)
	e.drive("/", 20, 2)
	back.healthCode.Store(http.StatusOK)
	p := e.waitPool("/", "the backend healthy again and ramping", func(p poolInfo) bool {
		return p.Upstreams[3].Healthy && p.Upstreams[3].SlowStart != nil
	}, bs...)
	start := time.Now()
	if w := *p.Upstreams[3].SlowStart; w > 20 {
		t.Fatalf("weight just after the return: %.1f%%, want near the 10%% floor", w)
	}

	// Paced traffic from the return to two seconds past the window,
	// counted per second by when each request was sent.
	const (
		seconds  = int(window/time.Second) + 2
		interval = 4 * time.Millisecond // 250 req/s
	)
	var (
		mu          sync.Mutex
		total, onIt [seconds]int
		failed      atomic.Int64
		next        atomic.Int64
		wg          sync.WaitGroup
	)
	n := int64(time.Duration(seconds) * time.Second / interval)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= n {
					return
				}
				at := start.Add(time.Duration(i) * interval)
				time.Sleep(time.Until(at))
				status, name, body, err := e.get("/")
				if err != nil || status != http.StatusOK {
					if failed.Add(1) == 1 {
						t.Logf("first failure: status %d, %q, %v", status, body, err)
					}
					continue
				}
				sec := int(time.Duration(i) * interval / time.Second)
				mu.Lock()
				total[sec]++
				if name == back.name {
					onIt[sec]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d requests failed during the ramp", failed.Load())
	}
	// relative to a full share, a quarter
	rel := make([]float64, seconds)
	for s := range seconds {
		rel[s] = float64(onIt[s]) / float64(max(total[s], 1)) * 4
	}
	t.Logf("%s: returning backend's share per second, relative to a full share, over a %v ramp: %.2f", policy, window, rel)
	// An upstream ramping at factor f (of 4) gets at most the share of
	// weight f: 4f/(3+f) of full. Over the first second of a 5 s ramp, f
	// is at most 0.2: at most 0.24 of full; 0.45 leaves room for the
	// noise of ~60 requests a second.
	if rel[0] > 0.45 {
		t.Errorf("first second: %.2f of a full share, want well below full", rel[0])
	}
	if mid := (rel[2] + rel[3]) / 2; mid < rel[0]+0.15 {
		t.Errorf("share did not rise: %.2f in the first second, %.2f in the third and fourth", rel[0], mid)
	}
	if end := rel[window/time.Second-1]; end < rel[1]+0.15 {
		t.Errorf("share did not rise: %.2f in the second second, %.2f in the last of the window", rel[1], end)
	}
	for s := int(window / time.Second); s < seconds; s++ {
		if rel[s] < 0.75 {
			t.Errorf("second %d, after the window: %.2f of a full share, want full", s+1, rel[s])
		}
	}
	if p, _ := report(t).pool(bs...); p.Upstreams[3].SlowStart != nil {
		t.Errorf("the ramp is over, yet the admin API shows a slow-start weight of %.1f%%", *p.Upstreams[3].SlowStart)
	}
}

// TestPanicSlowStartThresholdOff: with panic mode off, the panic policy
// still counts its pool (the count is what notices a return from
// Caddy-unhealthy), so a backend healthy again ramps; one added by a
// reload to a pool that served ramps as new.
func TestPanicSlowStartThresholdOff(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(3)
	site := func(bs []*backend) string {
		return fmt.Sprintf(`reverse_proxy %s {
	lb_policy panic {
		threshold off
		slow_start 1m
		policy least_conn
	}
	health_uri /health
	health_interval 50ms
	health_fails 1
	health_passes 1
}`, dials(bs...))
	}
	e.load(site(bs[:2]))
	waitFor(t, 10*time.Second, "both backends to serve", func() (bool, string) {
		e.drive("/", 20, 2)
		hits := []int64{bs[0].hits.Load(), bs[1].hits.Load()}
		return hits[0] > 0 && hits[1] > 0, fmt.Sprint("requests served: ", hits)
	})
	e.load(site(bs))
	p := e.waitPool("/", "the added backend ramping", func(p poolInfo) bool { return p.Upstreams[2].SlowStart != nil }, bs...)
	if p.Upstreams[0].SlowStart != nil || p.Upstreams[1].SlowStart != nil {
		t.Fatalf("a backend that served before the reload ramps: %+v", p.Upstreams)
	}

	bs[1].healthCode.Store(http.StatusServiceUnavailable)
	e.waitPool("/", "b1 unhealthy", func(p poolInfo) bool { return !p.Upstreams[1].Healthy }, bs...)
	// Reading the admin API counts the pool too: from here on only
	// requests do, until the share is measured.
	bs[1].healthCode.Store(http.StatusOK)
	before := bs[1].hits.Load()
	waitFor(t, 10*time.Second, "b1 to serve again", func() (bool, string) {
		e.drive("/", 10, 1)
		return bs[1].hits.Load() > before, "no request reached b1"
	})
	// least_conn among idle backends draws at random: b1 at its 10%
	// floor gets about a thirtieth, b2 (added a moment ago) about as
	// little, b0 the rest; unramped, b1 would get a third or more
	const n = 300
	r := e.drive("/", n, 1)
	if share := r.share(bs[1].name); share > 0.15 {
		t.Fatalf("b1 healthy again: share %.3f of %d requests, want near its floor (a third of 10%%): %v", share, n, r.counts)
	}
	p = e.waitPool("/", "b1 ramping", func(p poolInfo) bool { return p.Upstreams[1].Healthy && p.Upstreams[1].SlowStart != nil }, bs...)
	if p.Upstreams[0].SlowStart != nil || p.Upstreams[2].SlowStart == nil {
		t.Fatalf("b0 ramps, or the added b2 no longer does: %+v", p.Upstreams)
	}
}
