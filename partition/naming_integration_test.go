package partition

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// load is a closed-loop client load: workers send GET / until stopped (or
// a cap is reached) and record every request that did not get a 200.
type clientLoad struct {
	ok     atomic.Int64
	mu     sync.Mutex
	errors []string
	stop   chan struct{}
	wg     sync.WaitGroup
}

func (e *env) startLoad(workers int) *clientLoad {
	l := &clientLoad{stop: make(chan struct{})}
	const maxPerWorker = 200000 // a bound, in case stop is never called
	for range workers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for range maxPerWorker {
				select {
				case <-l.stop:
					return
				default:
				}
				req, _ := http.NewRequest(http.MethodGet, e.url("/"), nil)
				res, err := e.do(req)
				switch {
				case err != nil:
					l.fail(err.Error())
				case res.status != http.StatusOK:
					l.fail(fmt.Sprintf("status %d: %q", res.status, res.body))
				default:
					l.ok.Add(1)
				}
			}
		}()
	}
	e.t.Cleanup(l.halt)
	return l
}

func (l *clientLoad) fail(s string) {
	l.mu.Lock()
	l.errors = append(l.errors, s)
	l.mu.Unlock()
}

// halt stops the workers and waits for them; it may be called twice.
func (l *clientLoad) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

func (l *clientLoad) failures() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errors...)
}

// waitRequests waits until the load has completed n more requests.
func (l *clientLoad) waitRequests(t *testing.T, n int64) {
	t.Helper()
	target := l.ok.Load() + n
	waitFor(t, 30*time.Second, fmt.Sprintf("%d requests", n), func() (bool, string) {
		if f := l.failures(); len(f) > 0 {
			t.Fatalf("requests failed: %d, first: %s", len(f), f[0])
		}
		return l.ok.Load() >= target, fmt.Sprintf("%d of %d", l.ok.Load(), target)
	})
}

// hits snapshots the backends' request counters.
func hits(bs ...*backend) []int64 {
	out := make([]int64, len(bs))
	for i, b := range bs {
		out[i] = b.hits.Load()
	}
	return out
}

func delta(before, after []int64) []int64 {
	out := make([]int64, len(before))
	for i := range before {
		out[i] = after[i] - before[i]
	}
	return out
}

func TestNamingFileMustBeReadableAtLoad(t *testing.T) {
	e := newEnv(t)
	err := e.loadErr("\tpartition {\n\t\tnaming_file " + filepath.Join(t.TempDir(), "missing") + "\n\t}")
	if err == nil || !strings.Contains(err.Error(), "file does not exist") {
		t.Errorf("load error %v; want one saying the naming file does not exist", err)
	}
	// Tags of static upstreams are checked at provision time too (JSON).
	for tag, want := range map[string]string{
		"1/1": "upstreams[0] (127.0.0.1:1): invalid partition tag",
		"x":   "want N/M",
	} {
		cfg := fmt.Sprintf(`{"admin":{"listen":"localhost:%d"},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:%d"],
			"routes":[{"handle":[{"handler":"partition","upstreams":[{"dial":"127.0.0.1:1","tag":%q}]}]}]}}}}}`, adminPort, httpPort, tag)
		if err := postJSON(cfg); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("tag %q: load error %v; want one containing %q", tag, err, want)
		}
	}
}

// TestNamingFileEditedUnderLoad swaps the upstream list while requests
// run: no request may fail, and traffic moves to the new list.
func TestNamingFileEditedUnderLoad(t *testing.T) {
	e := newEnv(t)
	a0, a1, b0, b1, b2 := e.backend("a0"), e.backend("a1"), e.backend("b0"), e.backend("b1"), e.backend("b2")
	list := filepath.Join(t.TempDir(), "server_list")
	writeFile(t, list, fmt.Sprintf("%s 0/2\n%s 1/2\n", a0.addr, a1.addr))
	// The move below replaces the whole list at once.
	e.load(partitionSite(nil, "naming_file "+list, "poll_interval 100ms", "naming_max_removed_percent 100"))

	l := e.startLoad(4)
	l.waitRequests(t, 50)

	// Move to a 3-partition scheme on other backends.
	writeFile(t, list, fmt.Sprintf("# moved\n%s 0/3\n%s 1/3\nnot-a-line\n%s 2/3\n", b0.addr, b1.addr, b2.addr))
	waitFor(t, 10*time.Second, "traffic on the new list", func() (bool, string) {
		return b2.hits.Load() > 0, fmt.Sprintf("b2 hits %d", b2.hits.Load())
	})
	l.waitRequests(t, 20) // requests already past the swap finish
	before := hits(a0, a1)
	l.waitRequests(t, 100)
	if d := delta(before, hits(a0, a1)); d[0]+d[1] != 0 {
		t.Errorf("old backends still get traffic after the swap: %v", d)
	}

	// Deleted: the last good list stays in effect.
	if err := os.Remove(list); err != nil {
		t.Fatal(err)
	}
	before = hits(b0, b1, b2)
	l.waitRequests(t, 100)
	if d := delta(before, hits(b0, b1, b2)); d[0] == 0 || d[1] == 0 || d[2] == 0 {
		t.Errorf("after deletion the list must stay: %v", d)
	}
	l.halt()
	if f := l.failures(); len(f) > 0 {
		t.Errorf("%d requests failed during the swaps; first: %s", len(f), f[0])
	}
	t.Logf("%d requests, none failed", l.ok.Load())
}

// TestSeedWalkThrough reproduces the walk-through of brpc's
// DynamicPartitionChannel (see the seed): a 3-partition scheme on one
// server and a 4-partition scheme on a second share traffic by capacity;
// adding the 4-partition scheme on a third server doubles that scheme's
// capacity; removing partition 2/3 takes the first server out.
func TestSeedWalkThrough(t *testing.T) {
	seedWalkThrough(t, func(partition string) string { return partition }, "")
}

// TestSeedWalkThroughInAParallelBranch: the walk-through holds with the
// dynamic partition as one branch of a parallel, beside a branch that
// answers by itself ("a combination of channels is itself a channel").
// Every request goes through both branches, so the partition sees the
// same traffic as alone.
func TestSeedWalkThroughInAParallelBranch(t *testing.T) {
	seedWalkThrough(t, func(partition string) string {
		return "\tparallel {\n\t\tbranch walk {\n" + partition + "\n\t\t}\n" +
			"\t\tbranch other {\n\t\t\theader Content-Type application/json\n\t\t\trespond `{\"other\":true}` 200\n\t\t}\n" +
			"\t\tfail_limit 1\n\t}"
	}, `"other":true`)
}

// seedWalkThrough runs the walk-through with the partition handler's
// directive placed in a site by wrap; every answer's body contains want.
func seedWalkThrough(t *testing.T, wrap func(partition string) string, want string) {
	e := newEnv(t)
	s4, s5, s6 := e.backend("8004"), e.backend("8005"), e.backend("8006")
	list := filepath.Join(t.TempDir(), "server_list")
	scheme := func(b *backend, m int, comment ...int) string {
		var sb strings.Builder
		for i := range m {
			c := ""
			for _, x := range comment {
				if x == i {
					c = "#"
				}
			}
			fmt.Fprintf(&sb, "%s%s  %d/%d\n", c, b.addr, i, m)
		}
		return sb.String()
	}
	writeFile(t, list, scheme(s4, 3))
	e.load(wrap(partitionSite(nil, "naming_file "+list, "poll_interval 100ms", "lb_policy round_robin", "fail_limit 1")))
	if res := e.get("/"); res.status != http.StatusOK || !strings.Contains(res.body, want) {
		t.Fatalf("status %d, body %q; want 200 and a body containing %q", res.status, res.body, want)
	}
	l := e.startLoad(4)
	l.waitRequests(t, 50)

	// measure returns each backend's hits over n requests, after the
	// traffic settled on the current list.
	measure := func(n int64) []int64 {
		l.waitRequests(t, 20)
		before := hits(s4, s5, s6)
		l.waitRequests(t, n)
		return delta(before, hits(s4, s5, s6))
	}
	// 1. 3/3 on 8004 and 4/4 on 8005: capacity 1 each, requests per
	// scheme 1:1, so backend traffic 3:4.
	writeFile(t, list, scheme(s4, 3)+"\n"+scheme(s5, 4))
	waitFor(t, 10*time.Second, "the 4-partition scheme to take traffic", func() (bool, string) {
		return s5.hits.Load() > 0, ""
	})
	const n = 1200
	d := measure(n)
	share3 := float64(d[0]) / 3 / (float64(d[0])/3 + float64(d[1])/4) // requests on the 3-scheme
	t.Logf("phase 1: hits %v, share of requests on the 3-partition scheme %.3f (want 0.5)", d, share3)
	// Binomial over ≈1200 requests: sd ≈ 0.015; allow ±0.08.
	if math.Abs(share3-0.5) > 0.08 || d[2] != 0 {
		t.Errorf("phase 1: hits %v; want 8004:8005 ≈ 3:4 (share %.3f)", d, share3)
	}

	// 2. Add the 4-partition scheme on 8006: its capacity becomes 2, so
	// requests split 1:2 and backend traffic is 3:4:4.
	writeFile(t, list, scheme(s4, 3)+"\n"+scheme(s5, 4)+"\n"+scheme(s6, 4))
	waitFor(t, 10*time.Second, "8006 to take traffic", func() (bool, string) { return s6.hits.Load() > 0, "" })
	d = measure(n)
	share3 = float64(d[0]) / 3 / (float64(d[0])/3 + float64(d[1]+d[2])/4)
	split := float64(d[1]) / float64(d[1]+d[2])
	t.Logf("phase 2: hits %v, share on the 3-partition scheme %.3f (want 0.333), 8005/(8005+8006) %.3f", d, share3, split)
	if math.Abs(share3-1.0/3) > 0.08 || math.Abs(split-0.5) > 0.1 {
		t.Errorf("phase 2: hits %v; want ≈ 3:4:4", d)
	}

	// 3. Comment out 2/3: the 3-partition scheme is incomplete, capacity
	// 0, and 8004 gets nothing; no request fails.
	writeFile(t, list, scheme(s4, 3, 2)+"\n"+scheme(s5, 4)+"\n"+scheme(s6, 4))
	waitFor(t, 10*time.Second, "8004 to stop getting traffic", func() (bool, string) {
		before := s4.hits.Load()
		l.waitRequests(t, 30)
		return s4.hits.Load() == before, fmt.Sprintf("8004 got %d more", s4.hits.Load()-before)
	})
	d = measure(400)
	t.Logf("phase 3: hits %v", d)
	if d[0] != 0 || d[1] == 0 || d[2] == 0 {
		t.Errorf("phase 3: hits %v; want none on 8004", d)
	}
	l.halt()
	if f := l.failures(); len(f) > 0 {
		t.Errorf("%d requests failed; first: %s", len(f), f[0])
	}
	t.Logf("%d requests, none failed", l.ok.Load())
}

// TestNamingFileBadVersionsUnderLoad writes each kind of bad naming file
// version in place while requests run through Caddy: none is applied, each
// refusal is counted (and exposed on the admin /metrics), and no request
// fails. A version with a line over 64 KiB is applied without that line.
// An explicitly empty version is applied.
func TestNamingFileBadVersionsUnderLoad(t *testing.T) {
	e := newEnv(t)
	a0, a1, a2, a3, a4 := e.backend("a0"), e.backend("a1"), e.backend("a2"), e.backend("a3"), e.backend("a4")
	list := filepath.Join(t.TempDir(), "server_list")
	good := fmt.Sprintf("%s 0/2\n%s 0/2\n%s 1/2\n%s 1/2\n", a0.addr, a1.addr, a2.addr, a3.addr)
	writeFile(t, list, good)
	// round_robin: every replica of the list serves, so a lost one shows.
	e.load(partitionSite(nil, "naming_file "+list, "poll_interval 100ms", "lb_policy round_robin"))

	l := e.startLoad(4)
	l.waitRequests(t, 50)
	for _, bad := range []struct {
		name, reason string
		data         []byte
	}{
		{"truncated to 0 bytes", rejectNoValidLine, nil},
		{"64 KiB of random bytes", rejectIncomplete, randomBytes(64 << 10)},
		{"text with no valid line", rejectNoValidLine, []byte(strings.Repeat("garbage\n", 1000))},
		{"a writer paused after the first line", rejectRemovesTooMany, []byte(good[:strings.IndexByte(good, '\n')+1])},
		{"truncated mid-line", rejectIncomplete, []byte(good[:len(good)-4])},
		{"removes 3 of 4", rejectRemovesTooMany, []byte(good[strings.LastIndexByte(good[:len(good)-1], '\n')+1:])},
	} {
		before := rejected(bad.reason)
		writeInPlace(t, list, bad.data)
		waitFor(t, 10*time.Second, bad.name+" refused", func() (bool, string) {
			return rejected(bad.reason) > before, ""
		})
		l.waitRequests(t, 50)
	}
	before := hits(a0, a1, a2, a3)
	l.waitRequests(t, 200)
	if d := delta(before, hits(a0, a1, a2, a3)); d[0] == 0 || d[1] == 0 || d[2] == 0 || d[3] == 0 {
		t.Errorf("after the bad versions every backend of the good list must serve: %v", d)
	}

	// A line over 64 KiB: an error for that line only; a4, after it, is
	// taken.
	writeInPlace(t, list, []byte(strings.Repeat("x", 70000)+"\n"+good+a4.addr+" 0/2\n"))
	waitFor(t, 10*time.Second, "the line after the long one to take traffic", func() (bool, string) {
		return a4.hits.Load() > 0, ""
	})
	l.halt()
	if f := l.failures(); len(f) > 0 {
		t.Errorf("%d requests failed while bad versions were written; first: %s", len(f), f[0])
	}
	t.Logf("%d requests, none failed", l.ok.Load())

	res, err := adminClient.Get(fmt.Sprintf("http://localhost:%d/metrics", adminPort))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	for _, reason := range []string{rejectNoValidLine, rejectIncomplete, rejectRemovesTooMany} {
		if want := `caddy_lbx_partition_naming_rejected_total{reason="` + reason + `"}`; !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// Explicitly empty: applied, so requests get 503.
	writeInPlace(t, list, []byte("# lbx:empty\n"))
	waitFor(t, 10*time.Second, "the empty list", func() (bool, string) {
		r := e.get("/")
		return r.status == http.StatusServiceUnavailable, fmt.Sprintf("status %d", r.status)
	})
}
