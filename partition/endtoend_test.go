package partition

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// TestMergeNDJSON: merge ndjson joins the partitions' lines in partition
// order, whatever order they answer in, ending each part with a newline
// and leaving empty parts out.
func TestMergeNDJSON(t *testing.T) {
	e := newEnv(t)
	b0, b1, b2 := e.backend("b0"), e.backend("b1"), e.backend("b2")
	// p0 answers last: once the other two have been asked.
	b0.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		deadline := time.Now().Add(5 * time.Second)
		for (b1.hits.Load() == 0 || b2.hits.Load() == 0) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		w.Header().Set("Content-Type", "application/x-ndjson")
		_, _ = w.Write([]byte("{\"id\":0}\n{\"id\":1}\n"))
	})
	b1.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":2,"s":"a\nb"}`)) // no final newline
	})
	b2.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK) // empty
	})
	e.load(partitionSite([]string{b0.addr + " 0/3", b1.addr + " 1/3", b2.addr + " 2/3"}, "merge ndjson"))

	res := e.get("/")
	want := "{\"id\":0}\n{\"id\":1}\n{\"id\":2,\"s\":\"a\\nb\"}\n"
	if res.status != http.StatusOK || res.body != want {
		t.Fatalf("status %d body %q; want 200 %q", res.status, res.body, want)
	}
	if ct := res.header.Get("Content-Type"); ct != "application/x-ndjson" {
		t.Errorf("Content-Type %q", ct)
	}
	if cl := res.header.Get("Content-Length"); cl != strconv.Itoa(len(want)) {
		t.Errorf("Content-Length %q; want %d", cl, len(want))
	}
	if st := res.header.Get(StatusHeader); strings.Count(st, "=200;") != 3 {
		t.Errorf("%s %q; want three 200s", StatusHeader, st)
	}
}

// TestMergeFirst: merge first answers with the first successful
// sub-response — its status, headers and body — as soon as it arrives;
// a failed partition does not count, and the partition still running is
// cancelled down to its backend.
//
// The winner answers once lbx has observed the failing partition's round
// trip, so the failure almost always reaches the handler first (the
// handler cannot be observed any closer); when it does not, p0 shows as
// cancelled instead of failed, which is also correct.
func TestMergeFirst(t *testing.T) {
	e := newEnv(t)
	fail, slow, win := e.backend("fail"), e.backend("slow"), e.backend("win")
	fail.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	slow.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) { b.waitCancelled(r) })
	// The winner answers once the failure is in and the slow partition
	// is waiting.
	failureObserved := func() bool {
		for _, s := range hoststate.All() {
			if s.Dial == fail.addr {
				return s.Samples > 0 && s.Pending == 0
			}
		}
		return false
	}
	win.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		deadline := time.Now().Add(5 * time.Second)
		for (!failureObserved() || slow.hits.Load() == 0) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("X-From", b.name)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("from " + b.name))
	})
	e.load(partitionSite([]string{fail.addr + " 0/3", slow.addr + " 1/3", win.addr + " 2/3"}, "merge first", "timeout 10s"))

	start := time.Now()
	res := e.get("/")
	took := time.Since(start)
	if res.status != http.StatusCreated || res.body != "from win" || res.header.Get("X-From") != "win" {
		t.Fatalf("status %d body %q X-From %q; want the winner's 201", res.status, res.body, res.header.Get("X-From"))
	}
	if ct := res.header.Get("Content-Type"); ct != "text/plain" {
		t.Errorf("Content-Type %q; want the winner's", ct)
	}
	st := res.header.Get(StatusHeader)
	p0failed := strings.HasPrefix(st, "p0=503;") && strings.Contains(st, ";failed, p1=")
	p0canceled := strings.HasPrefix(st, "p0=0;") && strings.Contains(st, ";canceled, p1=")
	if !(p0failed || p0canceled) || !strings.Contains(st, ", p1=0;") || !strings.Contains(st, ";canceled, p2=201;") {
		t.Errorf("%s %q; want p0 failed (or, rarely, canceled), p1 canceled, p2 201", StatusHeader, st)
	}
	if took > 5*time.Second {
		t.Errorf("answer took %v; merge first must not wait for the slow partition", took)
	}
	waitFor(t, 5*time.Second, "the slow backend's request to be cancelled", func() (bool, string) {
		return slow.cancelled.Load() == 1, fmt.Sprintf("cancelled=%d hits=%d", slow.cancelled.Load(), slow.hits.Load())
	})
	t.Logf("answered in %v: %s", took, st)
}

// logLines returns the JSON lines of a log file written so far.
func logLines(t *testing.T, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// TestPlaceholdersInAccessLog: the per-partition placeholders reach an
// access log through log_append, with the sub-responses' statuses, the
// partitions' latencies, upstreams and errors.
func TestPlaceholdersInAccessLog(t *testing.T) {
	dir := t.TempDir() // removed after the config that writes there is unloaded
	e := newEnv(t)
	fast, slow := e.backend("fast"), e.backend("slow")
	const slowFor = 80 * time.Millisecond
	slow.setHandler(func(b *backend, w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(slowFor):
		case <-r.Context().Done():
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	access := filepath.Join(dir, "access.log")
	fields := map[string]string{
		"p0_status":        "{http.partition.0.status}",
		"p0_latency_ms":    "{http.partition.0.latency_ms}",
		"p0_upstream":      "{http.partition.0.upstream}",
		"p1_status":        "{http.partition.1.status}",
		"p1_latency_ms":    "{http.partition.1.latency_ms}",
		"p1_error":         "{http.partition.1.error}",
		"partition_count":  "{http.partition.count}",
		"partition_failed": "{http.partition.failed}",
		"partition_status": "{http.partition.status}",
	}
	var site strings.Builder
	fmt.Fprintf(&site, "\tlog {\n\t\toutput file %s\n\t\tformat json\n\t}\n", access)
	for k, v := range fields {
		fmt.Fprintf(&site, "\tlog_append %s %s\n", k, v)
	}
	site.WriteString(partitionSite([]string{fast.addr + " 0/2", slow.addr + " 1/2"}))
	e.load(site.String())

	res := e.get("/logged")
	if res.status != http.StatusOK {
		t.Fatalf("status %d body %q; one failed partition of two must still answer", res.status, res.body)
	}
	var entry map[string]any
	waitFor(t, 5*time.Second, "the access log line", func() (bool, string) {
		for _, l := range logLines(t, access) {
			if req, _ := l["request"].(map[string]any); req != nil && req["uri"] == "/logged" {
				entry = l
				return true, ""
			}
		}
		return false, "no line for /logged yet"
	})
	t.Logf("access log fields: p0 %v %vms, p1 %v %vms %q, status %q",
		entry["p0_status"], entry["p0_latency_ms"], entry["p1_status"], entry["p1_latency_ms"], entry["p1_error"], entry["partition_status"])

	for k, want := range map[string]any{
		"p0_status": 200.0, "p0_upstream": fast.addr,
		"p1_status": 503.0, "p1_error": "status 503",
		"partition_count": 2.0, "partition_failed": 1.0,
		"partition_status": res.header.Get(StatusHeader),
	} {
		if entry[k] != want {
			t.Errorf("%s = %#v; want %#v", k, entry[k], want)
		}
	}
	p0, ok0 := entry["p0_latency_ms"].(float64)
	p1, ok1 := entry["p1_latency_ms"].(float64)
	if !ok0 || !ok1 || p0 < 0 || p1 < float64(slowFor.Milliseconds()) || p1 > 5000 {
		t.Errorf("latencies p0 %v, p1 %v ms; want p1 at least %v", entry["p0_latency_ms"], entry["p1_latency_ms"], slowFor)
	}
	if st, _ := entry["status"].(float64); st != 200 {
		t.Errorf("logged status %v", entry["status"])
	}
}

// TestNamingFileTooManySchemes: a naming file version that would make
// more than 8 schemes is rejected as a whole, with a log line naming the
// file and why; the last good list keeps serving, and the next good
// version is taken.
func TestNamingFileTooManySchemes(t *testing.T) {
	dir := t.TempDir() // removed after the config that writes there is unloaded
	e := newEnv(t)
	logFile := filepath.Join(dir, "caddy.log")
	e.global = fmt.Sprintf("log {\n\t\toutput file %s\n\t\tformat json\n\t}", logFile)
	old, next := e.backend("old"), e.backend("next")
	list := filepath.Join(t.TempDir(), "server_list")
	writeFile(t, list, old.addr+" 0/1\n")
	// The last version replaces the whole list at once.
	e.load(partitionSite(nil, "naming_file "+list, "poll_interval 100ms", "naming_max_removed_percent 100"))

	l := e.startLoad(2)
	l.waitRequests(t, 30)

	// Nine schemes: 0/1 … 0/9 on the new backend, next to the old one.
	var nine strings.Builder
	nine.WriteString(old.addr + " 0/1\n")
	for m := 1; m <= 9; m++ {
		fmt.Fprintf(&nine, "%s 0/%d\n", next.addr, m)
	}
	writeFile(t, list, nine.String())
	var rejected map[string]any
	waitFor(t, 10*time.Second, "the rejection to be logged", func() (bool, string) {
		for _, m := range logLines(t, logFile) {
			if m["msg"] == "naming file not used; keeping the last good upstream list" && m["file"] == list {
				rejected = m
				return true, ""
			}
		}
		return false, "not logged yet"
	})
	reason, _ := rejected["reason"].(string)
	t.Logf("logged: %s %q (file %v)", rejected["msg"], reason, rejected["file"])
	if want := "9 partition schemes (partition counts 1, 2, 3, 4, 5, 6, 7, 8, 9); at most 8 may coexist"; reason != want {
		t.Errorf("reason %q; want %q", reason, want)
	}
	if rejected["level"] != "error" {
		t.Errorf("logged at level %v; want error", rejected["level"])
	}
	before := hits(old, next)
	l.waitRequests(t, 100)
	d := delta(before, hits(old, next))
	if d[0] == 0 || d[1] != 0 || next.hits.Load() != 0 {
		t.Errorf("after the rejected version: hits old %d, new %d; the last good list must stay", d[0], next.hits.Load())
	}

	// A good version again (8 schemes) is taken.
	var eight strings.Builder
	for m := 1; m <= 8; m++ {
		fmt.Fprintf(&eight, "%s 0/%d\n", next.addr, m)
	}
	writeFile(t, list, eight.String())
	waitFor(t, 10*time.Second, "traffic on the next good version", func() (bool, string) {
		return next.hits.Load() > 0, fmt.Sprintf("new backend hits %d", next.hits.Load())
	})
	l.halt()
	if f := l.failures(); len(f) > 0 {
		t.Errorf("%d requests failed; first: %s", len(f), f[0])
	}
	recovered := false
	for _, m := range logLines(t, logFile) {
		if m["msg"] == "naming file usable again" && m["file"] == list {
			recovered = true
		}
	}
	if !recovered {
		t.Error("the recovery was not logged")
	}
	t.Logf("%d requests, none failed", l.ok.Load())
}
