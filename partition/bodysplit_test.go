package partition

import (
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/bodysplit"
)

// TestUnmarshalSplitBody covers split_body and merge json's
// missing_field on the unmarshaler alone, error paths included.
func TestUnmarshalSplitBody(t *testing.T) {
	for in, want := range map[string]string{
		"split_body ids":         `{"field":"ids"}`,
		"split_body q.ids index": `{"field":"q.ids","by":"index"}`,
		"split_body ids hash {\nkey id\nmax_elements 5\n}": `{"field":"ids","by":"hash","key":"id","max_elements":5}`,
		"split_body ids {\nkey id\n}":                      `{"field":"ids","key":"id"}`,
	} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\n" + in + "\n}")); err != nil {
			t.Errorf("%q: %v", in, err)
			continue
		}
		got, _ := json.Marshal(h.SplitBody)
		if string(got) != want {
			t.Errorf("%q: split_body %s; want %s", in, got, want)
		}
	}
	for in, want := range map[string]string{
		"split_body":                                                      "partition: split_body: missing value, at Testfile:3",
		"split_body a b c":                                                "partition: split_body: want <field> [hash|index], got 3 arguments, at Testfile:3",
		"split_body a..b":                                                 `partition: split_body: field "a..b": name 2 of the path is empty, at Testfile:3`,
		"split_body a.b.c.d.e.f.g.h.i":                                    `has 9 names; at most 8, at Testfile:3`,
		"split_body ids range":                                            `partition: split_body: by "range": want hash or index, at Testfile:3`,
		"split_body ids index {\nkey id\n}":                               `partition: split_body: key "id": a key applies to by hash only; by index sends element i to part i (partition or branch), at Testfile:4`,
		"split_body ids {\nmax_elements 0\n}":                             "partition: split_body: max_elements 0 is below the minimum 1, at Testfile:4",
		"split_body ids {\nmax_elements 10000001\n}":                      "max_elements 10000001 is above the maximum 10000000, at Testfile:4",
		"split_body ids {\nmax_elements x\n}":                             `partition: split_body: max_elements "x": want a whole number, at Testfile:4`,
		"split_body ids {\nkey\n}":                                        "partition: split_body: key: missing value, at Testfile:4",
		"split_body ids {\nkey a\nkey b\n}":                               "partition: split_body: key specified more than once, at Testfile:5",
		"split_body ids {\nhash\n}":                                       `partition: split_body: unknown option "hash" (want key or max_elements), at Testfile:4`,
		"split_body ids\nsplit_body ids":                                  "partition: split_body specified more than once, at Testfile:4",
		"merge json {\nmissing_field\n}":                                  "partition: merge json: missing_field: missing value, at Testfile:4",
		"merge json {\nmissing_field \"\"\n}":                             "partition: merge json: missing_field is empty",
		"merge json {\nmissing_field a b\n}":                              `one value expected, got another: "b", at Testfile:4`,
		"merge json {\nmissing\n}":                                        `partition: merge json: unknown option "missing" (want missing_field), at Testfile:4`,
		"merge json {\nmissing_field " + strings.Repeat("m", 257) + "\n}": "is 257 bytes; at most 256, at Testfile:4",
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\n" + in + "\n}"))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v; want one containing %q", in, err, want)
		}
	}
	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\nmerge json {\nmissing_field missing\n}\n}")); err != nil {
		t.Fatal(err)
	}
	if string(h.MergeRaw) != `{"merger":"json","missing_field":"missing"}` {
		t.Errorf("merge %s", h.MergeRaw)
	}
}

// TestValidateSplitBody: the JSON path applies the same checks, with the
// option's name.
func TestValidateSplitBody(t *testing.T) {
	for _, tc := range []struct {
		cfg  bodysplit.Config
		want string
	}{
		{bodysplit.Config{}, "split_body: field is empty"},
		{bodysplit.Config{Field: "ids", By: "x"}, `split_body: by "x": want hash or index`},
		{bodysplit.Config{Field: "ids", By: "index", Key: "id"}, `split_body: key "id": a key applies to by hash only`},
		{bodysplit.Config{Field: "ids", MaxElements: -3}, "split_body: max_elements -3 is below the minimum 1"},
	} {
		h := FanOut{SplitBody: &tc.cfg}
		if err := h.checkSplitBody(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v; want %q", tc.cfg, err, tc.want)
		}
	}
	if err := (JSONMerger{MissingField: "a\xff"}).Validate(); err == nil || !strings.Contains(err.Error(), "not valid UTF-8") {
		t.Errorf("missing_field with invalid UTF-8: %v", err)
	}
}

func TestWithMissing(t *testing.T) {
	for _, tc := range []struct {
		body    string
		missing []int
		want    string
	}{
		{"{}\n", nil, "{\"missing\":[]}\n"},
		{`{"a":1,"z":[2]}` + "\n", []int{1, 3}, `{"a":1,"missing":[1,3],"z":[2]}` + "\n"},
		{`{"missing":"theirs","z":1}`, []int{0}, `{"missing":[0],"z":1}` + "\n"},
		{`{"a":{"missing":1}}`, nil, `{"a":{"missing":1},"missing":[]}` + "\n"},
		{"[1,2]\n", []int{2}, "[1,2]\n"},
		{"null\n", []int{2}, "null\n"},
	} {
		if got := string(withMissing([]byte(tc.body), "missing", tc.missing)); got != tc.want {
			t.Errorf("%q %v: %q; want %q", tc.body, tc.missing, got, tc.want)
		}
	}
	if got := missingHeader(round{count: 4}, []int{1, 3}); got != "1, 3" {
		t.Errorf("header %q", got)
	}
}

// idBackends starts n backends that answer a multi-get: each records the
// ids of each request body it gets ({"ids":[...]}) and echoes them as
// {"items":[...]}.
type idBackends struct {
	list []*backend
	mu   sync.Mutex
	ids  map[int][]string // backend index -> ids received
	reqs map[int]int      // backend index -> requests
}

func newIDBackends(e *env, n int) *idBackends {
	ib := &idBackends{ids: map[int][]string{}, reqs: map[int]int{}}
	for i := range n {
		b := e.backend(fmt.Sprintf("ids%d", i))
		b.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
			reqs := b.requests()
			var in struct{ IDs []json.RawMessage }
			if err := json.Unmarshal([]byte(reqs[len(reqs)-1].body), &in); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			ib.mu.Lock()
			ib.reqs[i]++
			for _, id := range in.IDs {
				ib.ids[i] = append(ib.ids[i], string(id))
			}
			ib.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{"items": in.IDs})
		})
		ib.list = append(ib.list, b)
	}
	return ib
}

func (ib *idBackends) to() []string {
	var to []string
	for i, b := range ib.list {
		to = append(to, fmt.Sprintf("%s %d/%d", b.addr, i, len(ib.list)))
	}
	return to
}

// multiGet is a body of n string ids "user:<i>", and the ids as the
// backends see them (JSON strings).
func multiGet(n int) (body string, ids []string) {
	for i := range n {
		ids = append(ids, strconv.Quote(fmt.Sprintf("user:%d", i)))
	}
	return `{"want": "profile", "ids": [` + strings.Join(ids, ", ") + `]}`, ids
}

func (e *env) post(path, body string) response {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.url(path), strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	res, err := e.do(req)
	if err != nil {
		e.t.Fatalf("POST %s: %v", path, err)
	}
	return res
}

// itemsOf returns the items of a merged answer, as JSON texts, sorted.
func itemsOf(t *testing.T, body string) []string {
	t.Helper()
	var out struct{ Items []json.RawMessage }
	if err := json.Unmarshal([]byte(body), &out); err != nil {
		t.Fatalf("merged body %q: %v", body, err)
	}
	var items []string
	for _, it := range out.Items {
		items = append(items, string(it))
	}
	slices.Sort(items)
	return items
}

// TestSplitBodyMultiGet: a body of 300 ids among 3 partitions; each
// backend receives exactly the ids FNV-1a-64 gives its partition, once
// each, in one request, with a Content-Length of its own body; the
// merged answer holds all 300.
func TestSplitBodyMultiGet(t *testing.T) {
	e := newEnv(t)
	ib := newIDBackends(e, 3)
	e.load(partitionSite(ib.to(), "split_body ids"))

	body, ids := multiGet(300)
	res := e.post("/", body)
	if res.status != http.StatusOK {
		t.Fatalf("status %d: %s", res.status, res.body)
	}
	want := slices.Sorted(slices.Values(ids))
	if got := itemsOf(t, res.body); !slices.Equal(got, want) {
		t.Errorf("merged %d items; want the 300 ids", len(got))
	}
	if m := res.header.Get(MissingHeader); m != "" {
		t.Errorf("%s %q on a complete answer", MissingHeader, m)
	}
	for i, b := range ib.list {
		var mine []string
		for _, id := range ids {
			s, _ := strconv.Unquote(id)
			if int(bodysplit.HashKey([]byte(s))%3) == i {
				mine = append(mine, id)
			}
		}
		ib.mu.Lock()
		got, reqs := ib.ids[i], ib.reqs[i]
		ib.mu.Unlock()
		if reqs != 1 || !slices.Equal(got, mine) {
			t.Errorf("backend %d: %d requests, ids %v; want exactly its %d ids, in order: %v", i, reqs, got, len(mine), mine)
		}
		seen := b.requests()[0]
		if cl := seen.header.Get("Content-Length"); cl != strconv.Itoa(len(seen.body)) {
			t.Errorf("backend %d: Content-Length %q for a body of %d bytes", i, cl, len(seen.body))
		}
		if !strings.HasPrefix(seen.body, `{"want": "profile", "ids": [`) {
			t.Errorf("backend %d: body %q; the rest of the body must be as written", i, seen.body)
		}
		t.Logf("backend %d: %d ids", i, len(got))
	}
}

// TestSplitBodyPartitionDown: with one partition down and fail_limit 2,
// the answer is 200 with the other partitions' ids and says which is
// missing, in X-Partition-Missing and in merge json's missing_field.
func TestSplitBodyPartitionDown(t *testing.T) {
	e := newEnv(t)
	ib := newIDBackends(e, 3)
	to := ib.to()
	to[1] = e.deadAddr() + " 1/3"
	e.load(partitionSite(to, "split_body ids", "fail_limit 2", "lb_retries 0", "merge json {\n\t\t\tmissing_field missing\n\t\t}"))

	body, ids := multiGet(300)
	res := e.post("/", body)
	if res.status != http.StatusOK {
		t.Fatalf("status %d: %s", res.status, res.body)
	}
	if m := res.header.Get(MissingHeader); m != "1" {
		t.Errorf("%s %q; want 1", MissingHeader, m)
	}
	var want []string
	for _, id := range ids {
		s, _ := strconv.Unquote(id)
		if bodysplit.HashKey([]byte(s))%3 != 1 {
			want = append(want, id)
		}
	}
	slices.Sort(want)
	if got := itemsOf(t, res.body); !slices.Equal(got, want) {
		t.Errorf("merged %d items; want the %d of partitions 0 and 2", len(got), len(want))
	}
	var out struct{ Missing []int }
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || !slices.Equal(out.Missing, []int{1}) {
		t.Errorf("missing member %v (%v); want [1]", out.Missing, err)
	}
	if st := res.header.Get(StatusHeader); !strings.Contains(st, ";failed, p2=200;") {
		t.Errorf("%s %q; want p1 failed", StatusHeader, st)
	}
	t.Logf("%d of 300 ids, %s: %s", len(want), MissingHeader, res.header.Get(MissingHeader))

	// Complete again (the dead partition's ids are not asked for): [].
	var body0 []string
	for _, id := range ids {
		s, _ := strconv.Unquote(id)
		if bodysplit.HashKey([]byte(s))%3 == 0 {
			body0 = append(body0, id)
		}
	}
	res = e.post("/", `{"ids":[`+strings.Join(body0, ",")+`]}`)
	if res.status != http.StatusOK || res.header.Get(MissingHeader) != "" || !strings.Contains(res.body, `"missing":[]`) {
		t.Errorf("complete answer: status %d, %s %q, body %.80q; want 200, no header, \"missing\":[]", res.status, MissingHeader, res.header.Get(MissingHeader), res.body)
	}
	if st := res.header.Get(StatusHeader); !strings.Contains(st, "p1=skipped, p2=skipped") {
		t.Errorf("%s %q; want p1 and p2 skipped", StatusHeader, st)
	}
}

// TestSplitBodyIndexAndSkip: by index, partition i gets element i; a
// partition with no ids is skipped (its backend sees nothing); bodies
// that cannot be split are answered 400 and no backend sees a request.
func TestSplitBodyIndexAndSkip(t *testing.T) {
	e := newEnv(t)
	ib := newIDBackends(e, 3)
	e.load(partitionSite(ib.to(), "split_body q.ids index"))

	res := e.post("/", `{"q":{"ids":[["a"],["b","c"],[]]}}`)
	if res.status != http.StatusOK {
		t.Fatalf("index: status %d: %s", res.status, res.body)
	}
	for i, want := range []string{`{"q":{"ids":[["a"]]}}`, `{"q":{"ids":[["b","c"]]}}`, `{"q":{"ids":[[]]}}`} {
		if reqs := ib.list[i].requests(); len(reqs) != 1 || reqs[0].body != want {
			t.Errorf("index: backend %d saw %v; want one request %s", i, reqs, want)
		}
	}

	// Hash mode: only partition 2 has ids ("user:42" goes to 2 of 3).
	e.load(partitionSite(ib.to(), "split_body ids"))
	before := []int64{ib.list[0].hits.Load(), ib.list[1].hits.Load(), ib.list[2].hits.Load()}
	res = e.post("/", `{"ids":["user:42"]}`)
	if res.status != http.StatusOK || res.body != `{"items":["user:42"]}`+"\n" {
		t.Fatalf("one id: status %d body %q", res.status, res.body)
	}
	if st := res.header.Get(StatusHeader); !strings.HasPrefix(st, "p0=skipped, p1=skipped, p2=200;") {
		t.Errorf("%s %q; want p0 and p1 skipped", StatusHeader, st)
	}
	if d := []int64{ib.list[0].hits.Load() - before[0], ib.list[1].hits.Load() - before[1], ib.list[2].hits.Load() - before[2]}; !slices.Equal(d, []int64{0, 0, 1}) {
		t.Errorf("requests per backend %v; want [0 0 1]", d)
	}

	hits := func() int64 { return ib.list[0].hits.Load() + ib.list[1].hits.Load() + ib.list[2].hits.Load() }
	before0 := hits()
	for body, want := range map[string]string{
		`{"ids":[]}`:          "all 3 partitions skipped",
		``:                    "split_body: request body is empty",
		`{"ids":[1,`:          "split_body: request body is not valid JSON",
		`["user:42"]`:         "split_body: request body is an array; split_body needs a JSON object",
		`{"id":[1]}`:          `split_body: request body has no field "ids"`,
		`{"ids":"user:42"}`:   `split_body: field "ids" is a string; want an array`,
		`{"ids":[1,{"a":2}]}`: `split_body: element 1 of "ids" is an object; want a string or a number`,
	} {
		res := e.post("/", body)
		if res.status != http.StatusBadRequest || !strings.Contains(res.body, want) {
			t.Errorf("%q: status %d body %q; want 400 with %q", body, res.status, res.body, want)
		}
	}
	if n := hits() - before0; n != 0 {
		t.Errorf("backends saw %d requests for bodies that cannot be split", n)
	}
}

// TestSplitBodyReservation: a fan-out reserves one copy of the body per
// partition it sends to, and with split_body twice the split bodies of
// the partitions it sends to (they are held, and reverse_proxy buffers a
// copy of each).
func TestSplitBodyReservation(t *testing.T) {
	body := []byte(`{"ids":[1,2,3,4]}`)
	calls := []*subCall{{index: 0}, {index: 2}}
	whole := subParent{body: body}
	if got := whole.bodyBytes(calls); got != 2*int64(len(body)) {
		t.Errorf("whole body to 2 partitions: %d; want %d", got, 2*len(body))
	}
	split := subParent{body: body, bodies: [][]byte{[]byte(`{"ids":[1,3]}`), nil, []byte(`{"ids":[2,4]}`)}}
	if got := split.bodyBytes(calls); got != 2*(13+13) {
		t.Errorf("split bodies: %d; want %d", got, 2*(13+13))
	}
	if !split.noBody(1) || split.noBody(0) || whole.noBody(1) {
		t.Error("noBody: only a partition split_body left without elements is skipped")
	}
	if string(split.bodyFor(2)) != `{"ids":[2,4]}` || string(whole.bodyFor(2)) != string(body) {
		t.Error("bodyFor")
	}
}

// TestMissingParts: missing are the partitions that failed (an error, a
// timeout), not those skipped or cancelled because the merger had enough.
func TestMissingParts(t *testing.T) {
	failed := fmt.Errorf("status 503")
	outcomes := []*outcome{
		{index: 0},
		{index: 1, err: failed, done: true},
		{index: 2, skipped: true},
		{index: 3, err: fmt.Errorf("canceled"), canceled: true},
		{index: 4, err: fmt.Errorf("timeout"), status: http.StatusGatewayTimeout},
		nil,
	}
	if got := missingParts(outcomes); !slices.Equal(got, []int{1, 4}) {
		t.Errorf("missing %v; want [1 4]", got)
	}
	if got := missingParts(outcomes[:1]); got != nil {
		t.Errorf("missing %v; want none", got)
	}
}

// TestParallelSplitBody: split_body in parallel, brpc's
// UseFieldAsSubRequest. By index, branch i (here three different
// services) is sent element i of the array and nothing else; by hash,
// each branch its ids, a branch left with none skipped; a body that
// cannot be split is answered 400 with no branch asked.
func TestParallelSplitBody(t *testing.T) {
	e := newEnv(t)
	ib := newIDBackends(e, 3)
	site := func(by string) string {
		var b strings.Builder
		b.WriteString("\tparallel {\n")
		for i, s := range ib.list {
			fmt.Fprintf(&b, "\t\tbranch svc%d {\n\t\t\treverse_proxy %s\n\t\t}\n", i, s.addr)
		}
		b.WriteString("\t\tsplit_body ids " + by + "\n\t}")
		return b.String()
	}
	e.load(site("index"))
	res := e.post("/", `{"ids": [["a1", "a2"], "b", {"c": 3}]}`)
	if res.status != http.StatusOK {
		t.Fatalf("by index: status %d: %s", res.status, res.body)
	}
	want := map[int][]string{0: {`["a1", "a2"]`}, 1: {`"b"`}, 2: {`{"c": 3}`}}
	ib.mu.Lock()
	if !reflect.DeepEqual(ib.ids, want) {
		t.Errorf("by index: the branches got %v; want element i in branch i: %v", ib.ids, want)
	}
	ib.ids, ib.reqs = map[int][]string{}, map[int]int{}
	ib.mu.Unlock()

	e.load(site("hash"))
	_, ids := multiGet(300)
	var mine0 []string // the ids branch 0 is asked for, alone
	for _, id := range ids {
		s, _ := strconv.Unquote(id)
		if bodysplit.HashKey([]byte(s))%3 == 0 {
			mine0 = append(mine0, id)
		}
	}
	res = e.post("/", `{"ids":[`+strings.Join(mine0, ",")+`]}`)
	if res.status != http.StatusOK || len(itemsOf(t, res.body)) != len(mine0) {
		t.Fatalf("by hash: status %d, body %.80q; want the %d ids of branch 0", res.status, res.body, len(mine0))
	}
	if st := res.header.Get(ParallelStatusHeader); !strings.HasPrefix(st, "svc0=200;") || !strings.Contains(st, "svc1=skipped, svc2=skipped") {
		t.Errorf("by hash: %s %q; want svc0 asked, svc1 and svc2 skipped", ParallelStatusHeader, st)
	}
	ib.mu.Lock()
	if ib.reqs[0] != 1 || ib.reqs[1] != 0 || ib.reqs[2] != 0 || len(ib.ids[0]) != len(mine0) {
		t.Errorf("by hash: requests %v, %d ids at branch 0; want one request, to branch 0, with its %d ids", ib.reqs, len(ib.ids[0]), len(mine0))
	}
	ib.mu.Unlock()

	res = e.post("/", `{"ids": "not an array"}`)
	if res.status != http.StatusBadRequest || !strings.Contains(res.body, "split_body") {
		t.Errorf("unsplittable body: status %d, %q; want 400 naming split_body", res.status, res.body)
	}
	ib.mu.Lock()
	if n := ib.reqs[0] + ib.reqs[1] + ib.reqs[2]; n != 1 {
		t.Errorf("an unsplittable body reached a branch: %d requests in all; want 1 (the one before)", n)
	}
	ib.mu.Unlock()
}
