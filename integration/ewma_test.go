package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A backend that turns slow loses its traffic under ewma, and more of it
// than under stock least_conn with the same load.
//
// The load arrives at a fixed rate (at most 8 in flight) rather than as
// fast as 8 clients can go: at saturation least_conn's in-flight counts
// are themselves a latency signal and it gives the slow backend little
// (about 1.5% here), while at ordinary load, where most backends are idle
// when a request arrives, it picks the slow one whenever it is free.
func TestEWMADegradedBackendGetsSmallShare(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(4)
	slow := bs[3]
	slow.delay.Store(int64(40 * time.Millisecond))

	const n, conc, interval = 400, 8, 5 * time.Millisecond // 200 req/s
	run := func(policy string) loadResult {
		t.Helper()
		e.load(fmt.Sprintf("reverse_proxy %s {\n\tlb_policy %s\n}", dials(bs...), policy))
		start := time.Now()
		r := e.drivePaced("/", n, conc, interval)
		took := time.Since(start)
		t.Logf("%-10s %d requests in %v: %v; degraded share %.1f%%",
			policy, r.total, took.Round(time.Millisecond), r.counts, 100*r.share(slow.name))
		if r.total != n || len(r.errors) > 0 {
			t.Fatalf("%s: %d of %d requests failed: %q", policy, len(r.errors), r.total, r.errors)
		}
		// Even all 8 slots held by the slow backend keep up with the
		// schedule (8 / 40 ms = 200 req/s), so a run far behind it means
		// the machine itself is starved: scheduler stalls of 100 ms and
		// more then dominate every latency sample and shares measure the
		// machine, not the policy.
		if sched := time.Duration(n) * interval; took > sched*3/2 {
			t.Skipf("%s: %d requests took %v against a %v schedule; machine too loaded to compare shares", policy, n, took, sched)
		}
		return r
	}
	ewma := run("ewma")
	if p, ok := report(t).pool(bs...); ok {
		for i, m := range p.Upstreams {
			if m.EstimateMs != nil {
				t.Logf("ewma estimate for %s: %.2f ms", bs[i].name, *m.EstimateMs)
			}
		}
	}
	leastConn := run("least_conn")

	if s := ewma.share(slow.name); s >= 0.10 {
		t.Errorf("ewma sent %.1f%% of requests to the backend 40 ms slower than the others; want < 10%%", 100*s)
	}
	if ewma.share(slow.name) >= leastConn.share(slow.name) {
		t.Errorf("ewma's degraded share %.1f%% is not below least_conn's %.1f%%",
			100*ewma.share(slow.name), 100*leastConn.share(slow.name))
	}
}

// An HTTPS upstream keeps working under ewma: TLS to the backend, the
// transport's Host header for TLS upstreams, and latency observed.
func TestEWMAHTTPSUpstream(t *testing.T) {
	e := newEnv(t)
	b := e.backend("tls", tlsHTTP)
	e.load(fmt.Sprintf(`reverse_proxy https://%s {
	lb_policy ewma
	transport http {
		tls_insecure_skip_verify
	}
}`, b.addr))

	if got := e.mustGet("/tls"); got != "tls" {
		t.Fatalf("answered by %q, want the TLS backend", got)
	}
	r := b.last(t)
	if !r.TLS {
		t.Errorf("backend saw a plaintext request; want TLS")
	}
	// HTTPTransport's RequestHeaderOps sets Host to the upstream for TLS
	// upstreams; it reaches reverse_proxy only through the wrapper.
	if r.Host != b.addr {
		t.Errorf("backend saw Host %q, want the upstream address %q", r.Host, b.addr)
	}
	u, ok := report(t).upstream(b.addr)
	if !ok || u.Samples == 0 {
		t.Errorf("/lbx/upstreams: want samples > 0 for %s, got %+v (listed: %v)", b.addr, u, ok)
	}
}

// An h2c upstream is still spoken to in HTTP/2 under ewma.
func TestEWMAH2CUpstream(t *testing.T) {
	e := newEnv(t)
	b := e.backend("h2c", h2cHTTP)
	e.load(fmt.Sprintf("reverse_proxy h2c://%s {\n\tlb_policy ewma\n}", b.addr))

	e.mustGet("/h2c")
	r := b.last(t)
	if r.ProtoMajor != 2 || r.TLS {
		t.Errorf("backend saw %s (TLS %v); want cleartext HTTP/2", r.Proto, r.TLS)
	}
	if u, ok := report(t).upstream(b.addr); !ok || u.Samples == 0 {
		t.Errorf("/lbx/upstreams: want samples > 0 for %s, got %+v", b.addr, u)
	}
}

// Transport and handler options behave the same with and without ewma.
func TestEWMATransportOptionsUnchanged(t *testing.T) {
	t.Run("versions", func(t *testing.T) {
		e := newEnv(t)
		b := e.backend("tls", tlsHTTP)
		cfg := func(policy, versions string) string {
			return fmt.Sprintf(`reverse_proxy https://%s {
	%s
	transport http {
		tls_insecure_skip_verify
		%s
	}
}`, b.addr, policy, versions)
		}
		for _, c := range []struct {
			policy, versions string
			wantMajor        int
		}{
			{"lb_policy ewma", "versions 1.1", 1},
			{"", "versions 1.1", 1},
			// The backend does speak HTTP/2, so the check can tell.
			{"lb_policy ewma", "", 2},
		} {
			e.load(cfg(c.policy, c.versions))
			e.mustGet("/v")
			if r := b.last(t); r.ProtoMajor != c.wantMajor {
				t.Errorf("%q %q: backend saw %s, want HTTP/%d", c.policy, c.versions, r.Proto, c.wantMajor)
			}
		}
	})

	t.Run("proxy_protocol", func(t *testing.T) {
		e := newEnv(t)
		b := e.backend("pp", proxyProto) // rejects connections without a PROXY header
		// Two clients on different loopback addresses, in turn. Each
		// must be announced as itself (Caddy sends the client IP, port
		// 0). reverse_proxy keeps upstream connections apart per client
		// only if the transport reports PROXY protocol as enabled; were
		// that hidden by the wrapper, the second client's request would
		// reuse the first one's connection and header.
		clients := []string{"127.0.0.1", "127.0.0.2", "127.0.0.1"}
		for _, policy := range []string{"", "lb_policy ewma"} {
			e.load(fmt.Sprintf(`reverse_proxy %s {
	%s
	transport http {
		proxy_protocol v2
	}
}`, b.addr, policy))
			for i, ip := range clients {
				c := clientFrom(t, ip)
				status, name, body, err := doGet(c, e.url("/pp"))
				c.CloseIdleConnections()
				if err != nil || status != http.StatusOK || name != "pp" {
					t.Fatalf("%q client %s: status %d from %q, body %q, err %v", policy, ip, status, name, body, err)
				}
				got := b.last(t).RemoteAddr
				if host, _, err := net.SplitHostPort(got); err != nil || host != ip {
					t.Errorf("%q request %d from %s: backend saw client address %q", policy, i, ip, got)
				}
			}
		}
	})

	t.Run("buffers", func(t *testing.T) {
		e := newEnv(t)
		b := e.backend("buf", plainHTTP)
		// The client speaks h2c to Caddy, so a body of unknown length
		// carries no Transfer-Encoding that would outlive buffering:
		// Caddy forwards a fully buffered body with its length, and an
		// unbuffered one chunked.
		p := new(http.Protocols)
		p.SetUnencryptedHTTP2(true)
		tr := &http.Transport{Protocols: p}
		defer tr.CloseIdleConnections()
		h2c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
		post := func(n int) seenRequest {
			t.Helper()
			body := payload(n)
			// A reader of unknown length, which the client can produce
			// again: a request that meets the GOAWAY of a server being
			// replaced by a reload is retried, as any client should.
			unknownLength := func() (io.ReadCloser, error) {
				return io.NopCloser(io.MultiReader(bytes.NewReader(body))), nil
			}
			req, err := http.NewRequest(http.MethodPost, e.url("/up"), nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "application/octet-stream")
			req.Body, _ = unknownLength()
			req.GetBody = unknownLength
			res, err := h2c.Do(req)
			if err != nil {
				t.Fatalf("POST %d bytes: %v", n, err)
			}
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusOK || res.ProtoMajor != 2 {
				t.Fatalf("POST %d bytes: status %d over %s; want 200 over HTTP/2", n, res.StatusCode, res.Proto)
			}
			r := b.last(t)
			if !bytes.Equal(r.Body, body) {
				t.Errorf("POST %d bytes: backend received %d bytes, not the body sent", n, len(r.Body))
			}
			return r
		}
		for _, policy := range []string{"lb_policy ewma", ""} {
			e.load(fmt.Sprintf(`reverse_proxy %s {
	%s
	request_buffers 4k
	response_buffers 4k
}`, b.addr, policy))
			// Each check on a connection of the new config: one kept from
			// the old config may still be served by it until its GOAWAY.
			tr.CloseIdleConnections()
			// Fits the buffer: forwarded with its length.
			if r := post(3000); r.ContentLength != 3000 || r.Chunked {
				t.Errorf("%q: buffered 3000-byte body arrived with Content-Length %d (chunked %v), want 3000",
					policy, r.ContentLength, r.Chunked)
			}
			// Larger than the buffer: the rest is streamed, intact.
			post(10000)
			// Response larger than the buffer, intact.
			status, _, body, err := e.get("/down?size=10000")
			if err != nil || status != http.StatusOK || !bytes.Equal(body, payload(10000)) {
				t.Errorf("%q: 10000-byte response: status %d, %d bytes, err %v", policy, status, len(body), err)
			}
		}
		// Without buffering the same body is forwarded chunked, so the
		// check above can tell buffering from no buffering.
		e.load(fmt.Sprintf("reverse_proxy %s {\n\tlb_policy ewma\n}", b.addr))
		tr.CloseIdleConnections()
		if r := post(3000); r.ContentLength != -1 {
			t.Errorf("unbuffered body of unknown length arrived with Content-Length %d, want -1 (chunked)", r.ContentLength)
		}
	})

	t.Run("header_up", func(t *testing.T) {
		e := newEnv(t)
		b := e.backend("hdr", plainHTTP)
		e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma
	header_up X-Lbx-Test hello
	header_up Host {upstream_hostport}
}`, b.addr))
		e.mustGet("/h")
		r := b.last(t)
		if got := r.Header.Get("X-Lbx-Test"); got != "hello" {
			t.Errorf("X-Lbx-Test = %q, want hello", got)
		}
		if r.Host != b.addr {
			t.Errorf("Host = %q, want %q", r.Host, b.addr)
		}
	})
}

// clientFrom returns an HTTP client whose connections come from the
// loopback address ip.
func clientFrom(t *testing.T, ip string) *http.Client {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext}, Timeout: 10 * time.Second}
}

// Active health checks go through the observed transport but are not
// client traffic: they must not feed latency statistics.
func TestEWMAHealthChecksNotCounted(t *testing.T) {
	e := newEnv(t)
	b := e.backend("hc", plainHTTP)
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma
	health_uri /health
	health_interval 50ms
}`, b.addr))

	samples := func() uint64 {
		u, _ := report(t).upstream(b.addr) // not listed: no samples
		return u.Samples
	}
	waitHealth := func(n int64) {
		t.Helper()
		target := b.healthHits.Load() + n
		waitFor(t, 10*time.Second, "active health checks", func() (bool, string) {
			h := b.healthHits.Load()
			return h >= target, fmt.Sprintf("%d health requests", h)
		})
	}
	waitHealth(5)
	if b.hits.Load() != 0 {
		t.Fatalf("backend saw %d non-health requests; the test sent none", b.hits.Load())
	}
	if s := samples(); s != 0 {
		t.Fatalf("after %d health checks and no client traffic, samples = %d; want 0", b.healthHits.Load(), s)
	}

	// One client request is one sample: the statistics are live, so the
	// zero above is not vacuous.
	e.mustGet("/one")
	if s := samples(); s != 1 {
		t.Fatalf("after one client request, samples = %d; want 1", s)
	}
	waitHealth(5)
	if s := samples(); s != 1 {
		t.Fatalf("health checks after the client request changed samples to %d; want 1", s)
	}
}

// A client that gives up is not the upstream's fault; an upstream that
// refuses connections is.
func TestEWMACancelIsNotFailureRefusedIs(t *testing.T) {
	e := newEnv(t)
	slow := e.backend("slow", plainHTTP)
	slow.delay.Store(int64(10 * time.Second))
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t)) // closed: connections are refused

	e.load(fmt.Sprintf(`handle /slow* {
	reverse_proxy %s {
		lb_policy ewma
	}
}
handle /dead* {
	reverse_proxy %s {
		lb_policy ewma
		lb_retries 0
	}
}`, slow.addr, dead))

	// Cancel once the backend is working on the request.
	ctx, stop := cancelAfter(func() bool { return slow.active.Load() > 0 })
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.url("/slow"), nil)
	start := time.Now()
	res, err := e.client.Do(req)
	stop()
	if err == nil {
		res.Body.Close()
		t.Fatalf("request to the slow backend was answered (%d); want it cancelled", res.StatusCode)
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("slow request: %v; want context.Canceled", err)
	}
	// Wait until Caddy has finished the abandoned attempt (the backend
	// saw the cancellation and nothing is pending).
	waitFor(t, 10*time.Second, "the abandoned attempt to finish", func() (bool, string) {
		u, ok := report(t).upstream(slow.addr)
		done := ok && slow.cancelled.Load() == 1 && u.Pending == 0 && u.InFlight == 0
		return done, fmt.Sprintf("listed %v, %+v, backend cancelled %d", ok, u, slow.cancelled.Load())
	})
	u, _ := report(t).upstream(slow.addr)
	t.Logf("cancelled after %v: %+v", time.Since(start).Round(time.Millisecond), u)
	if u.Failures != 0 {
		t.Errorf("client cancellation counted as %d upstream failure(s); want 0", u.Failures)
	}

	status, _, body, err := e.get("/dead")
	if err != nil || status != http.StatusBadGateway {
		t.Fatalf("request to a refusing upstream: status %d, body %q, err %v; want 502", status, strings.TrimSpace(string(body)), err)
	}
	d, ok := report(t).upstream(dead)
	if !ok || d.Failures != 1 {
		t.Errorf("refused connection: want failures = 1 for %s, got %+v (listed: %v)", dead, d, ok)
	}
}
