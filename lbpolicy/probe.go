package lbpolicy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"regexp"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// probeRule is how the handler's active health checker judges a probe,
// mirrored from its configuration (Caddy does not expose its verdict on a
// host it already deems healthy, and an outlier-ejected host usually is),
// so that probes that pass can end an outlier ejection early, as Envoy
// does.
type probeRule struct {
	expectStatus int            // 0: any 2xx
	body         *regexp.Regexp // nil: any body
	maxBody      int64
	passes       int64
}

// maxProbeBody bounds how much of a probe's body is read to match
// expect_body when the health check sets no max_size.
const maxProbeBody = 1 << 20

// newProbeRule returns the rule of active health checks a, or nil when
// active checks are off.
func newProbeRule(a *reverseproxy.ActiveHealthChecks) (*probeRule, error) {
	if a == nil || !a.IsEnabled() {
		return nil, nil
	}
	r := &probeRule{expectStatus: a.ExpectStatus, maxBody: maxProbeBody, passes: int64(max(a.Passes, 1))}
	if a.MaxSize > 0 {
		r.maxBody = a.MaxSize
	}
	if a.ExpectBody != "" {
		re, err := regexp.Compile(a.ExpectBody)
		if err != nil {
			return nil, fmt.Errorf("active health check expect_body: %v", err)
		}
		r.body = re
	}
	return r, nil
}

// passed reports whether a probe's outcome passes the rule. When the rule
// looks at the body, it reads it (bounded) and puts it back so Caddy's
// checker reads the same bytes.
func (r *probeRule) passed(resp *http.Response, err error) bool {
	if err != nil {
		return false
	}
	if r.expectStatus > 0 {
		if !caddyhttp.StatusCodeMatches(resp.StatusCode, r.expectStatus) {
			return false
		}
	} else if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		return false
	}
	if r.body == nil {
		return true
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, r.maxBody))
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(data), resp.Body), resp.Body}
	return err == nil && r.body.Match(data)
}

// roundTripProbe forwards an active health check and, when it is for an
// ejected upstream of this table, counts it toward an early return: as many
// passes in a row as the checker needs to deem a host healthy end the
// ejection.
func (t *observingTransport) roundTripProbe(req *http.Request, dial string) (*http.Response, error) {
	resp, err := t.inner.RoundTrip(req)
	s, ok := t.table.Lookup(dial)
	if !ok || !s.Ejected(monoclock.Now()) {
		return resp, err
	}
	if !t.probe.passed(resp, err) {
		s.ProbeFailed()
		return resp, err
	}
	if s.ProbePassed() >= t.probe.passes && s.Restore(monoclock.Now()) {
		t.outlier.announceRestored(dial, "active_health_check")
	}
	return resp, err
}

// announceRestored logs and emits the return of an ejected upstream.
func (o *Outlier) announceRestored(dial, why string) {
	if ce := o.logger.Check(zap.InfoLevel, "upstream restored after ejection"); ce != nil {
		ce.Write(zap.String("upstream", dial), zap.String("by", why))
	}
	o.events.Emit(eventUpstreamRestored, map[string]any{"host": dial, "by": why})
}
