package lbpolicy

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/orca"
)

// LoadReports configures how ORCA load reports are taken in: the
// Endpoint-Load-Metrics header that backends add to their responses
// (`TEXT cpu_utilization=0.3, rps_fractional=120, ...`, or the JSON and
// BIN forms), with their own account of their load, or gRPC's form, the
// binary metadata Endpoint-Load-Metrics-Bin that gRPC servers send in
// the trailers of a call (or in its headers, when the call ends without
// a message). Every response to real traffic that carries a report has
// it parsed, within the bounds of lbx's ORCA parser, and the latest good
// report of each upstream is kept and shown in the admin API, the
// metrics and the status page. Health-check responses are not read. A
// report that does not parse is counted and leaves the last good one in
// place.
//
// Reports are read, and their headers and trailers are removed from the
// response before it reaches the client, also when this block is
// absent: the defaults below apply. least_time uses fresh reports in
// selection: a report that says an upstream is past its capacity
// (utilization above 1) multiplies the latency expected of it by that
// load, up to 32 (see hoststate.Stats.ReportedFactor); below capacity, or
// without reports, an upstream is judged as before.
type LoadReports struct {
	// How long a report counts: its pull on selection fades from full
	// when it arrives to none at this age, after which it is still shown,
	// flagged stale. From 1s to 1h. Default: 3s.
	MaxAge caddy.Duration `json:"max_age,omitempty"`

	// Keep the Endpoint-Load-Metrics and Endpoint-Load-Metrics-Bin
	// headers and trailers in the response passed on to the client.
	// Default: false (they are removed, since they tell clients about
	// the backends' load).
	ForwardHeader bool `json:"forward_header,omitempty"`

	// Load probes: requests the policy sends to upstreams for their
	// report alone, so that reports stay fresh where traffic is sparse
	// (see LoadProbe). Only least_time takes them. Off when absent.
	Probe *LoadProbe `json:"probe,omitempty"`
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *LoadReports) UnmarshalJSON(b []byte) error {
	type plain LoadReports
	return jsonfield.Decode(b, (*plain)(x))
}

// The response headers (and trailers) ORCA reports come in, in their
// canonical form, so that they are looked up without canonicalising:
// the HTTP form, and gRPC's binary metadata (the base64 of the message).
const (
	loadReportHeader    = "Endpoint-Load-Metrics"
	loadReportBinHeader = "Endpoint-Load-Metrics-Bin"
)

// Bounds of max_age: below a second a report ages out between two
// responses of a lightly used backend; beyond an hour it describes a
// load long gone. The default is a few of least_time's default decay: a
// backend a report priced out draws only a trickle, so its next report
// may be seconds away, and an old one must let go of it by then.
const (
	defaultLoadReportMaxAge = 3 * time.Second
	minLoadReportMaxAge     = time.Second
	maxLoadReportMaxAge     = time.Hour
)

// loadReportsOrDefault returns l with its defaults written in, or the
// defaults when l is nil: reading reports is the no-options behaviour.
func loadReportsOrDefault(l *LoadReports) *LoadReports {
	if l == nil {
		l = new(LoadReports)
	}
	if l.MaxAge == 0 {
		l.MaxAge = caddy.Duration(defaultLoadReportMaxAge)
	}
	if l.Probe != nil {
		l.Probe.provision()
	}
	return l
}

// validate checks the configuration.
func (l *LoadReports) validate() error {
	if l.MaxAge != 0 {
		if err := checkLoadReportMaxAge(time.Duration(l.MaxAge)); err != nil {
			return fmt.Errorf("load_reports: %v", err)
		}
	}
	if l.Probe != nil {
		if err := l.Probe.validate(); err != nil {
			return fmt.Errorf("load_reports: %v", err)
		}
	}
	return nil
}

// checkLoadReportMaxAge is the rule for max_age, shared with the
// Caddyfile parser.
func checkLoadReportMaxAge(d time.Duration) error {
	return bounds.Duration("max_age", d, minLoadReportMaxAge, maxLoadReportMaxAge)
}

// unmarshalCaddyfile reads a load_reports block, the dispenser on its
// name; errors start with what (the policy's block, "lb_policy
// least_time"):
//
//	load_reports {
//		max_age        <duration>
//		forward_header
//		probe <path> [{
//			per_request <ratio>
//			max_rate    <n>[/s]
//			timeout     <duration>
//		}]
//	}
func (l *LoadReports) unmarshalCaddyfile(d *caddyfile.Dispenser, what string) error {
	what += ": load_reports"
	return caddyopt.Options(d, what, func(opt string) error {
		switch opt {
		case "max_age":
			dur, err := caddyopt.Duration(d, what)
			if err != nil {
				return err
			}
			if err := caddyopt.Checked(d, what, checkLoadReportMaxAge(dur)); err != nil {
				return err
			}
			l.MaxAge = caddy.Duration(dur)
		case "forward_header":
			if err := caddyopt.NoArgs(d, what); err != nil {
				return err
			}
			l.ForwardHeader = true
		case "probe":
			l.Probe = new(LoadProbe)
			if err := l.Probe.unmarshalCaddyfile(d, what); err != nil {
				return err
			}
		default:
			return caddyopt.Unknown(d, what, "max_age", "forward_header", "probe")
		}
		return nil
	})
}

// takeLoadReports reads the load reports resp carries into s: the one in
// its headers now, and the one in its trailers when the body has been
// read to its end. It removes both unless the configuration forwards
// them. It is called for responses to real traffic only: a health
// check's report would be of a request the backend treats differently,
// and keeping probes out of the traffic statistics is the rule
// throughout.
//
// The body is wrapped only when a trailer report may come: when the
// response announces one in its Trailer header, or is gRPC, whose
// servers send trailers unannounced. Other responses cost two map
// lookups and no allocation.
func takeLoadReports(s *hoststate.Stats, resp *http.Response, l *LoadReports) {
	takeLoadReport(s, resp.Header, l)
	if !trailerReportExpected(resp) {
		return
	}
	if !l.ForwardHeader {
		// Unannounced, so that the client is not told of a trailer it
		// will not get; the transport fills in the trailers it receives
		// whether they were announced or not.
		delete(resp.Trailer, loadReportHeader)
		delete(resp.Trailer, loadReportBinHeader)
	}
	resp.Body = &trailerReportBody{ReadCloser: resp.Body, resp: resp, stats: s, reports: l}
}

// trailerReportExpected reports whether resp's trailers may carry a load
// report that its body must be watched for.
func trailerReportExpected(resp *http.Response) bool {
	if resp.Body == nil || resp.Body == http.NoBody || resp.StatusCode == http.StatusSwitchingProtocols {
		// no trailers to come, or a body reverse_proxy uses as a
		// connection, which a wrapper would hide
		return false
	}
	if _, ok := resp.Trailer[loadReportHeader]; ok {
		return true
	}
	if _, ok := resp.Trailer[loadReportBinHeader]; ok {
		return true
	}
	return isGRPC(resp.Header)
}

// isGRPC reports whether a response is gRPC over HTTP/2: Content-Type
// application/grpc, alone or followed by "+format" or parameters
// (application/grpc-web, which carries its trailers in the body, is
// not).
func isGRPC(h http.Header) bool {
	ct := h["Content-Type"]
	if len(ct) == 0 {
		return false
	}
	rest, ok := strings.CutPrefix(ct[0], "application/grpc")
	return ok && (rest == "" || rest[0] == '+' || rest[0] == ';')
}

// trailerReportBody is a response body that, on reaching its end, reads
// the load report in the response's trailers. The transport fills in the
// trailers before the body returns io.EOF, and reverse_proxy copies them
// to the client only after the body returned it, so the report is read
// and removed in between, on reverse_proxy's goroutine, without waiting
// for anything.
type trailerReportBody struct {
	io.ReadCloser
	resp    *http.Response
	stats   *hoststate.Stats
	reports *LoadReports
	done    bool
}

// Read implements io.Reader.
func (b *trailerReportBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && !b.done {
		b.done = true
		takeLoadReport(b.stats, b.resp.Trailer, b.reports)
	}
	return n, err
}

// takeLoadReport reads the load report in h, a response's headers or
// trailers, if any, into s, and removes it from h unless the
// configuration forwards it. The HTTP form is read when present, else
// gRPC's binary form; both are removed.
//
// Only the first value is read: ORCA sends one, and a backend that sends
// several gets the first one judged, not the one it prefers.
func takeLoadReport(s *hoststate.Stats, h http.Header, l *LoadReports) {
	var r orca.Report
	var err error
	if v := h[loadReportHeader]; len(v) > 0 {
		r, err = orca.Parse(v[0])
	} else if v := h[loadReportBinHeader]; len(v) > 0 {
		r, err = orca.ParseBinary(v[0])
	} else {
		return
	}
	if err != nil {
		s.RefuseLoadReport(err)
	} else {
		s.SetLoadReport(r, monoclock.Now(), time.Duration(l.MaxAge))
	}
	if !l.ForwardHeader {
		delete(h, loadReportHeader)
		delete(h, loadReportBinHeader)
	}
}

// loadReportViewOf returns the admin API's view of r at now.
func loadReportViewOf(r *hoststate.LoadReport, now int64) *loadReportView {
	field := func(f orca.Field, v float64) *float64 {
		if !r.Has(f) {
			return nil
		}
		return &v
	}
	v := &loadReportView{
		CPU:         field(orca.CPU, r.CPU),
		Application: field(orca.Application, r.Application),
		Mem:         field(orca.Mem, r.Mem),
		RPS:         field(orca.RPS, r.RPS),
		EPS:         field(orca.EPS, r.EPS),
		Named:       r.Named, // immutable, and at most orca.MaxMetrics
		AgeMs:       float64(r.Age(now)) / 1e6,
		MaxAgeMs:    float64(r.MaxAge) / 1e6,
		Stale:       r.Stale(now),
	}
	if u, ok := r.Utilization(); ok {
		v.Utilization = &u
	}
	return v
}

// loadReportErrorKinds names the kinds of fault orca.Parse reports, for
// the admin API: short, stable words rather than the messages.
var loadReportErrorKinds = []struct {
	kind error
	name string
}{
	{orca.ErrTooLong, "too_long"},
	{orca.ErrFormat, "format"},
	{orca.ErrSyntax, "syntax"},
	{orca.ErrValue, "value"},
	{orca.ErrName, "name"},
	{orca.ErrDuplicate, "duplicate"},
	{orca.ErrTooMany, "too_many"},
}

// loadReportErrorKind returns the name of a refused report's kind of
// fault: too_long, format, syntax, value, name, duplicate or too_many
// ("other" for an error the parser does not classify).
func loadReportErrorKind(err error) string {
	for _, k := range loadReportErrorKinds {
		if errors.Is(err, k.kind) {
			return k.name
		}
	}
	return "other"
}
