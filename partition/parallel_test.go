package partition

import (
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	// For the nesting tests: selective in a branch, parallel in a group.
	_ "github.com/caddy-lbx/lbx/selective"
)

// slowJSON makes b answer {"<key>": "<b's name>"} after d, or give up
// when the request is cancelled first (counted in b.cancelled).
func slowJSON(b *backend, key string, d time.Duration) {
	b.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			b.cancelled.Add(1)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{key: b.name})
	})
}

// TestParallelLatencyIsTheSlowest fans out to three services of 20, 50
// and 100 ms: the answer takes about the slowest branch, not the sum, and
// merges all three.
func TestParallelLatencyIsTheSlowest(t *testing.T) {
	e := newEnv(t)
	users, recs, ads := e.backend("users"), e.backend("recs"), e.backend("ads")
	slowJSON(users, "users", 20*time.Millisecond)
	slowJSON(recs, "recs", 50*time.Millisecond)
	const slowest = 100 * time.Millisecond
	slowJSON(ads, "ads", slowest)
	e.load(fmt.Sprintf(`	parallel {
		branch users {
			reverse_proxy %s {
				header_up X-Branch {parallel.branch}/{http.parallel.index}/{parallel.count}
			}
		}
		branch recs {
			reverse_proxy %s
		}
		branch ads {
			reverse_proxy %s
		}
	}`, users.addr, recs.addr, ads.addr))

	best := time.Hour
	for i := range 3 {
		start := time.Now()
		res := e.get("/home")
		took := time.Since(start)
		if res.status != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, res.status, res.body)
		}
		var got map[string]string
		if err := json.Unmarshal([]byte(res.body), &got); err != nil {
			t.Fatalf("merged body is not JSON: %v: %s", err, res.body)
		}
		if want := map[string]string{"users": "users", "recs": "recs", "ads": "ads"}; !reflect.DeepEqual(got, want) {
			t.Errorf("merged body %s; want %v", res.body, want)
		}
		st := res.header.Get(ParallelStatusHeader)
		for _, name := range []string{"users", "recs", "ads"} {
			if !strings.Contains(st, name+"=200;") {
				t.Errorf("%s %q lacks %s=200", ParallelStatusHeader, st, name)
			}
		}
		if took < slowest {
			t.Errorf("request %d took %v, less than the slowest branch's %v", i, took, slowest)
		}
		best = min(best, took)
	}
	// Sequential branches would take 170 ms at least.
	if margin := 80 * time.Millisecond; best >= slowest+margin {
		t.Errorf("fastest of 3 requests took %v; want under the slowest branch (%v) + %v", best, slowest, margin)
	}
	t.Logf("fastest of 3: %v (slowest branch %v)", best, slowest)
	if h := users.requests()[0].header.Get("X-Branch"); h != "users/0/3" {
		t.Errorf("sub-request placeholders: X-Branch %q; want users/0/3", h)
	}
}

// TestParallelFailLimitCancelsBranches: one failed branch with
// fail_limit 1 answers 502 at once and cancels the other branches down
// to their backends.
func TestParallelFailLimitCancelsBranches(t *testing.T) {
	e := newEnv(t)
	slow1, slow2, bad := e.backend("slow1"), e.backend("slow2"), e.backend("bad")
	slowJSON(slow1, "a", time.Minute)
	slowJSON(slow2, "b", time.Minute)
	// bad fails once both slow branches' requests have reached their
	// backends, so that the cancellation has something to cancel.
	bad.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		deadline := time.Now().Add(5 * time.Second)
		for (slow1.hits.Load() == 0 || slow2.hits.Load() == 0) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		w.WriteHeader(http.StatusInternalServerError)
	})
	e.load(fmt.Sprintf(`	parallel {
		branch one {
			reverse_proxy %s
		}
		branch two {
			reverse_proxy %s
		}
		branch bad {
			reverse_proxy %s
		}
		fail_limit 1
		timeout 10s
	}`, slow1.addr, slow2.addr, bad.addr))

	start := time.Now()
	res := e.get("/")
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("answer took %v; fail_limit must answer without waiting for the slow branches", took)
	}
	if res.status != http.StatusBadGateway {
		t.Fatalf("status %d body %q; want 502", res.status, res.body)
	}
	if want := "1/3 branches failed, fail_limit=1 [bad]status 500\n"; res.body != want {
		t.Errorf("body %q; want %q", res.body, want)
	}
	st := res.header.Get(ParallelStatusHeader)
	for _, want := range []string{"one=0;", "two=0;", "bad=500;"} {
		if !strings.Contains(st, want) {
			t.Errorf("%s %q lacks %q", ParallelStatusHeader, st, want)
		}
	}
	if !strings.Contains(st, "bad=500;") || strings.Count(st, ";canceled") != 2 || !strings.Contains(st, ";failed") {
		t.Errorf("%s %q; want one and two canceled, bad failed", ParallelStatusHeader, st)
	}
	waitFor(t, 5*time.Second, "both slow backends' requests to be cancelled", func() (bool, string) {
		return slow1.cancelled.Load() == 1 && slow2.cancelled.Load() == 1,
			fmt.Sprintf("cancelled %d and %d", slow1.cancelled.Load(), slow2.cancelled.Load())
	})
}

// TestParallelSameRoutesTwice gives the same routes to two branches (and
// nests a parallel in a third): each is its own sub-request.
func TestParallelSameRoutesTwice(t *testing.T) {
	e := newEnv(t)
	b := e.backend("b")
	e.load(fmt.Sprintf(`	parallel {
		branch {
			reverse_proxy %[1]s {
				header_up X-Partition {parallel.index}/{parallel.count}
			}
		}
		branch {
			reverse_proxy %[1]s {
				header_up X-Partition {parallel.index}/{parallel.count}
			}
		}
		branch inner {
			parallel {
				branch {
					reverse_proxy %[1]s {
						header_up X-Partition 7/{parallel.count}
					}
				}
			}
		}
		merge json
	}`, b.addr))

	res := e.get("/")
	if res.status != http.StatusOK {
		t.Fatalf("status %d: %s", res.status, res.body)
	}
	var got struct {
		Items []int `json:"items"`
	}
	if err := json.Unmarshal([]byte(res.body), &got); err != nil {
		t.Fatal(err)
	}
	slices.Sort(got.Items)
	if !reflect.DeepEqual(got.Items, []int{0, 1, 7}) {
		t.Errorf("items %v; want [0 1 7] (branches 0 and 1, and the nested parallel's): %s", got.Items, res.body)
	}
	if n := b.hits.Load(); n != 3 {
		t.Errorf("backend got %d requests; want 3", n)
	}
	if st := res.header.Get(ParallelStatusHeader); !strings.HasPrefix(st, "0=200;") || !strings.Contains(st, ", 1=200;") || !strings.Contains(st, ", inner=200;") {
		t.Errorf("%s %q; want 0, 1 and inner answered", ParallelStatusHeader, st)
	}
}

// TestParallelInSelective nests a parallel in a selective group.
func TestParallelInSelective(t *testing.T) {
	e := newEnv(t)
	a, b := e.backend("a"), e.backend("b")
	slowJSON(a, "a", 0)
	slowJSON(b, "b", 0)
	e.load(fmt.Sprintf(`	selective {
		group both {
			parallel {
				branch a {
					reverse_proxy %s
				}
				branch b {
					reverse_proxy %s
				}
			}
		}
		status_header
	}`, a.addr, b.addr))
	for i := range 3 {
		res := e.get("/")
		if res.status != http.StatusOK || res.body != "{\"a\":\"a\",\"b\":\"b\"}\n" {
			t.Fatalf("request %d: status %d body %q", i, res.status, res.body)
		}
		if st := res.header.Get(ParallelStatusHeader); !strings.Contains(st, "a=200;") || !strings.Contains(st, "b=200;") {
			t.Errorf("%s %q", ParallelStatusHeader, st)
		}
	}
}

// TestSelectiveInParallelOneDeadline: a 200 ms parallel timeout ends a
// branch whose selective would wait 10 s: the selective takes the
// parallel's deadline, and its backend's request is cancelled.
func TestSelectiveInParallelOneDeadline(t *testing.T) {
	e := newEnv(t)
	slow, fast := e.backend("slow"), e.backend("fast")
	slowJSON(slow, "slow", time.Minute)
	slowJSON(fast, "fast", 0)
	e.load(fmt.Sprintf(`	parallel {
		branch dc1 {
			selective {
				group g {
					reverse_proxy %s
				}
				timeout 10s
				max_retry 0
			}
		}
		branch dc2 {
			reverse_proxy %s
		}
		timeout 200ms
		fail_limit 1
	}`, slow.addr, fast.addr))

	start := time.Now()
	res := e.get("/")
	took := time.Since(start)
	if res.status != http.StatusGatewayTimeout {
		t.Fatalf("status %d body %q; want 504", res.status, res.body)
	}
	if want := "1/2 branches failed, fail_limit=1 [dc1]timeout\n"; res.body != want {
		t.Errorf("body %q; want %q", res.body, want)
	}
	if took < 200*time.Millisecond || took > 5*time.Second {
		t.Errorf("answer after %v; want it at the parallel's 200ms deadline", took)
	}
	waitFor(t, 5*time.Second, "the selective's backend request to be cancelled", func() (bool, string) {
		return slow.cancelled.Load() == 1, fmt.Sprintf("cancelled %d, hits %d", slow.cancelled.Load(), slow.hits.Load())
	})
}

// TestParallelConfigErrors checks Provision and Validate on JSON configs.
func TestParallelConfigErrors(t *testing.T) {
	route := `{"handle":[{"handler":"static_response","body":"{}"}]}`
	one := `"branches":[{"routes":[` + route + `]}]`
	for _, tc := range []struct{ name, handler, want string }{
		{"no branches", `{"handler":"parallel"}`, "no branches; give at least one"},
		{"empty branch", `{"handler":"parallel","branches":[{"name":"a"}]}`, "branch a has no handler in its routes"},
		{"bad name", `{"handler":"parallel","branches":[{"name":"a b","routes":[` + route + `]}]}`, `branch name "a b" has ' '`},
		{"same name", `{"handler":"parallel","branches":[{"name":"a","routes":[` + route + `]},{"name":"a","routes":[` + route + `]}]}`, "branch a given twice"},
		{"default name taken", `{"handler":"parallel","branches":[{"name":"1","routes":[` + route + `]},{"routes":[` + route + `]}]}`, "branch 1 given twice"},
		{"fail_limit over branches", `{"handler":"parallel","fail_limit":2,` + one + `}`, "fail_limit 2 is above the maximum 1"},
		{"timeout", `{"handler":"parallel","timeout":"25h",` + one + `}`, "timeout 25h0m0s is above the maximum"},
		{"sizes", `{"handler":"parallel","max_response_body":2048,"max_merged_body":1024,` + one + `}`, "max_response_body 2048 is above max_merged_body 1024"},
		{"merge memory", `{"handler":"parallel","max_merge_memory":1,` + one + `}`, "max_merge_memory 1 is out of range"},
		{"unknown merger", `{"handler":"parallel","merge":{"merger":"xml"},` + one + `}`, "loading merger"},
		{"unknown field", `{"handler":"parallel","branch":[]}`, `unknown field "branch"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := `{"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[` + tc.handler + `]}]}}}}}`
			var c caddy.Config
			if err := json.Unmarshal([]byte(raw), &c); err != nil {
				t.Fatal(err)
			}
			if err := caddy.Validate(&c); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v; want one containing %q", err, tc.want)
			}
		})
	}
	raw := `{"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[{"handler":"parallel","fail_limit":1,` + one + `}]}]}}}}}`
	var c caddy.Config
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		t.Fatal(err)
	}
	if err := caddy.Validate(&c); err != nil {
		t.Errorf("a valid config: %v", err)
	}
}

// TestParallelSkip skips branches by name; when all are skipped, the
// answer is 400.
func TestParallelSkip(t *testing.T) {
	e := newEnv(t)
	a, b := e.backend("a"), e.backend("b")
	slowJSON(a, "a", 0)
	slowJSON(b, "b", 0)
	e.load(fmt.Sprintf(`	parallel {
		branch a {
			reverse_proxy %s
		}
		branch b {
			reverse_proxy %s
		}
		skip `+"`{parallel.branch} == 'b' || {query.none} == '1'`"+`
	}`, a.addr, b.addr))

	res := e.get("/")
	if res.status != http.StatusOK || res.body != "{\"a\":\"a\"}\n" {
		t.Fatalf("status %d body %q; want a's answer alone", res.status, res.body)
	}
	if st := res.header.Get(ParallelStatusHeader); !strings.HasPrefix(st, "a=200;") || !strings.HasSuffix(st, ", b=skipped") {
		t.Errorf("%s %q; want a answered, b skipped", ParallelStatusHeader, st)
	}
	if n := b.hits.Load(); n != 0 {
		t.Errorf("skipped branch's backend got %d requests", n)
	}
	res = e.get("/?none=1")
	if res.status != http.StatusBadRequest || res.body != "all 2 branches skipped\n" {
		t.Errorf("all skipped: status %d body %q; want 400", res.status, res.body)
	}
}

// TestParallelClientDisconnectCancelsBranches: when the client goes away,
// every branch is cancelled, down to the backend connection, a selective
// nested in a branch included.
func TestParallelClientDisconnectCancelsBranches(t *testing.T) {
	e := newEnv(t)
	s0, s1 := e.backend("s0"), e.backend("s1")
	slowJSON(s0, "a", time.Minute)
	slowJSON(s1, "b", time.Minute)
	e.load(fmt.Sprintf(`	parallel {
		branch a {
			reverse_proxy %s
		}
		branch b {
			selective {
				group g {
					reverse_proxy %s
				}
			}
		}
	}`, s0.addr, s1.addr))
	e.leaveMidway(t, s0, s1)
}

// TestParallelInSelectiveTakesItsDeadline: a parallel in a selective
// group takes the selective's 200 ms deadline instead of its own 10 s.
func TestParallelInSelectiveTakesItsDeadline(t *testing.T) {
	e := newEnv(t)
	slow := e.backend("slow")
	slowJSON(slow, "slow", time.Minute)
	e.load(fmt.Sprintf(`	selective {
		group g {
			parallel {
				branch s {
					reverse_proxy %s
				}
				timeout 10s
			}
		}
		timeout 200ms
		max_retry 0
	}`, slow.addr))

	start := time.Now()
	res := e.get("/")
	took := time.Since(start)
	if res.status != http.StatusGatewayTimeout {
		t.Fatalf("status %d body %q; want 504", res.status, res.body)
	}
	if took < 200*time.Millisecond || took > 5*time.Second {
		t.Errorf("answer after %v; want it at the selective's 200ms deadline", took)
	}
	waitFor(t, 5*time.Second, "the branch's backend request to be cancelled", func() (bool, string) {
		return slow.cancelled.Load() == 1, fmt.Sprintf("cancelled %d, hits %d", slow.cancelled.Load(), slow.hits.Load())
	})
}

// TestParallelPartialAnswer: a branch that fails within fail_limit is
// named in X-Parallel-Missing, and its index in merge json's
// missing_field.
func TestParallelPartialAnswer(t *testing.T) {
	e := newEnv(t)
	a, bad := e.backend("a"), e.backend("bad")
	slowJSON(a, "a", 0)
	bad.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusBadGateway) })
	e.load(fmt.Sprintf(`	parallel {
		branch a {
			reverse_proxy %s
		}
		branch recs {
			reverse_proxy %s
		}
		merge json {
			missing_field missing
		}
	}`, a.addr, bad.addr))

	res := e.get("/")
	if res.status != http.StatusOK || res.body != "{\"a\":\"a\",\"missing\":[1]}\n" {
		t.Fatalf("status %d body %q; want a's answer with missing [1]", res.status, res.body)
	}
	if m := res.header.Get(ParallelMissingHeader); m != "recs" {
		t.Errorf("%s %q; want recs", ParallelMissingHeader, m)
	}
	if m := res.header.Get(MissingHeader); m != "" {
		t.Errorf("%s %q on a parallel answer", MissingHeader, m)
	}
}

// TestParallelBranchDefaultPolicy: a branch's reverse_proxy that names no
// policy runs least_time, as a selective group's does: with one fast and
// one slow replica the slow one gets few requests (Caddy's default,
// random, gives it about half).
func TestParallelBranchDefaultPolicy(t *testing.T) {
	e := newEnv(t)
	fast, slow := e.backend("fast"), e.backend("slow")
	slowJSON(fast, "who", 0)
	slowJSON(slow, "who", 30*time.Millisecond)
	e.load(fmt.Sprintf("\tparallel {\n\t\tbranch {\n\t\t\treverse_proxy %s %s\n\t\t}\n\t}", fast.addr, slow.addr))
	const n = 100
	for range n {
		if res := e.get("/"); res.status != http.StatusOK {
			t.Fatalf("status %d: %s", res.status, res.body)
		}
	}
	if got := slow.hits.Load(); got > n/4 || fast.hits.Load()+got != n {
		t.Fatalf("slow replica %d of %d requests, fast %d; want the slow one to get at most a quarter, as least_time gives it", got, n, fast.hits.Load())
	}
	t.Logf("slow replica: %d of %d requests", slow.hits.Load(), n)
}
