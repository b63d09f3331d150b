package lbpolicy

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/orca"
)

// reporting answers 200 with the given Endpoint-Load-Metrics values.
type reporting []string

func (r reporting) RoundTrip(*http.Request) (*http.Response, error) {
	h := http.Header{}
	for _, v := range r {
		h.Add(loadReportHeader, v)
	}
	return &http.Response{StatusCode: 200, Header: h, Body: http.NoBody}, nil
}

func TestTransportTakesLoadReports(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
	strip := loadReportsOrDefault(nil)
	rt := func(inner http.RoundTripper, l *LoadReports, healthCheck bool) *http.Response {
		t.Helper()
		ot := &observingTransport{inner: inner, table: table, reports: l}
		resp, err := ot.RoundTrip(request(context.Background(), u, healthCheck))
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	st := table.Stats(u.Dial)

	// a health check's report is not read, nor its header touched
	if resp := rt(reporting{"TEXT cpu_utilization=0.9"}, strip, true); st.LoadReport() != nil || resp.Header.Get(loadReportHeader) == "" {
		t.Fatalf("health check: report %+v, header %q", st.LoadReport(), resp.Header.Get(loadReportHeader))
	}
	resp := rt(reporting{"TEXT cpu_utilization=0.4, rps_fractional=12, named_metrics.queue=3"}, strip, false)
	if _, ok := resp.Header[loadReportHeader]; ok {
		t.Fatal("header passed on by default")
	}
	good := st.LoadReport()
	if good == nil || good.CPU != 0.4 || good.RPS != 12 || good.Named["queue"] != 3 || good.MaxAge != 3*time.Second {
		t.Fatalf("report = %+v", good)
	}
	fwd := &LoadReports{MaxAge: strip.MaxAge, ForwardHeader: true}
	if resp := rt(reporting{"garbage"}, fwd, false); resp.Header.Get(loadReportHeader) != "garbage" {
		t.Fatal("forward_header: header removed")
	}
	for _, bad := range []string{"TEXT cpu_utilization=NaN", strings.Repeat("x", 1<<20), "TEXT " + strings.Repeat("named_metrics.m=1, ", 10000)} {
		if resp := rt(reporting{bad}, strip, false); resp.StatusCode != 200 || resp.Header.Get(loadReportHeader) != "" {
			t.Fatalf("refused report: status %d, header kept", resp.StatusCode)
		}
	}
	if n, kind := st.LoadReportsRefused(); n != 4 || kind == nil {
		t.Fatalf("refused = %d (%v), want 4", n, kind)
	}
	if st.LoadReport() != good {
		t.Fatal("a refused report replaced the good one")
	}
	// no header: nothing changes, nothing counted
	rt(reporting{}, strip, false)
	if n, _ := st.LoadReportsRefused(); n != 4 || st.LoadReport() != good {
		t.Fatal("a response without a report changed the state")
	}
}

func TestLoadReportsCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want LoadReports
		err  string
	}{
		{in: "load_reports", want: LoadReports{}},
		{in: "load_reports {\n max_age 2s\n forward_header\n}", want: LoadReports{MaxAge: caddy.Duration(2 * time.Second), ForwardHeader: true}},
		{in: "load_reports {\n max_age 500ms\n}", err: "max_age"},
		{in: "load_reports {\n max_age soon\n}", err: "max_age"},
		{in: "load_reports {\n forward_header yes\n}", err: "unexpected argument"},
		{in: "load_reports {\n bogus\n}", err: `unknown option "bogus"`},
		{in: "load_reports 5s", err: "unexpected argument"},
		{in: "load_reports {\n max_age 2s\n max_age 3s\n}", err: "max_age"},
	} {
		d := caddyfile.NewTestDispenser("least_time {\n" + tc.in + "\n}")
		var s LeastTimeSelection
		err := s.UnmarshalCaddyfile(d)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "load_reports") {
				t.Errorf("%q: error %v, want one about load_reports naming %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || s.LoadReports == nil || *s.LoadReports != tc.want {
			t.Errorf("%q: got %+v, %v; want %+v", tc.in, s.LoadReports, err, tc.want)
		}
	}
	// JSON validation shares the rule
	for _, l := range []LoadReports{{MaxAge: -1}, {MaxAge: caddy.Duration(2 * time.Hour)}} {
		s := LeastTimeSelection{LoadReports: &l}
		if err := s.Validate(); err == nil || !strings.Contains(err.Error(), "load_reports: max_age") {
			t.Errorf("max_age %v: %v", l.MaxAge, err)
		}
	}
}

func TestLoadReportsShownInAdminAndMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(collector); err != nil {
		t.Fatal(err)
	}
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	fresh, stale, refused := t.Name()+"-a:80", t.Name()+"-b:80", t.Name()+"-c:80"
	now := monoclock.Now()
	r, err := orca.Parse("TEXT cpu_utilization=0.4, rps_fractional=12, named_metrics.queue=3")
	if err != nil {
		t.Fatal(err)
	}
	table.Stats(fresh).SetLoadReport(r, now, 10*time.Second)
	table.Stats(stale).SetLoadReport(r, now-int64(2*time.Second), time.Second)
	_, perr := orca.Parse("TEXT cpu_utilization=NaN")
	table.Stats(refused).RefuseLoadReport(perr)

	page := buildUpstreamsPage(pageQuery{limit: maxPageLimit, after: t.Name()})
	views := map[string]upstreamView{}
	for _, u := range page.Upstreams {
		views[u.Dial] = u
	}
	a := views[fresh].LoadReport
	if a == nil || *a.CPU != 0.4 || *a.RPS != 12 || a.Mem != nil || a.Named["queue"] != 3 || *a.Utilization != 0.4 || a.Stale || a.AgeMs < 0 || a.MaxAgeMs != 10000 {
		t.Fatalf("fresh report view = %+v", a)
	}
	if b := views[stale].LoadReport; b == nil || !b.Stale || b.AgeMs < 2000 {
		t.Fatalf("stale report view = %+v", b)
	}
	if c := views[refused]; c.LoadReport != nil || c.LoadReportsRefused != 1 || c.LoadReportError != "value" {
		t.Fatalf("refused view: %+v", c)
	}
	if views[fresh].LoadReportsRefused != 0 || views[fresh].LoadReportError != "" {
		t.Fatal("refusal fields on an upstream with none refused")
	}

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			got[mf.GetName()+" "+labelValue(m.GetLabel(), "upstream")] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	if v, ok := got["caddy_lbx_upstream_reported_utilization "+fresh]; !ok || v != 0.4 {
		t.Errorf("reported utilization of the fresh report: %v, %v", v, ok)
	}
	if _, ok := got["caddy_lbx_upstream_reported_utilization "+stale]; ok {
		t.Error("a stale report's utilization is exposed")
	}
	if v := got["caddy_lbx_upstream_load_reports_refused_total "+refused]; v != 1 {
		t.Errorf("refused total = %v", v)
	}
	if _, ok := got["caddy_lbx_upstream_load_reports_refused_total "+fresh]; ok {
		t.Error("refused series for an upstream that refused nothing")
	}
}

func TestLoadReportErrorKinds(t *testing.T) {
	for in, want := range map[string]string{
		"garbage":                 "format",
		"TEXT cpu_utilization=-1": "value",
		"TEXT cpu_utilization=1, cpu_utilization=1": "duplicate",
		strings.Repeat("x", orca.MaxHeaderBytes+1):  "too_long",
	} {
		_, err := orca.Parse(in)
		if got := loadReportErrorKind(err); got != want {
			t.Errorf("%.20q: kind %q, want %q (%v)", in, got, want, err)
		}
	}
}

// The panic policy reads reports only where it observes the traffic
// itself; elsewhere its load_reports is refused, not silently ignored.
func TestPanicLoadReportsPlacement(t *testing.T) {
	for _, tc := range []struct {
		p   *PanicSelection
		err string
	}{
		{&PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "least_time"}`), LoadReports: &LoadReports{}}, "configure load_reports inside the least_time policy"},
		{&PanicSelection{LoadReports: &LoadReports{}}, "load_reports needs an outlier block"},
		{&PanicSelection{Outlier: &Outlier{}, LoadReports: &LoadReports{MaxAge: -1}}, "panic: load_reports: max_age"},
	} {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		wantErr(t, tc.p.Provision(ctx), tc.err)
		_ = tc.p.Cleanup()
		cancel()
	}
}
