package partition

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestReject: a request matching a reject rule is answered 400 with the
// rule's reason before any sub-request; the rules see the request's
// placeholders and its body, and the body is still replayed to the
// partitions of a request that passes.
func TestReject(t *testing.T) {
	e := newEnv(t)
	b0, b1 := e.backend("b0"), e.backend("b1")
	e.load(partitionSite([]string{b0.addr + " 0/2", b1.addr + " 1/2"},
		"max_request_body 64",
		"reject `{query.limit} != '' && int({query.limit}) > 100` \"limit over 100: {query.limit}\"",
		"reject `{method} == 'DELETE'`",
		"reject `{http.request.body}.contains('drop')` \"no drop\""))

	send := func(method, path, body string) response {
		t.Helper()
		req, err := http.NewRequest(method, e.url(path), strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		res, err := e.do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		return res
	}
	for _, tc := range []struct {
		method, path, body string
		status             int
		want               string
	}{
		{"GET", "/?limit=500", "", 400, "request rejected: limit over 100: 500\n"},
		{"DELETE", "/", "", 400, "request rejected: {http.request.method} == 'DELETE'\n"},
		{"POST", "/", `{"op":"drop"}`, 400, "request rejected: no drop\n"},
		// The body limit is checked first.
		{"DELETE", "/", strings.Repeat("x", 65), 413, "request body larger than max_request_body (64 bytes)\n"},
	} {
		res := send(tc.method, tc.path, tc.body)
		if res.status != tc.status || res.body != tc.want {
			t.Errorf("%s %s %q: status %d body %q; want %d %q", tc.method, tc.path, tc.body, res.status, res.body, tc.status, tc.want)
		}
		if ct := res.header.Get("Content-Type"); ct != "text/plain; charset=utf-8" {
			t.Errorf("%s %s: Content-Type %q", tc.method, tc.path, ct)
		}
	}
	if n := b0.hits.Load() + b1.hits.Load(); n != 0 {
		t.Fatalf("backends saw %d requests; rejected requests must not reach them", n)
	}

	// Requests that pass go through, body and all.
	res := send("POST", "/?limit=100", `{"op":"keep"}`)
	if res.status != http.StatusOK {
		t.Fatalf("accepted request: status %d body %q", res.status, res.body)
	}
	for _, b := range []*backend{b0, b1} {
		if rs := b.requests(); len(rs) != 1 || rs[0].body != `{"op":"keep"}` {
			t.Errorf("%s saw %d requests (%v); want the body replayed once", b.name, len(rs), rs)
		}
	}

	base := e.goroutineBaseline()
	for i := range badRepeats {
		if res := send("GET", fmt.Sprintf("/?limit=%d", 101+i), ""); res.status != http.StatusBadRequest {
			t.Fatalf("request %d: status %d body %q; want 400", i, res.status, res.body)
		}
	}
	if n := b0.hits.Load() + b1.hits.Load(); n != 2 {
		t.Errorf("backends saw %d requests; want only the 2 of the accepted one", n)
	}
	e.checkGoroutines(base, fmt.Sprintf("%d rejected requests", badRepeats))
}

// TestRejectJSON: in JSON a rule takes any request matchers; without a
// message the answer names the rule.
func TestRejectJSON(t *testing.T) {
	e := newEnv(t)
	b0 := e.backend("b0")
	e.load("\trespond ok")
	cfg := fmt.Sprintf(`{"admin":{"listen":"localhost:%d"},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:%d"],
		"routes":[{"handle":[{"handler":"partition","upstreams":[{"dial":%q,"tag":"0/1"}],
			"reject":[{"match":{"path":["/private/*"],"method":["PUT"]}}, {"match":{"header":{"X-Debug":["1"]}},"message":"no debugging here"}]}]}]}}}}}`,
		adminPort, httpPort, b0.addr)
	if err := postJSON(cfg); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodPut, e.url("/private/x"), nil)
	res, err := e.do(req)
	if err != nil || res.status != http.StatusBadRequest || res.body != "request rejected: reject rule 0\n" {
		t.Errorf("PUT /private/x: status %d body %q (%v); want 400 naming reject rule 0", res.status, res.body, err)
	}
	req, _ = http.NewRequest(http.MethodGet, e.url("/"), nil)
	req.Header.Set("X-Debug", "1")
	res, err = e.do(req)
	if err != nil || res.status != http.StatusBadRequest || res.body != "request rejected: no debugging here\n" {
		t.Errorf("X-Debug: status %d body %q (%v)", res.status, res.body, err)
	}
	if n := b0.hits.Load(); n != 0 {
		t.Errorf("backend saw %d requests", n)
	}
	if res := e.get("/private/x"); res.status != http.StatusOK {
		t.Errorf("GET /private/x: status %d body %q; only PUT is rejected", res.status, res.body)
	}

	// A rule without matchers is a load error.
	bad := strings.Replace(cfg, `{"match":{"path":["/private/*"],"method":["PUT"]}}`, `{"message":"x"}`, 1)
	if err := postJSON(bad); err == nil || !strings.Contains(err.Error(), "reject[0]: no matchers") {
		t.Errorf("rule without matchers: load error %v", err)
	}
}
