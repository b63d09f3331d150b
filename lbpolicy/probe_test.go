package lbpolicy

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// answer is a transport that answers every request with status and body.
type answer struct {
	status int
	body   string
}

func (a answer) RoundTrip(*http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: a.status, Body: io.NopCloser(strings.NewReader(a.body))}, nil
}

func TestProbeRule(t *testing.T) {
	if r, err := newProbeRule(&reverseproxy.ActiveHealthChecks{}); r != nil || err != nil {
		t.Fatalf("active checks without a URI, path or port are off; got rule %+v, %v", r, err)
	}
	if _, err := newProbeRule(&reverseproxy.ActiveHealthChecks{URI: "/health", ExpectBody: "("}); err == nil {
		t.Fatal("an invalid expect_body must be an error")
	}
	for _, tc := range []struct {
		name string
		cfg  reverseproxy.ActiveHealthChecks
		resp answer
		want bool
	}{
		{"2xx passes by default", reverseproxy.ActiveHealthChecks{URI: "/h"}, answer{204, ""}, true},
		{"3xx fails by default", reverseproxy.ActiveHealthChecks{URI: "/h"}, answer{301, ""}, false},
		{"503 fails", reverseproxy.ActiveHealthChecks{URI: "/h"}, answer{503, ""}, false},
		{"expect_status exact", reverseproxy.ActiveHealthChecks{URI: "/h", ExpectStatus: 418}, answer{418, ""}, true},
		{"expect_status class", reverseproxy.ActiveHealthChecks{URI: "/h", ExpectStatus: 3}, answer{302, ""}, true},
		{"expect_status mismatch", reverseproxy.ActiveHealthChecks{URI: "/h", ExpectStatus: 200}, answer{204, ""}, false},
		{"expect_body matches", reverseproxy.ActiveHealthChecks{URI: "/h", ExpectBody: "^ok"}, answer{200, "ok, all good"}, true},
		{"expect_body does not match", reverseproxy.ActiveHealthChecks{URI: "/h", ExpectBody: "^ok"}, answer{200, "degraded"}, false},
		{"expect_body beyond max_size", reverseproxy.ActiveHealthChecks{URI: "/h", ExpectBody: "ok", MaxSize: 4}, answer{200, "not ok"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := newProbeRule(&tc.cfg)
			if err != nil || r == nil {
				t.Fatalf("rule: %v, %v", r, err)
			}
			resp, _ := tc.resp.RoundTrip(nil)
			if got := r.passed(resp, nil); got != tc.want {
				t.Fatalf("passed = %v, want %v", got, tc.want)
			}
			// Caddy's checker reads the body after us: it must be whole.
			if b, _ := io.ReadAll(resp.Body); string(b) != tc.resp.body {
				t.Fatalf("body after the rule = %q, want %q", b, tc.resp.body)
			}
		})
	}
}

// TestPassingProbesEndEjection: an ejected upstream returns after as many
// passing probes in a row as the health checker needs (health_passes), a
// failing probe starts the count again, and probes of upstreams that are
// not ejected change nothing.
func TestPassingProbesEndEjection(t *testing.T) {
	o := newOutlier(t, Outlier{BaseEjectionTime: caddy.Duration(time.Hour)})
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
	s := table.Stats(u.Dial)
	probe, _ := newProbeRule(&reverseproxy.ActiveHealthChecks{URI: "/health", Passes: 2})
	pass := &observingTransport{inner: answer{200, "ok"}, table: table, outlier: o, probe: probe}
	fail := &observingTransport{inner: answer{503, ""}, table: table, outlier: o, probe: probe}
	roundTrip := func(ot *observingTransport) {
		t.Helper()
		if _, err := ot.RoundTrip(request(context.Background(), u, true)); err != nil {
			t.Fatal(err)
		}
	}

	roundTrip(pass) // not ejected: nothing to do
	if _, _, ok := s.Eject(monoclock.Now(), time.Hour, o.ejectionTime, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("eject")
	}
	roundTrip(pass)
	roundTrip(fail)
	roundTrip(pass)
	if !s.Ejected(monoclock.Now()) {
		t.Fatal("returned without 2 passing probes in a row")
	}
	before := monoclock.Now()
	roundTrip(pass)
	now := monoclock.Now()
	if s.Ejected(now) {
		t.Fatal("still ejected after 2 passing probes in a row")
	}
	if r := s.RampStart(now); r < before || r > now {
		t.Fatalf("the early return must start slow start: ramp start %d, want in [%d, %d]", r, before, now)
	}
	if s.TakeRestored(now) {
		t.Fatal("an early return is announced when it happens, not again by the next attempt")
	}
}
