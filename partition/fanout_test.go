package partition

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"
)

// partitionSite is a site that fans every request out over the given
// `to` lines, with extra options, and tells backends which partition each
// sub-request is for.
func partitionSite(to []string, extra ...string) string {
	var b strings.Builder
	b.WriteString("\tpartition {\n")
	for _, l := range to {
		b.WriteString("\t\tto " + l + "\n")
	}
	b.WriteString("\t\theader_up X-Partition {partition.index}/{partition.count}\n")
	for _, l := range extra {
		b.WriteString("\t\t" + l + "\n")
	}
	b.WriteString("\t}")
	return b.String()
}

func TestFanOutMergesJSON(t *testing.T) {
	e := newEnv(t)
	b0, b1, b2 := e.backend("b0"), e.backend("b1"), e.backend("b2")
	e.load(partitionSite([]string{b0.addr + " 0/3", b1.addr + " 1/3", b2.addr + " 2/3"}))

	res := e.get("/search?q=x")
	if res.status != http.StatusOK {
		t.Fatalf("status %d: %s", res.status, res.body)
	}
	var got any
	if err := json.Unmarshal([]byte(res.body), &got); err != nil {
		t.Fatalf("merged body is not JSON: %v: %s", err, res.body)
	}
	want := map[string]any{
		"items": []any{0.0, 1.0, 2.0},
		"by":    map[string]any{"p0": "b0", "p1": "b1", "p2": "b2"},
		"count": 3.0,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("merged body %s; want %v", res.body, want)
	}
	if ct := res.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	st := res.header.Get(StatusHeader)
	for i := range 3 {
		if !strings.Contains(st, fmt.Sprintf("p%d=200;", i)) {
			t.Errorf("%s: %q lacks p%d=200", StatusHeader, st, i)
		}
	}
	for _, b := range []*backend{b0, b1, b2} {
		if n := b.hits.Load(); n != 1 {
			t.Errorf("%s got %d requests, want 1", b.name, n)
		}
		r := b.requests()[0]
		if r.header.Get("X-Forwarded-For") == "" || r.header.Get("Via") == "" {
			t.Errorf("%s: sub-request lacks reverse_proxy's headers: %v", b.name, r.header)
		}
	}
}

func TestFanOutReplaysBodyAnd413(t *testing.T) {
	e := newEnv(t)
	b0, b1 := e.backend("b0"), e.backend("b1")
	e.load(partitionSite([]string{b0.addr + " 0/2", b1.addr + " 1/2"}, "max_request_body 16", "merge concat"))
	for _, b := range []*backend{b0, b1} {
		b.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			fmt.Fprintf(w, "%s got %q;", b.name, b.requests()[len(b.requests())-1].body)
		})
	}
	post := func(body string) response {
		req, _ := http.NewRequest(http.MethodPost, e.url("/"), strings.NewReader(body))
		res, err := e.do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	res := post("exactly16bytes!!")
	if res.status != http.StatusOK || res.body != `b0 got "exactly16bytes!!";b1 got "exactly16bytes!!";` {
		t.Errorf("status %d body %q", res.status, res.body)
	}
	res = post("seventeen bytes!!")
	if res.status != http.StatusRequestEntityTooLarge || res.body != "request body larger than max_request_body (16 bytes)\n" {
		t.Errorf("over the limit: status %d body %q; want 413", res.status, res.body)
	}
	base := e.goroutineBaseline()
	for i := range badRepeats {
		// Sent without a Content-Length, the limit is found by reading.
		req, _ := http.NewRequest(http.MethodPost, e.url("/"), io.MultiReader(strings.NewReader(strings.Repeat("x", 4096))))
		res, err := e.do(req)
		if err != nil || res.status != http.StatusRequestEntityTooLarge {
			t.Fatalf("oversized request %d: status %d, %v; want 413", i, res.status, err)
		}
	}
	if n := b0.hits.Load() + b1.hits.Load(); n != 2 {
		t.Errorf("backends saw %d requests; the oversized ones must not be sent", n)
	}
	e.checkGoroutines(base, fmt.Sprintf("%d oversized requests", badRepeats))
}

func TestFailLimitAnswersAtOnceAndCancels(t *testing.T) {
	e := newEnv(t)
	b0, slow, gate := e.backend("b0"), e.backend("slow"), e.backend("gate")
	slow.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) { b.waitCancelled(r) })
	// gate fails once the slow partition's request has reached its
	// backend, so the cancellation has something to cancel.
	gate.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		deadline := time.Now().Add(5 * time.Second)
		for slow.hits.Load() == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	deadAddr := e.deadAddr() // connection refused
	e.load(partitionSite([]string{b0.addr + " 0/4", slow.addr + " 1/4", gate.addr + " 2/4", deadAddr + " 3/4"},
		"fail_limit 2", "timeout 10s"))

	start := time.Now()
	res := e.get("/")
	took := time.Since(start)
	if res.status != http.StatusBadGateway {
		t.Fatalf("status %d body %q; want 502", res.status, res.body)
	}
	if took > 5*time.Second {
		t.Errorf("answer took %v; fail_limit must answer without waiting for the slow partition", took)
	}
	if want := "2/4 partitions failed, fail_limit=2 [p2]status 503 [p3]connection refused\n"; res.body != want {
		t.Errorf("body %q; want %q", res.body, want)
	}
	if st := res.header.Get(StatusHeader); !strings.Contains(st, "p1=0;") || !strings.Contains(st, ";canceled") {
		t.Errorf("%s %q; want p1 canceled", StatusHeader, st)
	}
	waitFor(t, 5*time.Second, "the slow backend's request to be cancelled", func() (bool, string) {
		return slow.cancelled.Load() == 1, fmt.Sprintf("cancelled=%d hits=%d", slow.cancelled.Load(), slow.hits.Load())
	})
}

func TestFailLimitTolerates(t *testing.T) {
	e := newEnv(t)
	b0, b1 := e.backend("b0"), e.backend("b1")
	bad := e.backend("bad")
	bad.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"items": [`)) // invalid JSON
	})
	e.load(partitionSite([]string{b0.addr + " 0/3", bad.addr + " 1/3", b1.addr + " 2/3"}, "fail_limit 2"))
	res := e.get("/")
	if res.status != http.StatusOK {
		t.Fatalf("status %d body %q; one failure under fail_limit 2 must still answer", res.status, res.body)
	}
	var got map[string]any
	if err := json.Unmarshal([]byte(res.body), &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got["items"], []any{0.0, 2.0}) {
		t.Errorf("items %v; want [0 2]", got["items"])
	}
	if st := res.header.Get(StatusHeader); !strings.Contains(st, "p1=200;") || !strings.Contains(st, ";failed") {
		t.Errorf("%s %q", StatusHeader, st)
	}

	// With fail_limit 1 the invalid JSON alone fails the request.
	e.load(partitionSite([]string{b0.addr + " 0/3", bad.addr + " 1/3", b1.addr + " 2/3"}, "fail_limit 1"))
	res = e.get("/")
	if res.status != http.StatusBadGateway || !strings.Contains(res.body, "[p1]invalid JSON") {
		t.Errorf("status %d body %q", res.status, res.body)
	}
}

func TestTimeoutCancelsSlowPartition(t *testing.T) {
	e := newEnv(t)
	b0, slow := e.backend("b0"), e.backend("slow")
	slow.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) { b.waitCancelled(r) })
	e.load(partitionSite([]string{b0.addr + " 0/2", slow.addr + " 1/2"}, "timeout 300ms", "fail_limit 1"))
	start := time.Now()
	res := e.get("/")
	took := time.Since(start)
	if res.status != http.StatusGatewayTimeout || res.body != "1/2 partitions failed, fail_limit=1 [p1]timeout\n" {
		t.Errorf("status %d body %q; want 504 naming p1", res.status, res.body)
	}
	if took < 300*time.Millisecond || took > 3*time.Second {
		t.Errorf("answer took %v; want about the 300ms timeout", took)
	}
	waitFor(t, 5*time.Second, "the slow backend's request to be cancelled", func() (bool, string) {
		return slow.cancelled.Load() >= 1, fmt.Sprintf("cancelled=%d", slow.cancelled.Load())
	})
}

func TestOversizedSubResponseFails(t *testing.T) {
	e := newEnv(t)
	b0, big := e.backend("b0"), e.backend("big")
	big.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"items":["` + strings.Repeat("x", 4096) + `"]}`))
	})
	e.load(partitionSite([]string{b0.addr + " 0/2", big.addr + " 1/2"}, "max_response_body 1KiB", "fail_limit 1"))
	res := e.get("/")
	if res.status != http.StatusBadGateway || !strings.Contains(res.body, "[p1]response larger than max_response_body (1024 bytes)") {
		t.Errorf("status %d body %q", res.status, res.body)
	}
	base := e.goroutineBaseline()
	for i := range badRepeats {
		if res := e.get("/"); res.status != http.StatusBadGateway {
			t.Fatalf("request %d: status %d body %q; want 502", i, res.status, res.body)
		}
	}
	e.checkGoroutines(base, fmt.Sprintf("%d oversized sub-responses", badRepeats))
}

func TestSkipPartitions(t *testing.T) {
	e := newEnv(t)
	b0, b1, b2 := e.backend("b0"), e.backend("b1"), e.backend("b2")
	to := []string{b0.addr + " 0/3", b1.addr + " 1/3", b2.addr + " 2/3"}
	e.load(partitionSite(to, "skip `{partition.index} == 1`"))
	res := e.get("/")
	if res.status != http.StatusOK || !strings.Contains(res.body, `"items":[0,2]`) {
		t.Errorf("status %d body %q", res.status, res.body)
	}
	if b1.hits.Load() != 0 {
		t.Error("skipped partition was sent a request")
	}
	if st := res.header.Get(StatusHeader); !strings.Contains(st, "p1=skipped") {
		t.Errorf("%s %q", StatusHeader, st)
	}

	e.load(partitionSite(to, "skip `{http.request.uri.query.only} != ''`"))
	res = e.get("/?only=1")
	if res.status != http.StatusBadRequest || res.body != "all 3 partitions skipped\n" {
		t.Errorf("all skipped: status %d body %q; want 400", res.status, res.body)
	}
	before := hits(b0, b1, b2)
	base := e.goroutineBaseline()
	for i := range badRepeats {
		if res := e.get("/?only=1"); res.status != http.StatusBadRequest {
			t.Fatalf("request %d: status %d body %q; want 400", i, res.status, res.body)
		}
	}
	if d := delta(before, hits(b0, b1, b2)); d[0]+d[1]+d[2] != 0 {
		t.Errorf("backends saw %v requests while every partition was skipped", d)
	}
	e.checkGoroutines(base, fmt.Sprintf("%d requests with every partition skipped", badRepeats))
}

// TestSubResponsesAreDecoded: backends that compress when asked still
// give mergeable bodies, whatever the client accepts, and client
// conditions are not forwarded to single partitions.
func TestSubResponsesAreDecoded(t *testing.T) {
	e := newEnv(t)
	b0, b1 := e.backend("b0"), e.backend("b1")
	for _, b := range []*backend{b0, b1} {
		b.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("If-None-Match") != "" || r.Header.Get("Range") != "" {
				w.WriteHeader(http.StatusNotModified)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			body := `{"from":["` + b.name + `"]}`
			if strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
				w.Header().Set("Content-Encoding", "gzip")
				zw := gzip.NewWriter(w)
				_, _ = zw.Write([]byte(body))
				_ = zw.Close()
				return
			}
			_, _ = w.Write([]byte(body))
		})
	}
	e.load(partitionSite([]string{b0.addr + " 0/2", b1.addr + " 1/2"}))
	req, _ := http.NewRequest(http.MethodGet, e.url("/"), nil)
	req.Header.Set("Accept-Encoding", "gzip")
	req.Header.Set("If-None-Match", `"v1"`)
	req.Header.Set("Range", "bytes=0-3")
	res, err := e.do(req)
	if err != nil {
		t.Fatal(err)
	}
	if res.status != http.StatusOK || res.body != `{"from":["b0","b1"]}`+"\n" {
		t.Errorf("status %d body %q", res.status, res.body)
	}
}
