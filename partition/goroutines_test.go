package partition

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// The harness's checkNoLeak looks for goroutines running this package's
// code only. A bad request could also leave behind a goroutine of
// reverse_proxy, net/http or a transport (a sub-request never cancelled,
// a response body never closed) that runs none of our code; those show
// up only in the process's goroutine count. goroutineBaseline and
// checkGoroutines bracket a stretch of a test that repeats a bad request
// many times, so that even a leak of one goroutine per request stands out
// from the noise of connections opening and closing.

// goroutineSlack is how far above its baseline the count may settle:
// keep-alive connections of the client, of Caddy and of the backends come
// and go with a few goroutines each.
const goroutineSlack = 6

// badRepeats is how often the bad-input tests repeat a bad request
// between the two counts: a leak of one goroutine per request is then
// well above goroutineSlack.
const badRepeats = 25

// goroutineBaseline closes the client's idle connections and returns the
// process's goroutine count once it has stopped falling (within a
// deadline), to compare with checkGoroutines later. Call it after the
// config is loaded and a first request has opened the connections the
// rest will reuse.
func (e *env) goroutineBaseline() int {
	e.t.Helper()
	e.client.CloseIdleConnections()
	return settledGoroutines()
}

// settledGoroutines returns the goroutine count once it has stopped
// falling, or after two seconds.
func settledGoroutines() int {
	n := runtime.NumGoroutine()
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		m := runtime.NumGoroutine()
		if m >= n {
			return min(m, n)
		}
		n = m
	}
	return n
}

// checkGoroutines closes the client's idle connections and waits, with a
// deadline, for the goroutine count to come back to within
// goroutineSlack of base; on failure it reports the count and where the
// goroutines are.
func (e *env) checkGoroutines(base int, what string) {
	e.t.Helper()
	e.client.CloseIdleConnections()
	if n, ok := goroutinesSettle(base, 5*time.Second); !ok {
		e.t.Errorf("after %s: %d goroutines, baseline %d (+%d allowed); by top frame:\n%s",
			what, n, base, goroutineSlack, goroutineSummary())
	} else {
		e.t.Logf("after %s: %d goroutines, baseline %d", what, n, base)
	}
}

// goroutinesSettle polls the goroutine count until it is within
// goroutineSlack of base or timeout has passed, and returns the last
// count and whether it came back.
func goroutinesSettle(base int, timeout time.Duration) (int, bool) {
	deadline := time.Now().Add(timeout)
	for {
		n := runtime.NumGoroutine()
		if n <= base+goroutineSlack {
			return n, true
		}
		if time.Now().After(deadline) {
			return n, false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// goroutineSummary counts the goroutines by the function at the top of
// their stack (below runtime internals), most first.
func goroutineSummary() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	counts := map[string]int{}
	for _, g := range strings.Split(string(buf), "\n\n") {
		lines := strings.Split(g, "\n")
		top := "?"
		for i := 1; i+1 < len(lines); i += 2 {
			fn := lines[i]
			if !strings.HasPrefix(fn, "runtime.") && !strings.HasPrefix(fn, "internal/") {
				top = fn
				break
			}
		}
		if j := strings.LastIndexByte(top, '('); j > 0 {
			top = top[:j]
		}
		counts[top]++
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int { return counts[b] - counts[a] })
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%5d %s\n", counts[k], k)
	}
	return b.String()
}

// TestGoroutineCheckCatchesLeaks makes sure the check can fail:
// goroutines left blocked, one per "request", are reported.
func TestGoroutineCheckCatchesLeaks(t *testing.T) {
	base := settledGoroutines()
	stop := make(chan struct{})
	for range badRepeats {
		go func() { <-stop }()
	}
	n, ok := goroutinesSettle(base, 200*time.Millisecond)
	summary := goroutineSummary()
	close(stop)
	if ok {
		t.Errorf("%d blocked goroutines were not noticed: %d, baseline %d", badRepeats, n, base)
	}
	if want := fmt.Sprintf("%5d github.com/caddy-lbx/lbx/partition.TestGoroutineCheckCatchesLeaks.func1", badRepeats); !strings.Contains(summary, want) {
		t.Errorf("the summary does not name the blocked goroutines (%q):\n%s", want, summary)
	}
	if n, ok := goroutinesSettle(base, 5*time.Second); !ok {
		t.Errorf("released goroutines still counted: %d, baseline %d", n, base)
	}
}
