package orca

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"strings"
	"testing"
)

// enc is a tiny protobuf encoder for OrcaLoadReport, for building BIN
// reports in tests.
type enc []byte

func (e enc) tag(num uint64, wt int) enc {
	return binary.AppendUvarint(e, num<<3|uint64(wt))
}

func (e enc) double(num uint64, v float64) enc {
	return binary.LittleEndian.AppendUint64(e.tag(num, wireFixed64), math.Float64bits(v))
}

func (e enc) bytes(num uint64, b []byte) enc {
	e = binary.AppendUvarint(e.tag(num, wireBytes), uint64(len(b)))
	return append(e, b...)
}

func (e enc) entry(num uint64, name string, v float64) enc {
	return e.bytes(num, enc(nil).bytes(1, []byte(name)).double(2, v))
}

func (e enc) varint(num, v uint64) enc {
	return binary.AppendUvarint(e.tag(num, wireVarint), v)
}

func (e enc) bin() string { return "BIN " + base64.StdEncoding.EncodeToString(e) }

// encode serializes r with enc, maps in an order fixed by the caller.
func encode(r Report) enc {
	var e enc
	if r.Has(CPU) {
		e = e.double(1, r.CPU)
	}
	if r.Has(Mem) {
		e = e.double(2, r.Mem)
	}
	for k, v := range r.RequestCost {
		e = e.entry(4, k, v)
	}
	for k, v := range r.Utilizations {
		e = e.entry(5, k, v)
	}
	if r.Has(RPS) {
		e = e.double(6, r.RPS)
	}
	if r.Has(EPS) {
		e = e.double(7, r.EPS)
	}
	for k, v := range r.Named {
		e = e.entry(8, k, v)
	}
	if r.Has(Application) {
		e = e.double(9, r.Application)
	}
	return e
}

// full is a report with every field, as the tables below expect it.
var full = Report{
	CPU: 0.7, Mem: 0.5, Application: 0.8, RPS: 120.5, EPS: 2,
	Named:        map[string]float64{"queue": 4},
	Utilizations: map[string]float64{"gpu": 0.25},
	RequestCost:  map[string]float64{"db_reads": 3},
	set:          CPU | Mem | Application | RPS | EPS,
}

func equal(a, b Report) bool {
	for _, v := range []float64{a.CPU, a.Mem, a.Application, a.RPS, a.EPS} {
		if math.Signbit(v) {
			return false
		}
	}
	return a.set == b.set && a.CPU == b.CPU && a.Mem == b.Mem && a.Application == b.Application &&
		a.RPS == b.RPS && a.EPS == b.EPS && maps.Equal(a.Named, b.Named) &&
		maps.Equal(a.Utilizations, b.Utilizations) && maps.Equal(a.RequestCost, b.RequestCost)
}

func TestParseGood(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     Report
	}{
		{
			// The example in the ORCA HTTP format's description.
			"text spec example",
			"TEXT cpu_utilization=0.3, mem_utilization=0.8, rps_fractional=10.0, eps=1, named_metrics.custom_metric_util=0.4",
			Report{CPU: 0.3, Mem: 0.8, RPS: 10, EPS: 1, Named: map[string]float64{"custom_metric_util": 0.4}, set: CPU | Mem | RPS | EPS},
		},
		{
			// What vLLM sends, with a name holding ':' as its metric
			// names do.
			"text vllm",
			"TEXT named_metrics.kv_cache_usage_perc=0.42,named_metrics.vllm:num_requests_waiting=5.0",
			Report{Named: map[string]float64{"kv_cache_usage_perc": 0.42, "vllm:num_requests_waiting": 5}},
		},
		{
			"text every field",
			"TEXT cpu_utilization=0.7,mem_utilization=0.5,application_utilization=0.8,rps_fractional=120.5,eps=2," +
				"named_metrics.queue=4,utilization.gpu=0.25,request_cost.db_reads=3",
			full,
		},
		{
			// Envoy's parser separates key and value with ':'.
			"text envoy colon",
			"TEXT cpu_utilization:0.7, named_metrics.vllm:waiting:3",
			Report{CPU: 0.7, Named: map[string]float64{"vllm:waiting": 3}, set: CPU},
		},
		{
			"text spaces, empty elements, unknown keys",
			"  TEXT  cpu_utilization = 0.5 ,, rps=7, future_field=banana,\teps=0 ,",
			Report{CPU: 0.5, set: CPU | EPS},
		},
		{"text empty", "TEXT ", Report{}},
		{"text zero is present", "TEXT cpu_utilization=0", Report{set: CPU}},
		{"text minus zero", "TEXT cpu_utilization=-0, named_metrics.z=-0.0", Report{Named: map[string]float64{"z": 0}, set: CPU}},
		{"text caps inclusive", "TEXT cpu_utilization=100, mem_utilization=1, eps=1e9, named_metrics.x=1e15", Report{CPU: 100, Mem: 1, EPS: 1e9, Named: map[string]float64{"x": 1e15}, set: CPU | Mem | EPS}},
		{
			"json snake",
			`JSON {"cpu_utilization":0.7,"mem_utilization":0.5,"application_utilization":0.8,"rps_fractional":120.5,"eps":2,` +
				`"named_metrics":{"queue":4},"utilization":{"gpu":0.25},"request_cost":{"db_reads":3}}`,
			full,
		},
		{
			"json camel, strings, whitespace",
			"JSON { \"cpuUtilization\": \"0.7\", \"memUtilization\": 0.5, \"applicationUtilization\": 8e-1,\n" +
				"\"rpsFractional\": 120.5, \"eps\": 2, \"namedMetrics\": {\"queue\": 4}, \"utilization\": {\"gpu\": \"0.25\"}, \"requestCost\": {\"db_reads\": 3} }",
			full,
		},
		{
			// What vLLM sends in JSON.
			"json vllm",
			`JSON {"named_metrics": {"kv_cache_usage_perc": 0.42, "num_requests_waiting": 5.0}}`,
			Report{Named: map[string]float64{"kv_cache_usage_perc": 0.42, "num_requests_waiting": 5}},
		},
		{
			"json nulls and unknown members",
			`JSON {"cpu_utilization":null,"rps":"7","future":{"a":[1,{"b":null}]},"named_metrics":null,"eps":1}`,
			Report{EPS: 1, set: EPS},
		},
		{"json empty", "JSON {}", Report{}},
		{"bin every field", encode(full).bin(), full},
		// The next three are what the official Go protobuf runtime
		// (google.golang.org/protobuf v1.36.12) wrote for cncf/xds's
		// generated OrcaLoadReport holding full's values and rps 7:
		// proto.Marshal (deterministic) in base64, and protojson with
		// and without UseProtoNames. The deprecated rps is skipped.
		{
			"bin from protobuf-go",
			"BIN CWZmZmZmZuY/EQAAAAAAAOA/GAciEwoIZGJfcmVhZHMRAAAAAAAACEAqDgoDZ3B1EQAAAAAAANA/MQAAAAAAIF5AOQAAAAAAAABAQhAKBXF1ZXVlEQAAAAAAABBASZqZmZmZmek/",
			full,
		},
		{
			"json from protojson",
			`JSON {"cpuUtilization":0.7, "memUtilization":0.5, "rps":"7", "requestCost":{"db_reads":3}, "utilization":{"gpu":0.25}, ` +
				`"rpsFractional":120.5, "eps":2, "namedMetrics":{"queue":4}, "applicationUtilization":0.8}`,
			full,
		},
		{
			"json from protojson proto names",
			`JSON {"cpu_utilization":0.7, "mem_utilization":0.5, "rps":"7", "request_cost":{"db_reads":3}, "utilization":{"gpu":0.25}, ` +
				`"rps_fractional":120.5, "eps":2, "named_metrics":{"queue":4}, "application_utilization":0.8}`,
			full,
		},
		{"bin empty", "BIN ", Report{}},
		{"bin unpadded", strings.TrimRight(enc(nil).double(1, 0.5).bin(), "="), Report{CPU: 0.5, set: CPU}},
		{
			"bin unknown fields skipped",
			enc(nil).varint(3, 7).varint(100, 1).bytes(101, []byte("x")).double(1, 0.5).
				tag(102, wireFixed32).append(1, 2, 3, 4).bin(),
			Report{CPU: 0.5, set: CPU},
		},
		{
			// Protobuf merges a repeated field: the last wins.
			"bin last wins",
			enc(nil).double(1, 0.5).double(1, 0.6).entry(8, "q", 1).entry(8, "q", 2).bin(),
			Report{CPU: 0.6, Named: map[string]float64{"q": 2}, set: CPU},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(tc.in)
			if err != nil {
				t.Fatalf("Parse(%q): %v", tc.in, err)
			}
			if !equal(got, tc.want) {
				t.Fatalf("Parse(%q) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
}

func (e enc) append(b ...byte) enc { return append(e, b...) }

func TestParseBad(t *testing.T) {
	manyText := func(n int) string {
		var b strings.Builder
		b.WriteString("TEXT ")
		for i := range n {
			fmt.Fprintf(&b, "named_metrics.m%d=1,", i)
		}
		return b.String()
	}
	manyJSON := func(n int) string {
		var b strings.Builder
		b.WriteString(`JSON {"named_metrics":{`)
		for i := range n {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `"m%d":1`, i)
		}
		b.WriteString("}}")
		return b.String()
	}
	manyBin := func(n int) string {
		var e enc
		for i := range n {
			e = e.entry(8, fmt.Sprint("m", i), 1)
		}
		return e.bin()
	}
	unknownText := func(n int) string {
		return "TEXT " + strings.Repeat("x=1,", n)
	}
	for _, tc := range []struct {
		name, in string
		kind     error
		key      string // a substring the message must hold
	}{
		{"empty", "", ErrFormat, "empty"},
		{"no prefix", "cpu_utilization=0.3", ErrFormat, "cpu_utilization=0.3"},
		{"lower-case prefix", "text cpu_utilization=0.3", ErrFormat, `"text"`},
		{"prefix without space", "TEXT", ErrFormat, ""},
		{"garbage", "\x00\xff\x01garbage", ErrFormat, ""},
		{"1 MB", "TEXT " + strings.Repeat("a", 1<<20), ErrTooLong, "1048581 bytes"},
		{"just over", "TEXT " + strings.Repeat(" ", MaxHeaderBytes-4), ErrTooLong, ""},

		{"text no value", "TEXT cpu_utilization", ErrSyntax, `"cpu_utilization"`},
		{"text empty value", "TEXT cpu_utilization=", ErrValue, `"cpu_utilization"`},
		{"text not a number", "TEXT eps=lots", ErrValue, `"lots"`},
		{"text NaN", "TEXT cpu_utilization=NaN", ErrValue, `"cpu_utilization"`},
		{"text Inf", "TEXT rps_fractional=+Inf", ErrValue, `"rps_fractional"`},
		{"text overflow", "TEXT eps=1e400", ErrValue, `"eps"`},
		{"text negative", "TEXT eps=-1", ErrValue, `"eps": -1 is negative`},
		{"text negative named", "TEXT named_metrics.q=-0.5", ErrValue, `"named_metrics.q"`},
		{"text cpu huge", "TEXT cpu_utilization=100.5", ErrValue, "cap 100"},
		{"text application huge", "TEXT application_utilization=1e300", ErrValue, `"application_utilization"`},
		{"text mem above 1", "TEXT mem_utilization=1.01", ErrValue, `"mem_utilization"`},
		{"text utilization above 1", "TEXT utilization.gpu=2", ErrValue, `"utilization.gpu"`},
		{"text rate huge", "TEXT rps_fractional=2e9", ErrValue, "cap 1e+09"},
		{"text named huge", "TEXT named_metrics.q=1e16", ErrValue, "cap 1e+15"},
		{"text duplicate", "TEXT cpu_utilization=0.1, cpu_utilization=0.2", ErrDuplicate, `"cpu_utilization"`},
		{"text duplicate named", "TEXT named_metrics.a=1,named_metrics.a=1", ErrDuplicate, `"named_metrics.a"`},
		{"text empty name", "TEXT named_metrics.=1", ErrName, `"named_metrics."`},
		{"text bad name", "TEXT named_metrics.a b=1", ErrName, `' '`},
		{"text long name", "TEXT named_metrics." + strings.Repeat("n", MaxNameBytes+1) + "=1", ErrName, "longer than 128"},
		{"text 65 named", manyText(MaxMetrics + 1), ErrTooMany, "64"},
		{"text 10k named", manyText(10000), ErrTooLong, ""},
		{"text 129 unknown", unknownText(MaxKeys + 1), ErrTooMany, "128 keys"},

		{"json invalid", "JSON {", ErrSyntax, "valid JSON"},
		{"json trailing garbage", `JSON {"eps":1} x`, ErrSyntax, ""},
		{"json array", "JSON [1]", ErrSyntax, "object"},
		{"json bool", `JSON {"eps":true}`, ErrValue, `"eps"`},
		{"json string NaN", `JSON {"cpuUtilization":"NaN"}`, ErrValue, `"cpuUtilization"`},
		{"json string Infinity", `JSON {"eps":"Infinity"}`, ErrValue, "finite"},
		{"json negative", `JSON {"eps":-0.5}`, ErrValue, "negative"},
		{"json overflow", `JSON {"eps":1e999}`, ErrValue, "finite"},
		{"json duplicate", `JSON {"eps":1,"eps":2}`, ErrDuplicate, `"eps"`},
		{"json duplicate spellings", `JSON {"rps_fractional":1,"rpsFractional":2}`, ErrDuplicate, `"rps_fractional"`},
		{"json duplicate entry", `JSON {"named_metrics":{"a":1},"namedMetrics":{"a":2}}`, ErrDuplicate, `"named_metrics.a"`},
		{"json map not object", `JSON {"named_metrics":[1]}`, ErrSyntax, `"named_metrics"`},
		{"json entry not number", `JSON {"utilization":{"a":{}}}`, ErrValue, `"utilization.a"`},
		{"json bad name", `JSON {"named_metrics":{"a\"b":1}}`, ErrName, ""},
		{"json 65 named", manyJSON(MaxMetrics + 1), ErrTooMany, "64"},

		{"bin bad base64", "BIN !!!!", ErrSyntax, "base64"},
		{"bin truncated base64", "BIN A", ErrSyntax, "base64"},
		{"bin truncated double", enc(nil).double(1, 0.5)[:5].bin(), ErrSyntax, `"cpu_utilization": truncated`},
		{"bin truncated tag", enc(nil).append(0x80).bin(), ErrSyntax, "tag"},
		{"bin truncated map", enc(nil).entry(8, "q", 1)[:4].bin(), ErrSyntax, `"named_metrics"`},
		{"bin huge length", enc(nil).tag(8, wireBytes).append(0xff, 0xff, 0xff, 0xff, 0x0f).bin(), ErrSyntax, "truncated"},
		{"bin field zero", enc(nil).append(0x01).bin(), ErrSyntax, "field number 0"},
		{"bin wrong wire type", enc(nil).varint(1, 5).bin(), ErrSyntax, "wire type 0"},
		{"bin wrong wire type map", enc(nil).double(8, 1).bin(), ErrSyntax, `"named_metrics"`},
		{"bin wrong entry wire type", enc(nil).bytes(8, enc(nil).varint(1, 5)).bin(), ErrSyntax, "entry field 1"},
		{"bin group", enc(nil).tag(50, 3).bin(), ErrSyntax, "wire type 3"},
		{"bin truncated unknown varint", enc(nil).tag(50, wireVarint).append(0x80).bin(), ErrSyntax, "field 50"},
		{"bin truncated unknown fixed32", enc(nil).tag(50, wireFixed32).append(1).bin(), ErrSyntax, "field 50"},
		{"bin NaN", enc(nil).double(9, math.NaN()).bin(), ErrValue, `"application_utilization"`},
		{"bin -Inf", enc(nil).double(7, math.Inf(-1)).bin(), ErrValue, `"eps"`},
		{"bin negative", enc(nil).double(6, -3).bin(), ErrValue, `"rps_fractional"`},
		{"bin map NaN", enc(nil).entry(4, "c", math.NaN()).bin(), ErrValue, `"request_cost.c"`},
		{"bin entry without key", enc(nil).bytes(8, enc(nil).double(2, 1)).bin(), ErrName, "empty"},
		{"bin long name", enc(nil).entry(8, strings.Repeat("n", 200), 1).bin(), ErrName, "longer than 128"},
		{"bin 65 named", manyBin(MaxMetrics + 1), ErrTooMany, "64"},
		{"bin 129 fields", func() string {
			var e enc
			for range MaxKeys + 1 {
				e = e.varint(3, 1)
			}
			return e.bin()
		}(), ErrTooMany, "128"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Parse(tc.in)
			if err == nil {
				t.Fatalf("Parse(%.80q) = %+v, want an error", tc.in, r)
			}
			if !errors.Is(err, tc.kind) {
				t.Fatalf("Parse(%.80q): %v, want kind %v", tc.in, err, tc.kind)
			}
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("Parse(%.80q): %T is not *Error", tc.in, err)
			}
			msg := err.Error()
			if !strings.Contains(msg, tc.key) {
				t.Fatalf("Parse(%.80q): %q does not contain %q", tc.in, msg, tc.key)
			}
			if !strings.HasPrefix(msg, tc.kind.Error()) {
				t.Fatalf("Parse(%.80q): %q does not start with what is wrong", tc.in, msg)
			}
			if len(msg) > 200 {
				t.Fatalf("Parse(%.80q): message of %d bytes quotes too much: %q", tc.in, len(msg), msg)
			}
			if !equal(r, Report{}) {
				t.Fatalf("Parse(%.80q) returned %+v with its error, want the zero report", tc.in, r)
			}
		})
	}
}

// TestParseAtBounds checks that the largest reports allowed parse.
func TestParseAtBounds(t *testing.T) {
	var b strings.Builder
	b.WriteString("TEXT ")
	for i := range MaxMetrics {
		fmt.Fprintf(&b, "named_metrics.m%d=1,", i)
	}
	b.WriteString(strings.Repeat("x=1,", MaxKeys-MaxMetrics))
	r, err := Parse(b.String())
	if err != nil || len(r.Named) != MaxMetrics {
		t.Fatalf("%d named metrics and %d keys: %d parsed, %v", MaxMetrics, MaxKeys, len(r.Named), err)
	}
	h := "TEXT eps=1," + strings.Repeat(" ", MaxHeaderBytes-len("TEXT eps=1,"))
	if r, err := Parse(h); err != nil || r.EPS != 1 {
		t.Fatalf("a header of exactly %d bytes: %+v, %v", MaxHeaderBytes, r, err)
	}
	long := strings.Repeat("n", MaxNameBytes)
	if r, err := Parse("TEXT named_metrics." + long + "=1"); err != nil || r.Named[long] != 1 {
		t.Fatalf("a name of %d bytes: %+v, %v", MaxNameBytes, r, err)
	}
}

// TestBinRoundTrip encodes reports and parses them back.
func TestBinRoundTrip(t *testing.T) {
	for _, r := range []Report{
		{},
		full,
		{CPU: 1.5, set: CPU},
		{Application: 0, CPU: 0.2, set: CPU | Application},
		{Named: map[string]float64{"a": 0, "b.c:d-e_f": 1e15, "Z9": math.SmallestNonzeroFloat64}},
		{Utilizations: map[string]float64{"u": 1}, RequestCost: map[string]float64{"c": 0.125}},
	} {
		got, err := Parse(encode(r).bin())
		if err != nil || !equal(got, r) {
			t.Errorf("round trip of %+v: %+v, %v", r, got, err)
		}
	}
}

// grpcGoReport is an endpoint-load-metrics-bin value grpc-go wrote (see
// TestParseBinary).
const grpcGoReport = "CeF6FK5H4do/QhAKBXF1ZXVlEQAAAAAAAAhASTMzMzMzM+M/"

// TestParseBinary checks that an endpoint-load-metrics-bin value reads
// as the same value behind "BIN " does, with gRPC's padding rule, and
// that the length bound holds for it too.
func TestParseBinary(t *testing.T) {
	cpu := enc(nil).double(1, 0.5).varint(3, 7) // 11 bytes: base64 needs one '='
	padded := base64.StdEncoding.EncodeToString(cpu)
	unpadded := base64.RawStdEncoding.EncodeToString(cpu)
	if padded == unpadded {
		t.Fatal("the test value needs padding")
	}
	for _, tc := range []struct {
		name, in string
		want     Report
		kind     error // nil: want must come back
	}{
		{
			// What grpc-go v1.83.2's server wrote in the trailer
			// endpoint-load-metrics-bin of a call whose handler recorded
			// cpu 0.42, application utilization 0.6 and the named metric
			// queue=3 (orca.CallMetricsServerOption), as read off the
			// wire by net/http's HTTP/2 client.
			"written by grpc-go",
			grpcGoReport,
			Report{CPU: 0.42, Application: 0.6, Named: map[string]float64{"queue": 3}, set: CPU | Application},
			nil,
		},
		{"padded", padded, Report{CPU: 0.5, set: CPU}, nil},
		{"unpadded, as gRPC writes it", unpadded, Report{CPU: 0.5, set: CPU}, nil},
		{"surrounding blanks", " \t" + unpadded + " ", Report{CPU: 0.5, set: CPU}, nil},
		{"every field", base64.RawStdEncoding.EncodeToString(encode(full)), full, nil},
		{"empty message", "", Report{}, nil},
		{"too much padding", unpadded + "==", Report{}, ErrSyntax},
		{"padding where none fits", base64.RawStdEncoding.EncodeToString(cpu[:10]) + "=", Report{}, ErrSyntax},
		{"with the BIN prefix", "BIN " + padded, Report{}, ErrSyntax},
		{"text form", "TEXT cpu_utilization=0.5", Report{}, ErrSyntax},
		{"NaN", base64.RawStdEncoding.EncodeToString(enc(nil).double(1, math.NaN())), Report{}, ErrValue},
		{"65 named", strings.TrimPrefix(func() string {
			var e enc
			for i := range MaxMetrics + 1 {
				e = e.entry(8, fmt.Sprint("m", i), 1)
			}
			return e.bin()
		}(), "BIN "), Report{}, ErrTooMany},
		{"too long", strings.Repeat("A", MaxHeaderBytes+4), Report{}, ErrTooLong},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseBinary(tc.in)
			switch {
			case tc.kind == nil && err != nil:
				t.Fatalf("ParseBinary(%.80q): %v", tc.in, err)
			case tc.kind != nil && !errors.Is(err, tc.kind):
				t.Fatalf("ParseBinary(%.80q) = %+v, %v; want kind %v", tc.in, got, err, tc.kind)
			case !equal(got, tc.want):
				t.Fatalf("ParseBinary(%.80q) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
	// at the bound: a value of exactly MaxHeaderBytes is read
	e := enc(nil).bytes(100, make([]byte, MaxHeaderBytes/4*3-13)).double(1, 0.5)
	v := base64.RawStdEncoding.EncodeToString(e)
	if len(v) > MaxHeaderBytes || len(v) < MaxHeaderBytes-3 {
		t.Fatalf("test value of %d bytes", len(v))
	}
	v += strings.Repeat(" ", MaxHeaderBytes-len(v))
	if r, err := ParseBinary(v); err != nil || r.CPU != 0.5 {
		t.Fatalf("a value of exactly %d bytes: %+v, %v", MaxHeaderBytes, r, err)
	}
}

// sameAsBIN checks that ParseBinary(in) is what Parse makes of the same
// value in the BIN form.
func sameAsBIN(t *testing.T, in string) {
	t.Helper()
	got, err := ParseBinary(in)
	if len("BIN "+in) > MaxHeaderBytes {
		return // the prefix tips it over Parse's bound
	}
	want, werr := Parse("BIN " + in)
	if (err == nil) != (werr == nil) || !equal(got, want) ||
		(err != nil && err.Error() != werr.Error()) {
		t.Fatalf("ParseBinary(%.80q) = %+v, %v; Parse of it as BIN = %+v, %v", in, got, err, want, werr)
	}
}

func TestUtilization(t *testing.T) {
	for _, tc := range []struct {
		in     string
		want   float64
		wantOK bool
	}{
		{"TEXT application_utilization=0.8, cpu_utilization=0.3", 0.8, true},
		{"TEXT application_utilization=0, cpu_utilization=0.3", 0.3, true},
		{"TEXT cpu_utilization=0.3", 0.3, true},
		{"TEXT cpu_utilization=0", 0, true},
		{"TEXT application_utilization=0.5", 0.5, true},
		{"TEXT application_utilization=0", 0, false},
		{"TEXT mem_utilization=0.9, rps_fractional=10", 0, false},
	} {
		r, err := Parse(tc.in)
		if err != nil {
			t.Fatal(err)
		}
		if u, ok := r.Utilization(); u != tc.want || ok != tc.wantOK {
			t.Errorf("%q: Utilization() = %v, %v, want %v, %v", tc.in, u, ok, tc.want, tc.wantOK)
		}
	}
}

func TestHas(t *testing.T) {
	r, err := Parse("TEXT cpu_utilization=0, eps=0")
	if err != nil {
		t.Fatal(err)
	}
	if !r.Has(CPU) || !r.Has(EPS) || !r.Has(CPU|EPS) || r.Has(Mem) || r.Has(CPU|Mem) || r.Has(RPS) || r.Has(Application) {
		t.Fatalf("Has on %+v is wrong", r)
	}
}

// TestErrorQuotesLittle checks that errors quote at most about 64 bytes
// of a long input.
func TestErrorQuotesLittle(t *testing.T) {
	long := strings.Repeat("k", 4000)
	for _, in := range []string{
		"TEXT " + long,
		"TEXT eps=" + long,
		"TEXT named_metrics." + long + "=1",
		long,
		`JSON {"named_metrics":{"` + long + `":1}}`,
	} {
		_, err := Parse(in)
		if err == nil {
			t.Fatalf("Parse(%.40q...) succeeded", in)
		}
		if n := strings.Count(err.Error(), strings.Repeat("k", maxQuote+1)); n > 0 {
			t.Errorf("Parse(%.40q...): error quotes more than %d bytes of the input: %.200q", in, maxQuote, err)
		}
	}
}

// check is the property every parsed report has.
func check(r Report) error {
	for _, f := range []struct {
		name  string
		v     float64
		field Field
		max   float64
	}{
		{"cpu", r.CPU, CPU, MaxUtilization},
		{"mem", r.Mem, Mem, MaxFraction},
		{"application", r.Application, Application, MaxUtilization},
		{"rps", r.RPS, RPS, MaxRate},
		{"eps", r.EPS, EPS, MaxRate},
	} {
		if !(f.v >= 0 && f.v <= f.max) || math.Signbit(f.v) {
			return fmt.Errorf("%s = %v", f.name, f.v)
		}
		if !r.Has(f.field) && f.v != 0 {
			return fmt.Errorf("%s = %v but not set", f.name, f.v)
		}
	}
	if n := len(r.Named) + len(r.Utilizations) + len(r.RequestCost); n > MaxMetrics {
		return fmt.Errorf("%d metrics", n)
	}
	for _, m := range []struct {
		vals map[string]float64
		max  float64
	}{{r.Named, MaxValue}, {r.Utilizations, MaxFraction}, {r.RequestCost, MaxValue}} {
		for k, v := range m.vals {
			if !(v >= 0 && v <= m.max) || math.Signbit(v) {
				return fmt.Errorf("%q = %v", k, v)
			}
			if k == "" || len(k) > MaxNameBytes {
				return fmt.Errorf("name %q", k)
			}
			for i := 0; i < len(k); i++ {
				if !nameByte(k[i]) {
					return fmt.Errorf("name %q", k)
				}
			}
		}
	}
	if u, ok := r.Utilization(); ok && !(u >= 0 && u <= MaxUtilization) {
		return fmt.Errorf("utilization %v", u)
	}
	return nil
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"TEXT cpu_utilization=0.3, mem_utilization=0.8, rps_fractional=10.0, eps=1, named_metrics.custom_metric_util=0.4",
		"TEXT named_metrics.kv_cache_usage_perc=0.42,named_metrics.vllm:num_requests_waiting=5.0",
		"TEXT cpu_utilization:0.7, named_metrics.vllm:waiting:3",
		"TEXT eps=-1", "TEXT cpu_utilization=NaN", "TEXT a=1,,b=2",
		`JSON {"cpu_utilization":0.7,"named_metrics":{"queue":4},"utilization":{"gpu":0.25}}`,
		`JSON {"cpuUtilization":"0.7","requestCost":{"c":3},"x":[{"y":null}]}`,
		`JSON {"eps":1,"eps":2}`, "JSON {",
		encode(full).bin(),
		enc(nil).double(1, 0.5).double(1, 0.6).entry(8, "q", 1).bin(),
		enc(nil).entry(8, "q", 1)[:4].bin(),
		"BIN ////", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		r, err := Parse(in)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("error %T is not *Error", err)
			}
			if !equal(r, Report{}) {
				t.Fatalf("report %+v with error %v", r, err)
			}
			return
		}
		if err := check(r); err != nil {
			t.Fatalf("Parse(%q) = %+v: %v", in, r, err)
		}
	})
}

// FuzzParseBinary checks that any endpoint-load-metrics-bin value either
// is refused with an *Error or reads as a report within the bounds, and
// reads exactly as the same value in Parse's BIN form does.
func FuzzParseBinary(f *testing.F) {
	for _, s := range []string{
		grpcGoReport,
		base64.RawStdEncoding.EncodeToString(encode(full)),
		base64.StdEncoding.EncodeToString(enc(nil).double(1, 0.5)),
		base64.RawStdEncoding.EncodeToString(enc(nil).double(1, 0.5)) + "=",
		base64.RawStdEncoding.EncodeToString(enc(nil).entry(8, "q", 1)[:4]),
		base64.RawStdEncoding.EncodeToString(enc(nil).double(9, math.Inf(1))),
		"", "////", "A", "QQ=", "BIN AAAA", "AAAA,AAAA",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		r, err := ParseBinary(in)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("error %T is not *Error", err)
			}
			if !equal(r, Report{}) {
				t.Fatalf("report %+v with error %v", r, err)
			}
		} else if err := check(r); err != nil {
			t.Fatalf("ParseBinary(%q) = %+v: %v", in, r, err)
		}
		sameAsBIN(t, in)
	})
}

// The benchmarks parse a typical report in each form: the utilizations,
// rates and two named metrics.
var benchReport = Report{
	CPU: 0.42, Mem: 0.61, Application: 0.5, RPS: 812.5, EPS: 0.25,
	Named: map[string]float64{"queue": 4, "inflight": 12},
	set:   CPU | Mem | Application | RPS | EPS,
}

func benchParse(b *testing.B, in string) {
	if _, err := Parse(in); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(in)))
	for b.Loop() {
		_, _ = Parse(in)
	}
}

func BenchmarkParse(b *testing.B) {
	b.Run("TEXT", func(b *testing.B) {
		benchParse(b, "TEXT cpu_utilization=0.42, mem_utilization=0.61, application_utilization=0.5, "+
			"rps_fractional=812.5, eps=0.25, named_metrics.queue=4, named_metrics.inflight=12")
	})
	b.Run("TEXT-scalars", func(b *testing.B) {
		benchParse(b, "TEXT cpu_utilization=0.42, rps_fractional=812.5, eps=0.25")
	})
	b.Run("JSON", func(b *testing.B) {
		benchParse(b, `JSON {"cpu_utilization":0.42,"mem_utilization":0.61,"application_utilization":0.5,`+
			`"rps_fractional":812.5,"eps":0.25,"named_metrics":{"queue":4,"inflight":12}}`)
	})
	b.Run("BIN", func(b *testing.B) {
		benchParse(b, encode(benchReport).bin())
	})
}
