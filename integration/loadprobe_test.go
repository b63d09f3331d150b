package integration

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// probedBackend answers its load path with the report it holds (or the
// status in loadStatus, when set) and every other path with "ok" and no
// report, counting each kind: a report shown for it can only have come
// from a probe.
type probedBackend struct {
	srv        *httptest.Server
	report     atomic.Pointer[string]
	loadStatus atomic.Int32
	probes     atomic.Int64
	traffic    atomic.Int64
	// probeHost and probeAgent are the Host and User-Agent of the last probe.
	probeHost, probeAgent atomic.Pointer[string]
}

func (e *env) probedBackend(report string) *probedBackend {
	e.t.Helper()
	b := newProbedBackend(report)
	b.srv.Start()
	e.t.Cleanup(b.srv.Close)
	return b
}

// probedBackendTLS is probedBackend serving HTTPS.
func (e *env) probedBackendTLS(report string) *probedBackend {
	e.t.Helper()
	b := newProbedBackend(report)
	b.srv.StartTLS()
	e.t.Cleanup(b.srv.Close)
	return b
}

func newProbedBackend(report string) *probedBackend {
	b := new(probedBackend)
	b.report.Store(&report)
	b.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/load" {
			b.traffic.Add(1)
			_, _ = io.WriteString(w, "ok")
			return
		}
		b.probes.Add(1)
		host, agent := r.Host, r.UserAgent()
		b.probeHost.Store(&host)
		b.probeAgent.Store(&agent)
		if s := b.loadStatus.Load(); s != 0 {
			w.WriteHeader(int(s))
			return
		}
		w.Header().Set("Endpoint-Load-Metrics", *b.report.Load())
		_, _ = io.WriteString(w, "load")
	}))
	return b
}

func (b *probedBackend) addr() string { return b.srv.Listener.Addr().String() }

// probedUpstream is what GET /lbx/upstreams?dial= says of a probed
// upstream.
type probedUpstream struct {
	Report         *loadReportInfo `json:"load_report"`
	ProbesSent     uint64          `json:"probes_sent"`
	ProbesFailed   uint64          `json:"probes_failed"`
	ProbesRejected uint64          `json:"probes_rejected"`
	EjectedForMs   float64         `json:"ejected_for_ms"`
	Reason         string          `json:"ejection_reason"`
}

func fetchProbed(t *testing.T, dial string) probedUpstream {
	t.Helper()
	return fetchUpstream[probedUpstream](t, dial)
}

// probeSite is a site whose least_time policy probes /load on every
// selection (within 100 a second) and, with weights a million to one,
// sends sequential traffic to the first upstream only: the second gets
// probes alone. outlier is the policy's outlier block, if any.
func probeSite(first, second, outlier string) string {
	return fmt.Sprintf(`reverse_proxy %s %s {
	lb_policy least_time {
		weights 1000000 1
		load_reports {
			probe /load {
				per_request 1
				max_rate 100/s
				timeout 2s
			}
		}
%s
	}
}`, first, second, outlier)
}

// Load probes (issue 27, item 3): while traffic flows, least_time asks the
// upstreams for their load at the probe path, through the handler's
// transport and with the upstream's own address as Host, and the report
// a probe brings is shown as the upstream's, also for one that gets no
// traffic at all; the probes are counted in the admin API and metrics.
func TestLoadProbesReportIdleUpstream(t *testing.T) {
	e := newEnv(t)
	busy := e.probedBackend("TEXT application_utilization=0.2")
	idle := e.probedBackend("TEXT application_utilization=0.6, rps_fractional=4")
	e.load(probeSite(busy.addr(), idle.addr(), ""))

	waitFor(t, 10*time.Second, "a probe's report for the upstream without traffic", func() (bool, string) {
		if code, _ := e.getHeader(t); code != 200 {
			return false, fmt.Sprintf("status %d", code)
		}
		u := fetchProbed(t, idle.addr())
		return u.Report != nil, fmt.Sprintf("%+v", u)
	})
	// a few more, so that both have been probed more than once
	for range 20 {
		e.getHeader(t)
	}
	if n := idle.traffic.Load(); n != 0 {
		t.Fatalf("the probed-only upstream got %d requests of traffic; the test needs it to get none", n)
	}
	u := fetchProbed(t, idle.addr())
	if r := u.Report; r == nil || r.Utilization == nil || *r.Utilization != 0.6 || r.RPS == nil || *r.RPS != 4 || r.Stale {
		t.Fatalf("report from the probes: %+v", r)
	}
	if u.ProbesSent == 0 || u.ProbesFailed != 0 || u.ProbesRejected != 0 || uint64(idle.probes.Load()) < u.ProbesSent {
		t.Fatalf("probe counts %+v; backend saw %d probes", u, idle.probes.Load())
	}
	if h, a := *idle.probeHost.Load(), *idle.probeAgent.Load(); h != idle.addr() || a != "lbx-load-probe" {
		t.Fatalf("probe Host %q, User-Agent %q; want the upstream's address %q and lbx-load-probe", h, a, idle.addr())
	}
	want := fmt.Sprintf(`caddy_lbx_upstream_load_probes_total{result="ok",upstream=%q}`, idle.addr())
	if m := scrape(t); !strings.Contains(m, want) {
		t.Fatalf("/metrics lacks %s", want)
	}
	if u, ok := report(t).upstream(idle.addr()); !ok || u.Samples != 0 {
		t.Fatalf("the probed-only upstream has samples: %+v", u)
	}
}

// A backend that serves its traffic but whose load endpoint fails is
// ejected by outlier detection on its probes' failures alone, and the
// failures are counted.
func TestLoadProbeFailuresEject(t *testing.T) {
	e := newEnv(t)
	good := e.probedBackend("TEXT application_utilization=0.2")
	bad := e.probedBackend("TEXT application_utilization=0.2")
	bad.loadStatus.Store(http.StatusServiceUnavailable)
	e.load(probeSite(good.addr(), bad.addr(), `		outlier {
			consecutive_failures 3
			base_ejection_time 1m
		}`))
	waitFor(t, 10*time.Second, "the upstream whose probes fail to be ejected", func() (bool, string) {
		if code, _ := e.getHeader(t); code != 200 {
			return false, fmt.Sprintf("status %d", code)
		}
		u := fetchProbed(t, bad.addr())
		return u.EjectedForMs > 0, fmt.Sprintf("%+v", u)
	})
	u := fetchProbed(t, bad.addr())
	if u.Reason != "consecutive_failures" || u.ProbesFailed < 3 || u.Report != nil {
		t.Fatalf("ejected upstream: %+v", u)
	}
	if g := fetchProbed(t, good.addr()); g.EjectedForMs != 0 || g.ProbesFailed != 0 {
		t.Fatalf("the healthy upstream: %+v", g)
	}
	want := fmt.Sprintf(`caddy_lbx_upstream_load_probes_total{result="failed",upstream=%q}`, bad.addr())
	if m := scrape(t); !strings.Contains(m, want) {
		t.Fatalf("/metrics lacks %s", want)
	}
}

// Probes go through the handler's transport: to an HTTPS upstream they
// are sent over TLS, with the transport's TLS settings.
func TestLoadProbesOverTLS(t *testing.T) {
	e := newEnv(t)
	b := e.probedBackendTLS("TEXT cpu_utilization=0.35")
	e.load(fmt.Sprintf(`reverse_proxy https://%s {
	transport http {
		tls_insecure_skip_verify
	}
	lb_policy least_time {
		load_reports {
			probe /load {
				per_request 1
			}
		}
	}
}`, b.addr()))
	waitFor(t, 10*time.Second, "a report from a probe over TLS", func() (bool, string) {
		if code, _ := e.getHeader(t); code != 200 {
			return false, fmt.Sprintf("status %d", code)
		}
		u := fetchProbed(t, b.addr())
		return u.Report != nil && u.Report.CPU != nil && *u.Report.CPU == 0.35, fmt.Sprintf("%+v", u)
	})
	if u := fetchProbed(t, b.addr()); u.ProbesFailed != 0 || u.ProbesRejected != 0 || b.traffic.Load() == 0 {
		t.Fatalf("probes over TLS: %+v, traffic %d", u, b.traffic.Load())
	}
}
