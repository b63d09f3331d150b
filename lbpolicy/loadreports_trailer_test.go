package lbpolicy

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// binReport is the Endpoint-Load-Metrics-Bin value of a report holding
// cpu_utilization only, unpadded as gRPC writes it.
func binReport(cpu float64) string {
	msg := binary.LittleEndian.AppendUint64([]byte{1<<3 | 1}, math.Float64bits(cpu))
	return base64.RawStdEncoding.EncodeToString(msg)
}

// trailing answers with a body of "payload" whose trailers, like those
// of net/http's transports, are filled in just before the body returns
// io.EOF.
type trailing struct {
	header  http.Header
	trailer http.Header // what arrives at the end
	announc []string    // trailer keys announced up front
	status  int
}

func (tr trailing) RoundTrip(*http.Request) (*http.Response, error) {
	resp := &http.Response{StatusCode: tr.status, Header: tr.header.Clone()}
	if resp.StatusCode == 0 {
		resp.StatusCode = 200
	}
	if tr.announc != nil {
		resp.Trailer = http.Header{}
		for _, k := range tr.announc {
			resp.Trailer[k] = nil
		}
	}
	resp.Body = &trailerFiller{r: strings.NewReader("payload"), resp: resp, trailer: tr.trailer}
	return resp, nil
}

type trailerFiller struct {
	r       io.Reader
	resp    *http.Response
	trailer http.Header
	filled  bool
}

func (f *trailerFiller) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if err == io.EOF && !f.filled {
		f.filled = true
		if f.resp.Trailer == nil {
			f.resp.Trailer = http.Header{}
		}
		for k, v := range f.trailer {
			f.resp.Trailer[k] = v
		}
	}
	return n, err
}

func (f *trailerFiller) Close() error { return nil }

func grpcHeader() http.Header { return http.Header{"Content-Type": {"application/grpc"}} }

func TestTransportTakesTrailerLoadReports(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	strip := loadReportsOrDefault(nil)
	fwd := &LoadReports{MaxAge: strip.MaxAge, ForwardHeader: true}
	n := 0
	// roundTrip sends one request to a fresh upstream and returns its
	// stats and the response, whose body is not read yet.
	roundTrip := func(inner http.RoundTripper, l *LoadReports) (*hoststate.Stats, *http.Response) {
		t.Helper()
		n++
		u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":" + strconv.Itoa(8000+n)}
		ot := &observingTransport{inner: inner, table: table, reports: l}
		resp, err := ot.RoundTrip(request(context.Background(), u, false))
		if err != nil {
			t.Fatal(err)
		}
		return table.Stats(u.Dial), resp
	}
	readAll := func(resp *http.Response) {
		t.Helper()
		b, err := io.ReadAll(resp.Body)
		if err != nil || string(b) != "payload" {
			t.Fatalf("body %q, %v", b, err)
		}
		// a second read at the end changes nothing
		if n, err := resp.Body.Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Fatalf("read after the end: %d, %v", n, err)
		}
		if err := resp.Body.Close(); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("grpc trailer", func(t *testing.T) {
		st, resp := roundTrip(trailing{header: grpcHeader(), trailer: http.Header{loadReportBinHeader: {binReport(0.42)}, "Grpc-Status": {"0"}}}, strip)
		if st.LoadReport() != nil {
			t.Fatal("a report before the trailers came")
		}
		readAll(resp)
		if r := st.LoadReport(); r == nil || r.CPU != 0.42 {
			t.Fatalf("report = %+v", r)
		}
		if _, ok := resp.Trailer[loadReportBinHeader]; ok || resp.Trailer.Get("Grpc-Status") != "0" {
			t.Fatalf("trailers passed on: %v", resp.Trailer)
		}
	})
	t.Run("grpc trailer forwarded", func(t *testing.T) {
		st, resp := roundTrip(trailing{header: http.Header{"Content-Type": {"application/grpc+proto"}}, trailer: http.Header{loadReportBinHeader: {binReport(0.5)}}}, fwd)
		readAll(resp)
		if r := st.LoadReport(); r == nil || r.CPU != 0.5 || resp.Trailer.Get(loadReportBinHeader) != binReport(0.5) {
			t.Fatalf("report %+v, trailers %v", r, resp.Trailer)
		}
	})
	t.Run("grpc trailer refused", func(t *testing.T) {
		st, resp := roundTrip(trailing{header: grpcHeader(), trailer: http.Header{loadReportBinHeader: {"!!!"}}}, strip)
		readAll(resp)
		if n, kind := st.LoadReportsRefused(); n != 1 || kind == nil || st.LoadReport() != nil {
			t.Fatalf("refused %d (%v), report %+v", n, kind, st.LoadReport())
		}
		if _, ok := resp.Trailer[loadReportBinHeader]; ok {
			t.Fatal("a refused report's trailer passed on")
		}
	})
	t.Run("grpc trailers only", func(t *testing.T) {
		// a call that ends without a message: gRPC sends its trailers
		// as the response's only headers, and there is no body
		h := grpcHeader()
		h[loadReportBinHeader] = []string{binReport(0.3)}
		st, resp := roundTrip(roundTripFunc(func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 200, Header: h, Body: http.NoBody}, nil
		}), strip)
		if r := st.LoadReport(); r == nil || r.CPU != 0.3 {
			t.Fatalf("report = %+v", r)
		}
		if _, ok := resp.Header[loadReportBinHeader]; ok || resp.Body != http.NoBody {
			t.Fatalf("header passed on (%v) or body wrapped (%T)", resp.Header, resp.Body)
		}
	})
	t.Run("text header wins", func(t *testing.T) {
		h := http.Header{loadReportHeader: {"TEXT cpu_utilization=0.1"}, loadReportBinHeader: {binReport(0.9)}}
		st, resp := roundTrip(roundTripFunc(func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 200, Header: h, Body: http.NoBody}, nil
		}), strip)
		if r := st.LoadReport(); r == nil || r.CPU != 0.1 || len(resp.Header) != 0 {
			t.Fatalf("report %+v, headers %v", r, resp.Header)
		}
	})
	t.Run("announced trailer", func(t *testing.T) {
		for _, l := range []*LoadReports{strip, fwd} {
			tr := trailing{header: http.Header{}, announc: []string{loadReportHeader, "X-Other"},
				trailer: http.Header{loadReportHeader: {"TEXT cpu_utilization=0.7"}, "X-Other": {"1"}}}
			st, resp := roundTrip(tr, l)
			if _, ok := resp.Trailer[loadReportHeader]; ok != l.ForwardHeader {
				t.Fatalf("forward_header %v: announcement kept %v", l.ForwardHeader, ok)
			}
			if _, ok := resp.Trailer["X-Other"]; !ok {
				t.Fatal("another trailer's announcement removed")
			}
			readAll(resp)
			if r := st.LoadReport(); r == nil || r.CPU != 0.7 {
				t.Fatalf("report = %+v", r)
			}
			if _, ok := resp.Trailer[loadReportHeader]; ok != l.ForwardHeader || resp.Trailer.Get("X-Other") != "1" {
				t.Fatalf("forward_header %v: trailers %v", l.ForwardHeader, resp.Trailer)
			}
		}
	})
	t.Run("not watched", func(t *testing.T) {
		for name, tr := range map[string]trailing{
			"plain":        {header: http.Header{"Content-Type": {"text/plain"}}},
			"grpc-web":     {header: http.Header{"Content-Type": {"application/grpc-web"}}},
			"101 and grpc": {header: grpcHeader(), status: http.StatusSwitchingProtocols},
		} {
			tr.trailer = http.Header{loadReportBinHeader: {binReport(0.2)}}
			st, resp := roundTrip(tr, strip)
			if _, ok := resp.Body.(*trailerFiller); !ok {
				t.Fatalf("%s: body wrapped in %T", name, resp.Body)
			}
			_, _ = io.ReadAll(resp.Body)
			if st.LoadReport() != nil {
				t.Fatalf("%s: an unannounced trailer of a response that is not gRPC read", name)
			}
		}
	})
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A response without a report, in its headers or announced in its
// trailers, costs no allocation.
func TestTakeLoadReportsNoReportNoAlloc(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	s := table.Stats(t.Name() + ":80")
	l := loadReportsOrDefault(nil)
	body := io.NopCloser(strings.NewReader(""))
	resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/html"}, "Content-Length": {"0"}},
		Trailer: http.Header{"X-Checksum": nil}, Body: body}
	if a := testing.AllocsPerRun(100, func() { takeLoadReports(s, resp, l) }); a != 0 {
		t.Fatalf("%v allocations per response", a)
	}
	if resp.Body != body {
		t.Fatal("body wrapped")
	}
}

// Over real connections, HTTP/1.1 (chunked) and HTTP/2, net/http's
// transport fills in the trailers before the body's io.EOF, whether
// they were announced or not, so the report is read there; and a
// removed announcement does not keep the trailer from being filled in.
func TestTrailerLoadReportOverRealConnections(t *testing.T) {
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("grpc") != "" {
			// gRPC's way: unannounced
			w.Header().Set("Content-Type", "application/grpc")
			_, _ = io.WriteString(w, "payload")
			w.(http.Flusher).Flush()
			w.Header().Set(http.TrailerPrefix+loadReportBinHeader, binReport(0.25))
			return
		}
		w.Header().Set("Trailer", loadReportBinHeader)
		_, _ = io.WriteString(w, "payload")
		w.(http.Flusher).Flush()
		w.Header().Set(loadReportBinHeader, binReport(0.75))
	})
	for _, proto := range []string{"HTTP/1.1", "HTTP/2.0"} {
		srv := httptest.NewUnstartedServer(handler)
		srv.EnableHTTP2 = proto == "HTTP/2.0"
		srv.StartTLS()
		t.Cleanup(srv.Close)
		inner := srv.Client().Transport
		for _, tc := range []struct {
			query string
			cpu   float64
		}{{"", 0.75}, {"?grpc=1", 0.25}} {
			u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: srv.Listener.Addr().String()}
			ot := &observingTransport{inner: inner, table: table, reports: loadReportsOrDefault(nil)}
			req := request(context.Background(), u, false)
			req.URL.Scheme = "https"
			req.URL.RawQuery = strings.TrimPrefix(tc.query, "?")
			resp, err := ot.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.Proto != proto {
				t.Fatalf("%s: the response came over %s", proto, resp.Proto)
			}
			if _, ok := resp.Trailer[loadReportBinHeader]; ok {
				t.Fatalf("%s%s: announcement kept", proto, tc.query)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(b) != "payload" {
				t.Fatalf("%s%s: body %q, %v", proto, tc.query, b, err)
			}
			if r := table.Stats(u.Dial).LoadReport(); r == nil || r.CPU != tc.cpu {
				t.Fatalf("%s%s: report %+v, want cpu %v", proto, tc.query, r, tc.cpu)
			}
			if _, ok := resp.Trailer[loadReportBinHeader]; ok {
				t.Fatalf("%s%s: trailer passed on: %v", proto, tc.query, resp.Trailer)
			}
		}
	}
}
