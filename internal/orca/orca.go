// Package orca parses ORCA (Open Request Cost Aggregation) load reports
// as a proxy receives them in-band, in the endpoint-load-metrics response
// header: a backend's own account of its load (CPU, memory and
// application utilization, requests and errors per second, and named
// metrics), the message xds.data.orca.v3.OrcaLoadReport that Envoy's and
// gRPC's client-side weighted round robin weigh endpoints by.
//
// Three forms of the header value are read, told apart by their prefix:
//
//	TEXT cpu_utilization=0.3, rps_fractional=120, named_metrics.queue=4
//	JSON {"cpu_utilization": 0.3, "rpsFractional": 120, "named_metrics": {"queue": 4}}
//	BIN CAES...  (base64 of the serialized protobuf message)
//
// TEXT is a comma-separated list of key=value pairs (Envoy's parser
// separates them with ':' instead, which is accepted too), where the map
// fields appear flattened as "named_metrics.<name>", "utilization.<name>"
// and "request_cost.<name>". JSON is the message's protobuf JSON mapping:
// field names in snake_case or lowerCamelCase, numbers as JSON numbers or
// numeric strings. BIN is the serialized message in standard base64,
// padded or not.
//
// gRPC sends the same message in binary metadata instead, the header or
// (for gRPC's per-call reports, always) trailer endpoint-load-metrics-bin,
// whose value is the base64 alone, without a prefix; ParseBinary reads
// that value, with the same bounds.
//
// Reports come from backends and are untrusted. Parse reads at most
// MaxHeaderBytes, at most MaxKeys keys and MaxMetrics map entries, checks
// every metric name against the name rule (see ErrName) and every value
// against its field's range, and refuses the whole report on the first
// fault: a report is used whole or not at all, so that a half-read
// report never passes for a complete one. Errors never quote more than
// about 64 bytes of the input.
package orca

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Bounds on a report. Each is checked as the report is read, before the
// work or memory it bounds is spent.
const (
	// MaxHeaderBytes is the longest header value read, 8 KiB: a report
	// of every standard field and 64 named metrics fits in well under
	// 4 KiB, and a longer value is refused before any of it is parsed,
	// so that a backend cannot make the proxy work in proportion to
	// what it sends.
	MaxHeaderBytes = 8 << 10

	// MaxMetrics is the most entries a report may hold in its maps
	// (named_metrics, utilization and request_cost together). A report
	// with more is refused rather than cut short, because which entries
	// a cut would keep depends on the order the backend wrote them in.
	MaxMetrics = 64

	// MaxKeys is the most keys a report may carry in all, counting the
	// standard fields, map entries and keys this package does not know
	// (which are skipped, for forward compatibility, but still cost
	// work). In BIN it counts the fields on the wire.
	MaxKeys = 128

	// MaxNameBytes is the longest metric name, in bytes: names end up
	// in logs, admin views and metric labels.
	MaxNameBytes = 128

	// MaxUtilization caps cpu_utilization and application_utilization.
	// The message lets both exceed 1 when a backend is above its own
	// soft limit, and neither Envoy nor gRPC caps them; 100 times a
	// soft limit is beyond any real backend and keeps arithmetic on the
	// value tame.
	MaxUtilization = 100

	// MaxFraction caps mem_utilization and the utilization map's
	// values, which the message defines as fractions in [0, 1] and
	// gRPC's recorder also keeps there.
	MaxFraction = 1

	// MaxRate caps rps_fractional and eps, in requests per second.
	MaxRate = 1e9

	// MaxValue caps named_metrics and request_cost values, whose units
	// the application chooses: large enough for bytes or counts, small
	// enough that sums of them stay finite.
	MaxValue = 1e15

	// maxQuote is how much of the input an error quotes at most.
	maxQuote = 64
)

// Field names one of a report's scalar fields, for Report.Has.
type Field uint8

// The scalar fields of a report.
const (
	// CPU is cpu_utilization.
	CPU Field = 1 << iota
	// Mem is mem_utilization.
	Mem
	// Application is application_utilization.
	Application
	// RPS is rps_fractional.
	RPS
	// EPS is eps.
	EPS
)

// Report is one parsed load report. A scalar field reads 0 both when the
// backend sent 0 and when it sent nothing; Has tells the two apart.
// The maps are nil when the report has no entries for them; their keys
// may share memory with the header value that was parsed.
type Report struct {
	// CPU is cpu_utilization: the fraction of the backend's CPU in
	// use, which may exceed 1 (at most MaxUtilization).
	CPU float64
	// Mem is mem_utilization: the fraction of its memory in use.
	Mem float64
	// Application is application_utilization: a utilization of the
	// backend's own choosing, such as the larger of CPU and memory;
	// it may exceed 1 (at most MaxUtilization).
	Application float64
	// RPS is rps_fractional: the requests per second the backend
	// serves, from all its clients.
	RPS float64
	// EPS is eps: the errors per second it serves.
	EPS float64

	// Named is named_metrics: opaque application metrics.
	Named map[string]float64
	// Utilizations is the utilization map: named resources' use as a
	// fraction of what is available.
	Utilizations map[string]float64
	// RequestCost is request_cost: what this one request cost, per
	// named resource.
	RequestCost map[string]float64

	// set holds the scalar fields present.
	set Field
}

// Has reports whether the report carried all the fields in f.
func (r Report) Has(f Field) bool { return r.set&f == f }

// Utilization returns the backend's utilization as Envoy's and gRPC's
// client-side weighted round robin read it: application_utilization when
// it is above 0, else cpu_utilization. ok is false when the report has
// neither. Unlike those policies, a cpu_utilization of 0 is returned
// (with ok true) rather than treated as no report: they divide by the
// utilization, a cost that adds it need not.
func (r Report) Utilization() (u float64, ok bool) {
	if r.Has(Application) && r.Application > 0 {
		return r.Application, true
	}
	if r.Has(CPU) {
		return r.CPU, true
	}
	return 0, false
}

// Kinds of fault, for errors.Is on what Parse returns.
var (
	// ErrTooLong: the header value is longer than MaxHeaderBytes.
	ErrTooLong = errors.New("load report too long")
	// ErrFormat: the value is empty or starts with none of "TEXT ",
	// "JSON " and "BIN ".
	ErrFormat = errors.New("unknown load report format")
	// ErrSyntax: the value does not read as its form: a TEXT element
	// without a value, invalid JSON, bad base64, a truncated protobuf
	// message or a field of the wrong wire type.
	ErrSyntax = errors.New("malformed load report")
	// ErrValue: a value is not a number, not finite, negative, or
	// above its field's cap.
	ErrValue = errors.New("bad load report value")
	// ErrName: a metric name is empty, longer than MaxNameBytes, or has
	// a byte other than ASCII letters, digits, '_', '.', ':' and '-'.
	ErrName = errors.New("bad load report metric name")
	// ErrDuplicate: a TEXT or JSON report names a field or map entry
	// twice (in JSON, also once in each spelling), which emitters never
	// do and readers would disagree on. BIN follows protobuf, where a
	// repeated field is merged: the last one wins.
	ErrDuplicate = errors.New("duplicate key in load report")
	// ErrTooMany: more than MaxMetrics map entries or MaxKeys keys.
	ErrTooMany = errors.New("too many metrics in load report")
)

// Error is the error Parse returns: the kind of fault, the key it is
// about (quoted, at most about 64 bytes) and what is wrong with it.
type Error struct {
	// Kind is one of the Err* values of this package.
	Kind error
	// Key is the key or field the fault is in, or "" when it is about
	// the whole value.
	Key string
	// Detail says what is wrong, quoting at most about 64 bytes of
	// the input.
	Detail string
}

// Error returns the kind, then the key, then the detail.
func (e *Error) Error() string {
	s := e.Kind.Error()
	if e.Key != "" {
		s += " " + e.Key
	}
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

// Unwrap returns the kind, for errors.Is.
func (e *Error) Unwrap() error { return e.Kind }

// fault builds an *Error, quoting key (clipped).
func fault(kind error, key, detail string) error {
	q := ""
	if key != "" {
		q = quote(key)
	}
	return &Error{Kind: kind, Key: q, Detail: detail}
}

// quote quotes at most maxQuote bytes of s, marking a cut with "...".
func quote(s string) string {
	if len(s) > maxQuote {
		return strconv.Quote(s[:maxQuote]) + "..."
	}
	return strconv.Quote(s)
}

// Parse parses the value of an endpoint-load-metrics header. When a
// response has several such headers, pass the first, as Envoy does.
// Surrounding spaces and tabs are ignored; the prefix is case-sensitive.
func Parse(header string) (Report, error) {
	if err := checkLength(header); err != nil {
		return Report{}, err
	}
	h := strings.TrimLeft(header, " \t")
	switch {
	case strings.HasPrefix(h, "TEXT "):
		return parseText(h[len("TEXT "):])
	case strings.HasPrefix(h, "JSON "):
		return parseJSON(h[len("JSON "):])
	case strings.HasPrefix(h, "BIN "):
		return parseBin(h[len("BIN "):])
	case strings.TrimRight(h, " \t") == "":
		return Report{}, fault(ErrFormat, "", "the value is empty")
	}
	p := h
	if i := strings.IndexAny(p, " \t"); i >= 0 {
		p = p[:i]
	}
	return Report{}, fault(ErrFormat, "", "prefix "+quote(p)+" is not TEXT, JSON or BIN")
}

// ParseBinary parses the value of an endpoint-load-metrics-bin header or
// trailer, gRPC's binary metadata: the serialized message in standard
// base64 without a prefix, padded or not (gRPC writes it unpadded and
// reads both). It reads it as Parse reads a BIN value, within the same
// bounds, and returns the same kinds of error; an empty value is the
// empty message, a report with no fields.
func ParseBinary(value string) (Report, error) {
	if err := checkLength(value); err != nil {
		return Report{}, err
	}
	return parseBin(value)
}

// checkLength refuses a value longer than MaxHeaderBytes before any of
// it is read.
func checkLength(v string) error {
	if len(v) > MaxHeaderBytes {
		return fault(ErrTooLong, "", fmt.Sprintf("%d bytes, the limit is %d", len(v), MaxHeaderBytes))
	}
	return nil
}

// builder accumulates a report while enforcing the bounds common to
// every form.
type builder struct {
	r    Report
	keys int
	// strict refuses duplicates (TEXT, JSON); otherwise the last wins.
	strict bool
}

// key counts one key against MaxKeys.
func (b *builder) key() error {
	b.keys++
	if b.keys > MaxKeys {
		return fault(ErrTooMany, "", fmt.Sprintf("more than %d keys", MaxKeys))
	}
	return nil
}

// scalar describes one scalar field: its bit, its cap and where it goes.
type scalar struct {
	field Field
	max   float64
	name  string // snake_case, for errors
}

// scalarFor returns the scalar field a TEXT or JSON key names, in
// snake_case or lowerCamelCase.
func scalarFor(key string) (scalar, bool) {
	switch key {
	case "cpu_utilization", "cpuUtilization":
		return scalar{CPU, MaxUtilization, "cpu_utilization"}, true
	case "mem_utilization", "memUtilization":
		return scalar{Mem, MaxFraction, "mem_utilization"}, true
	case "application_utilization", "applicationUtilization":
		return scalar{Application, MaxUtilization, "application_utilization"}, true
	case "rps_fractional", "rpsFractional":
		return scalar{RPS, MaxRate, "rps_fractional"}, true
	case "eps":
		return scalar{EPS, MaxRate, "eps"}, true
	}
	return scalar{}, false
}

// setScalar stores v in the field s names, given as key, after checking
// it.
func (b *builder) setScalar(s scalar, key string, v float64) error {
	if err := checkValue(key, v, s.max); err != nil {
		return err
	}
	if b.strict && b.r.set&s.field != 0 {
		return fault(ErrDuplicate, s.name, "given twice")
	}
	v = plusZero(v)
	b.r.set |= s.field
	switch s.field {
	case CPU:
		b.r.CPU = v
	case Mem:
		b.r.Mem = v
	case Application:
		b.r.Application = v
	case RPS:
		b.r.RPS = v
	case EPS:
		b.r.EPS = v
	}
	return nil
}

// The report's maps, as indices into mapPrefix and mapMax.
const (
	mapNamed = iota
	mapUtil
	mapCost
)

// mapPrefix is each map's name in TEXT keys and errors.
var mapPrefix = [...]string{mapNamed: "named_metrics", mapUtil: "utilization", mapCost: "request_cost"}

// mapMax is the cap on each map's values.
var mapMax = [...]float64{mapNamed: MaxValue, mapUtil: MaxFraction, mapCost: MaxValue}

// setEntry stores name=v in map m after checking both.
func (b *builder) setEntry(m int, name string, v float64) error {
	if err := checkName(mapPrefix[m], name); err != nil {
		return err
	}
	if err := checkValue(mapPrefix[m]+"."+name, v, mapMax[m]); err != nil {
		return err
	}
	var mp *map[string]float64
	switch m {
	case mapNamed:
		mp = &b.r.Named
	case mapUtil:
		mp = &b.r.Utilizations
	default:
		mp = &b.r.RequestCost
	}
	if _, dup := (*mp)[name]; dup {
		if b.strict {
			return fault(ErrDuplicate, mapPrefix[m]+"."+name, "given twice")
		}
	} else if len(b.r.Named)+len(b.r.Utilizations)+len(b.r.RequestCost) >= MaxMetrics {
		return fault(ErrTooMany, "", fmt.Sprintf("more than %d named metrics", MaxMetrics))
	}
	if *mp == nil {
		*mp = make(map[string]float64)
	}
	(*mp)[name] = plusZero(v)
	return nil
}

// checkValue checks that v, the value of key, is finite and in [0, max].
func checkValue(key string, v, max float64) error {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return fault(ErrValue, key, "not a finite number")
	case v < 0:
		return fault(ErrValue, key, fmt.Sprintf("%g is negative", v))
	case v > max:
		return fault(ErrValue, key, fmt.Sprintf("%g is above the cap %g", v, max))
	}
	return nil
}

// plusZero turns -0, which passes checkValue, into 0, so that no
// report carries a negative sign.
func plusZero(v float64) float64 {
	if v == 0 {
		return 0
	}
	return v
}

// checkName checks a metric name of map m against the name rule.
func checkName(m, name string) error {
	if name == "" {
		return fault(ErrName, m+".", "empty name")
	}
	if len(name) > MaxNameBytes {
		return fault(ErrName, m+"."+name, fmt.Sprintf("longer than %d bytes", MaxNameBytes))
	}
	for i := 0; i < len(name); i++ {
		if !nameByte(name[i]) {
			return fault(ErrName, m+"."+name, fmt.Sprintf("byte %q is not a letter, digit, '_', '.', ':' or '-'", name[i]))
		}
	}
	return nil
}

// nameByte reports whether c may appear in a metric name.
func nameByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
		c == '_' || c == '.' || c == ':' || c == '-'
}

// number parses the text of a value of key.
func number(key, text string) (float64, error) {
	v, err := strconv.ParseFloat(text, 64)
	if err != nil {
		var ne *strconv.NumError
		if errors.As(err, &ne) && ne.Err == strconv.ErrRange {
			return 0, fault(ErrValue, key, "not a finite number")
		}
		return 0, fault(ErrValue, key, quote(text)+" is not a number")
	}
	return v, nil
}
