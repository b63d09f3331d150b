package lbpolicy

import (
	"errors"
	"fmt"
	"net/http"
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
// BIN forms), with their own account of their load. Every response to
// real traffic that carries the header has it parsed, within the bounds
// of lbx's ORCA parser, and the latest good report of each upstream is
// kept and shown in the admin API, the metrics and the status page.
// Health-check responses are not read. A report that does not parse is
// counted and leaves the last good one in place.
//
// Reports are read, and the header is removed from the response before
// it reaches the client, also when this block is absent: the defaults
// below apply. least_time uses fresh reports in selection: an upstream
// that reports more load than the mean of its pool's reporting members
// is considered in fewer selections, down to a twentieth of them (see
// hoststate.ReportedShare); one that sends none is judged as before.
type LoadReports struct {
	// How long a report counts: its pull on selection fades from full
	// when it arrives to none at this age, after which it is still shown,
	// flagged stale. From 1s to 1h. Default: 3s.
	MaxAge caddy.Duration `json:"max_age,omitempty"`

	// Keep the Endpoint-Load-Metrics header in the response passed on to
	// the client. Default: false (the header is removed, since it tells
	// clients about the backends' load).
	ForwardHeader bool `json:"forward_header,omitempty"`
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *LoadReports) UnmarshalJSON(b []byte) error {
	type plain LoadReports
	return jsonfield.Decode(b, (*plain)(x))
}

// loadReportHeader is the response header ORCA reports come in, in its
// canonical form, so that it is looked up without canonicalising.
const loadReportHeader = "Endpoint-Load-Metrics"

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
	return l
}

// validate checks the configuration.
func (l *LoadReports) validate() error {
	if l.MaxAge != 0 {
		if err := checkLoadReportMaxAge(time.Duration(l.MaxAge)); err != nil {
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
		default:
			return caddyopt.Unknown(d, what, "max_age", "forward_header")
		}
		return nil
	})
}

// takeLoadReport reads the load report resp carries, if any, into s, and
// removes the header unless the configuration forwards it. It is called
// for responses to real traffic only: a health check's report would be
// of a request the backend treats differently, and keeping probes out of
// the traffic statistics is the rule throughout.
//
// Only the first header value is read: ORCA sends one, and a backend
// that sends several gets the first one judged, not the one it prefers.
func takeLoadReport(s *hoststate.Stats, resp *http.Response, l *LoadReports) {
	vals := resp.Header[loadReportHeader]
	if len(vals) == 0 {
		return
	}
	if r, err := orca.Parse(vals[0]); err != nil {
		s.RefuseLoadReport(err)
	} else {
		s.SetLoadReport(r, monoclock.Now(), time.Duration(l.MaxAge))
	}
	if !l.ForwardHeader {
		delete(resp.Header, loadReportHeader)
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
