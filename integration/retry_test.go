package integration

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// blackHoleRun is what one black-hole load run saw.
type blackHoleRun struct {
	requests   int     // client requests sent
	holeHits   int64   // attempts that reached the black hole, retries included
	clientErrs int     // client requests that did not end in 200
	share      float64 // holeHits / requests
	errShare   float64 // clientErrs / requests
}

// runBlackHole starts 4 fresh backends (fresh addresses: lbx keeps its
// state per address across reloads, so an earlier run's verdict on a hole
// must not carry over), of which the last answers every request with an
// instant 503 while its /health passes; the others take 1ms. It loads
// reverse_proxy over them with active health checks and the given extra
// lines, then sends n requests at a fixed rate of one per interval, at
// most conc in flight.
func runBlackHole(t *testing.T, extra string, n, conc int, interval time.Duration) blackHoleRun {
	t.Helper()
	e := newEnv(t)
	bs := e.startBackends(4)
	for _, b := range bs[:3] {
		b.delay.Store(int64(time.Millisecond))
	}
	hole := bs[3]
	hole.status.Store(http.StatusServiceUnavailable)
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma
	health_uri /health
	health_interval 200ms
	%s
}`, dials(bs...), extra))
	start := time.Now()
	res := e.drivePaced("/", n, conc, interval)
	run := blackHoleRun{requests: res.total, holeHits: hole.hits.Load(), clientErrs: res.total - sum(res.counts)}
	run.share = float64(run.holeHits) / float64(run.requests)
	run.errShare = float64(run.clientErrs) / float64(run.requests)
	t.Logf("%d requests in %v (%v in flight at most): the black hole got %d attempts (%.2f%% of requests), %d client requests failed (%.2f%%); answers %v, statuses %v",
		run.requests, time.Since(start).Round(time.Millisecond), conc, run.holeHits, 100*run.share, run.clientErrs, 100*run.errShare, res.counts, res.statuses)
	if h := bs[0].healthHits.Load() + hole.healthHits.Load(); h == 0 {
		t.Errorf("no active health check reached the backends: the hole must be one whose health check passes")
	}
	return run
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestBlackHoleOneLiner is the trap of issue 11 with the config a user
// writes first: `lb_policy ewma` alone, one backend answering 503 at once
// while its health check passes. An instant 503 must not look like the
// fastest answer in the pool: failure statuses count as failed attempts
// without an outlier block, so the hole is priced out. With lb_retries and
// a retry match on 5xx, the retry of a request the hole failed avoids it
// (it was already tried), so no client sees the error.
func TestBlackHoleOneLiner(t *testing.T) {
	const (
		n        = 2000
		conc     = 16
		interval = 2500 * time.Microsecond // 400 requests a second
	)
	t.Run("no retries", func(t *testing.T) {
		run := runBlackHole(t, "", n, conc, interval)
		if run.share >= 0.02 {
			t.Errorf("the black hole got %.2f%% of the requests; want under 2%%", 100*run.share)
		}
		if run.errShare > 0.02 {
			t.Errorf("%.2f%% of client requests failed; want at most 2%%", 100*run.errShare)
		}
	})
	t.Run("lb_retries 2", func(t *testing.T) {
		run := runBlackHole(t, "lb_retries 2\n\t"+retryOnFailureStatus, n, conc, interval)
		if run.clientErrs != 0 {
			t.Errorf("%d client requests failed; with retries on 5xx want none", run.clientErrs)
		}
		if run.share >= 0.02 {
			t.Errorf("the black hole got %.2f%% of the requests; want under 2%%", 100*run.share)
		}
	})
}

// TestRetryExclusionPanicLeastConn: a retry avoids the upstream the
// request already tried, whatever policy panic wraps. Of two backends one
// always answers 503 at once. least_conn sees it with the fewest requests
// in flight and hands it the first attempt often, and without exclusion
// the retry too; `first` with the failing backend first would send every
// attempt of every request to it. With one retry on 503 and the tried
// upstream excluded, every client request succeeds on the other one.
func TestRetryExclusionPanicLeastConn(t *testing.T) {
	for _, policy := range []string{"least_conn", "first"} {
		t.Run(policy, func(t *testing.T) {
			e := newEnv(t)
			bad, good := e.backend("bad", plainHTTP), e.backend("good", plainHTTP)
			bad.status.Store(http.StatusServiceUnavailable)
			good.delay.Store(int64(time.Millisecond))
			e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy panic {
		policy %s
	}
	lb_retries 1
	lb_retry_match {
		expression `+"`{rp.status_code} == 503`"+`
	}
}`, dials(bad, good), policy))
			const n = 600
			res := e.drive("/", n, 8)
			t.Logf("panic(%s), lb_retries 1: %d requests, %d failed; the failing backend got %d attempts, the good one %d; statuses %v",
				policy, res.total, len(res.errors), bad.hits.Load(), good.hits.Load(), res.statuses)
			if len(res.errors) != 0 {
				t.Errorf("%d of %d client requests failed; with the tried upstream excluded from the retry want none; first: %s", len(res.errors), n, res.errors[0])
			}
			if res.counts["good"] != n {
				t.Errorf("the good backend answered %d of %d requests", res.counts["good"], n)
			}
			if bad.hits.Load() == 0 {
				t.Errorf("the failing backend got no attempt: the test did not exercise a retry")
			}
			if policy == "first" && bad.hits.Load() != n {
				t.Errorf("first: the failing backend, listed first, got %d of %d first attempts", bad.hits.Load(), n)
			}
		})
	}
}
