package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// reportingBackend answers 200 with the Endpoint-Load-Metrics value it
// holds (none when empty).
type reportingBackend struct {
	srv    *httptest.Server
	report atomic.Pointer[string]
	served atomic.Int64
	delay  atomic.Int64 // how long each answer takes, ns
}

func (e *env) reportingBackend() *reportingBackend {
	e.t.Helper()
	b := new(reportingBackend)
	b.set("")
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if v := *b.report.Load(); v != "" {
			w.Header().Set("Endpoint-Load-Metrics", v)
		}
		b.served.Add(1)
		time.Sleep(time.Duration(b.delay.Load()))
		_, _ = io.WriteString(w, "ok")
	}))
	e.t.Cleanup(b.srv.Close)
	return b
}

func (b *reportingBackend) set(v string) { b.report.Store(&v) }
func (b *reportingBackend) addr() string { return b.srv.Listener.Addr().String() }

// loadReportInfo mirrors the documented load_report object of
// GET /lbx/upstreams.
type loadReportInfo struct {
	CPU         *float64           `json:"cpu_utilization"`
	RPS         *float64           `json:"rps_fractional"`
	Named       map[string]float64 `json:"named_metrics"`
	Utilization *float64           `json:"utilization"`
	AgeMs       float64            `json:"age_ms"`
	Stale       bool               `json:"stale"`
}

type reportedUpstream struct {
	Dial    string          `json:"dial"`
	Report  *loadReportInfo `json:"load_report"`
	Refused uint64          `json:"load_reports_refused"`
	Error   string          `json:"load_report_error"`
}

func fetchReported(t *testing.T, dial string) reportedUpstream {
	t.Helper()
	return fetchUpstream[reportedUpstream](t, dial)
}

// fetchUpstream returns what GET /lbx/upstreams?dial= says of the one
// upstream at dial, decoded into T (the fields a test reads).
func fetchUpstream[T any](t *testing.T, dial string) T {
	t.Helper()
	res, err := adminClient.Get("http://" + adminAddr + "/lbx/upstreams?dial=" + dial)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var page struct {
		Upstreams []T `json:"upstreams"`
	}
	if err := json.NewDecoder(res.Body).Decode(&page); err != nil || len(page.Upstreams) != 1 {
		t.Fatalf("GET /lbx/upstreams?dial=%s: %v, %+v", dial, err, page)
	}
	return page.Upstreams[0]
}

// getHeader sends one request through Caddy and returns the status and
// the Endpoint-Load-Metrics values the client got.
func (e *env) getHeader(t *testing.T) (int, []string) {
	t.Helper()
	res, err := e.client.Get(e.url("/"))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return res.StatusCode, res.Header.Values("Endpoint-Load-Metrics")
}

// A backend's ORCA load report is read, shown in the admin API and the
// metrics, kept from the client unless forward_header, and bad reports
// are counted without touching the last good one or the answers.
func TestLoadReportsShownAndStripped(t *testing.T) {
	e := newEnv(t)
	b := e.reportingBackend()
	e.load(fmt.Sprintf("reverse_proxy %s {\n\tlb_policy least_time {\n\t\tload_reports {\n\t\t\tmax_age 2s\n\t\t}\n\t}\n}", b.addr()))

	b.set("TEXT cpu_utilization=0.4, rps_fractional=12, named_metrics.queue=3")
	if code, h := e.getHeader(t); code != 200 || len(h) != 0 {
		t.Fatalf("status %d, client got the report header %q", code, h)
	}
	u := fetchReported(t, b.addr())
	r := u.Report
	if r == nil || r.CPU == nil || *r.CPU != 0.4 || r.RPS == nil || *r.RPS != 12 || r.Named["queue"] != 3 ||
		r.Utilization == nil || *r.Utilization != 0.4 || r.Stale || r.AgeMs < 0 || r.AgeMs > 2000 {
		t.Fatalf("load report in the admin API: %+v", r)
	}
	metrics := scrape(t)
	if want := fmt.Sprintf("caddy_lbx_upstream_reported_utilization{upstream=%q} 0.4", b.addr()); !strings.Contains(metrics, want) {
		t.Errorf("/metrics lacks %s", want)
	}

	bad := []string{
		"garbage",
		"TEXT cpu_utilization=NaN",
		"TEXT named_metrics.a=" + strings.Repeat("9", 1<<20),
		"TEXT " + strings.Repeat("named_metrics.m=1, ", 10000),
	}
	for _, v := range bad {
		b.set(v)
		if code, h := e.getHeader(t); code != 200 || len(h) != 0 {
			t.Fatalf("bad report %.20q: status %d, header %d values", v, code, len(h))
		}
	}
	u = fetchReported(t, b.addr())
	if u.Refused != uint64(len(bad)) || u.Error == "" || u.Report == nil || *u.Report.CPU != 0.4 {
		t.Fatalf("after bad reports: %+v (report %+v)", u, u.Report)
	}
	if want := fmt.Sprintf("caddy_lbx_upstream_load_reports_refused_total{upstream=%q} %d", b.addr(), len(bad)); !strings.Contains(scrape(t), want) {
		t.Errorf("/metrics lacks %s", want)
	}

	// no new good report: the last one goes stale after max_age
	waitFor(t, 10*time.Second, "the report to go stale", func() (bool, string) {
		u := fetchReported(t, b.addr())
		return u.Report != nil && u.Report.Stale && u.Report.AgeMs >= 2000, fmt.Sprintf("%+v", u.Report)
	})
	if strings.Contains(scrape(t), fmt.Sprintf("caddy_lbx_upstream_reported_utilization{upstream=%q}", b.addr())) {
		t.Error("a stale report's utilization is still exposed")
	}

	// forward_header passes it on
	e.load(fmt.Sprintf("reverse_proxy %s {\n\tlb_policy least_time {\n\t\tload_reports {\n\t\t\tforward_header\n\t\t}\n\t}\n}", b.addr()))
	b.set("TEXT cpu_utilization=0.7")
	if code, h := e.getHeader(t); code != 200 || len(h) != 1 || h[0] != "TEXT cpu_utilization=0.7" {
		t.Fatalf("forward_header: status %d, header %q", code, h)
	}
	if u := fetchReported(t, b.addr()); u.Report == nil || *u.Report.CPU != 0.7 || u.Report.Stale {
		t.Fatalf("report after forward: %+v", u.Report)
	}
}

// scrape returns Caddy's admin /metrics.
func scrape(t *testing.T) string {
	t.Helper()
	res, err := adminClient.Get("http://" + adminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	return string(body)
}

// Dynamic upstreams (issue 27, item 5): a pool from `dynamic a`, with
// the policy in its no-options form, takes the reports in and strips
// them as a static one does; the report is kept under the dial address
// the source produced.
func TestLoadReportsDynamicUpstreams(t *testing.T) {
	e := newEnv(t)
	b := e.reportingBackend()
	_, port, _ := strings.Cut(b.addr(), ":")
	e.load(fmt.Sprintf("reverse_proxy {\n\tdynamic a 127.0.0.1 %s {\n\t\trefresh 1s\n\t}\n\tlb_policy least_time\n}", port))
	b.set("TEXT application_utilization=0.25, cpu_utilization=0.9")
	if code, h := e.getHeader(t); code != 200 || len(h) != 0 {
		t.Fatalf("status %d, client got the report header %q", code, h)
	}
	u := fetchReported(t, b.addr())
	if r := u.Report; r == nil || r.Utilization == nil || *r.Utilization != 0.25 || r.Stale {
		t.Fatalf("load report of a dynamic upstream: %+v", r)
	}
}

// With no options, least_time stops sending to an upstream whose report
// says it is past its capacity, and leaves alone one that is busy but
// below it; once the report says the upstream has room again, it gets its
// share back.
func TestLoadReportsShapeTraffic(t *testing.T) {
	e := newEnv(t)
	bs := []*reportingBackend{e.reportingBackend(), e.reportingBackend(), e.reportingBackend()}
	for _, b := range bs {
		// equally fast, and slow enough that loopback's noise (a first
		// answer on a new connection taking ten times a later one) does
		// not tell them apart: the reports alone do
		b.delay.Store(int64(2 * time.Millisecond))
	}
	e.load(fmt.Sprintf("reverse_proxy %s %s %s {\n\tlb_policy least_time\n}", bs[0].addr(), bs[1].addr(), bs[2].addr()))
	bs[0].set("TEXT application_utilization=0.2")
	bs[1].set("TEXT application_utilization=0.95") // busy, below capacity
	bs[2].set("TEXT application_utilization=4")    // four times past it
	send := func(n int) []int64 {
		before := []int64{bs[0].served.Load(), bs[1].served.Load(), bs[2].served.Load()}
		for range n {
			if code, _ := e.getHeader(t); code != 200 {
				t.Fatalf("status %d", code)
			}
		}
		return []int64{bs[0].served.Load() - before[0], bs[1].served.Load() - before[1], bs[2].served.Load() - before[2]}
	}
	send(30) // every upstream has reported
	got := send(600)
	t.Logf("served %v of 600", got)
	// (the other two split by latency and load as without reports; loopback
	// noise can lean that split either way)
	if got[2] > 6 || got[0] < 100 || got[1] < 100 {
		t.Fatalf("served %v of 600; the upstream reporting 4 should get none, the one reporting 0.95 its share", got)
	}

	bs[2].set("TEXT application_utilization=0.2")
	// its report fades over max_age (3s): it is tried again, and its next
	// answer brings the new report
	waitFor(t, 10*time.Second, "the upstream to get its share back", func() (bool, string) {
		got := send(300)
		return got[2] > 60, fmt.Sprintf("served %v of 300", got)
	})
}
