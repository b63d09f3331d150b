package partition

import (
	"encoding/json"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-lbx/lbx/lbxtest"
)

func FuzzParseTag(f *testing.F) {
	for _, s := range []string{"0/1", "2/3", "3/3", "-1/2", "1/", "/", "0/1024", "0/1025", "007/008", "1/2/3"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tag, err := ParseTag(s)
		if err != nil {
			if !strings.Contains(err.Error(), "invalid partition tag") {
				t.Fatalf("error %q does not say what is wrong", err)
			}
			return
		}
		if tag.Index < 0 || tag.Index >= tag.Count || tag.Count > MaxPartitions {
			t.Fatalf("ParseTag(%q) = %v out of range", s, tag)
		}
		if again, err := ParseTag(tag.String()); err != nil || again != tag {
			t.Fatalf("round trip of %q: %v, %v", s, again, err)
		}
	})
}

func FuzzParseNamingFile(f *testing.F) {
	f.Add("0.0.0.0:8004 0/3 # c\n\n#x\n0.0.0.0:8004 1/3\nbad\n")
	f.Add("a:1 0/1\r\na:1 0/1\n")
	f.Add(strings.Repeat("x", 70000))
	f.Fuzz(func(t *testing.T, data string) {
		entries, bad := ParseNamingFile("f", []byte(data))
		seen := map[Entry]bool{}
		for _, e := range entries {
			if seen[e] {
				t.Fatalf("duplicate %v", e)
			}
			seen[e] = true
			if _, err := checkDial(e.Dial); err != nil {
				t.Fatalf("accepted a bad address: %v", err)
			}
		}
		for _, b := range bad {
			if b.Line < 1 || !strings.HasPrefix(b.Error(), "f:") {
				t.Fatalf("bad line error without position: %v", b)
			}
		}
		if _, err := buildLayout(entries, nil, nil); err != nil && !strings.Contains(err.Error(), "may coexist") {
			t.Fatalf("layout: %v", err)
		}
	})
}

func FuzzMergeJSON(f *testing.F) {
	f.Add(`{"a":[1],"b":{"c":1}}`, `{"a":[2],"b":{"d":2}}`)
	f.Add(`[1,2]`, `{"x":1}`)
	f.Add(`1`, `"s"`)
	f.Add(`{"a":`, `{}`)
	f.Add(` {"a" : {"b": [1, "x ]"], "\u0063": {}}, "a": {"d": 1}} `, `{"a":{"b":[2],"c":{"e":null}}}`)
	f.Fuzz(func(t *testing.T, a, b string) {
		m := JSONMerger{}
		pa, pb := &Part{Body: []byte(a)}, &Part{Index: 1, Body: []byte(b)}
		if m.Prepare(pa) != nil || m.Prepare(pb) != nil {
			return
		}
		out, err := m.Merge([]*Part{pa, pb})
		if err != nil {
			t.Fatalf("merge: %v", err)
		}
		if !json.Valid(out.Body) {
			t.Fatalf("merged output is not JSON: %s", out.Body)
		}
		if len(out.Body) > len(a)+len(b)+1 {
			t.Fatalf("merged output (%d bytes) longer than its inputs (%d)", len(out.Body), len(a)+len(b))
		}
		want := mergeDecoded(decodeNumbers(t, pa.Body), decodeNumbers(t, pb.Body))
		if got := decodeNumbers(t, out.Body); !reflect.DeepEqual(got, want) {
			t.Fatalf("merge of %q and %q: %s; want %v", a, b, out.Body, want)
		}
	})
}

// FuzzHandlerJSON validates configs with one partition handler whose
// fields are the input, as `caddy validate` does (Caddy decodes,
// provisions and validates every module): whatever the input, the answer
// is an error or nil, never a panic.
func FuzzHandlerJSON(f *testing.F) {
	for _, s := range []string{
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}]}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/2"},{"dial":"127.0.0.1:2","tag":"1/2"}],"fail_limit":1,"timeout":"1s","merge":{"merger":"concat"}}`,
		`{"upstreams":[{"dial":"foo","tag":"0/1"}],"poll_interval":"1ns"}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"max_merged_body":-1,"max_response_body":1e30}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"retries":-1,"proxy":{"load_balancing":{"retries":7}}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"proxy":{"response_buffers":-1}}`,
		`{"naming_file":"/nonexistent","serf":{"port":"x"}}`,
		`{"naming_file":"/nonexistent","poll_interval":-1}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1000000000"}]}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"proxy":{"load_balancing":{"selection_policy":{"policy":"ewma","outlier":{"interval":"-1s"}}}}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"split_body":{"field":"q.ids","by":"hash","key":"id","max_elements":10}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"split_body":{"field":"a..b","by":"index","key":"id","max_elements":-1}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"split_body":{}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"merge":{"merger":"json","missing_field":"missing"}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"merge":{"merger":"json","missing_field":"` + strings.Repeat("m", 300) + `"}}`,
		`{"upstreams":[{"dial":"127.0.0.1:1","tag":"0/1"}],"skip":[{"expression":{"x":1}}],"reject":[{"match":{"expression":{"expr":"true"}}}]}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, handler string) { validateHandlerJSON(t, "partition", handler) })
}

// FuzzParallelJSON is FuzzHandlerJSON for the parallel handler.
func FuzzParallelJSON(f *testing.F) {
	const route = `{"handle":[{"handler":"static_response","body":"{}"}]}`
	for _, s := range []string{
		`{"branches":[{"routes":[` + route + `]}]}`,
		`{"branches":[{"name":"a","routes":[` + route + `]},{"name":"a","routes":[]}],"fail_limit":3}`,
		`{"branches":[null,{"name":"a b"}],"timeout":"-1s","max_merged_body":1}`,
		`{"branches":[{"routes":[` + route + `]}],"split_body":{"field":"ids","by":"index"},"merge":{"merger":"json","missing_field":"m"}}`,
		`{"branches":[{"routes":[` + route + `]}],"skip":[{"expression":{"x":1}}]}`,
		`{"branches":[{"routes":[` + route + `]}],"skip":[{"expression":{"expr":"true","name":null}}]}`,
		`{"branches":[{"routes":[{"handle":[{"handler":"parallel","branches":[{"routes":[` + route + `]}]}]}]}]}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, handler string) { validateHandlerJSON(t, "parallel", handler) })
}

// validateHandlerJSON validates a config with one handler of the given
// name whose other fields are handler's, if it is a JSON object.
func validateHandlerJSON(t *testing.T, name, handler string) {
	var fields map[string]json.RawMessage
	if json.Unmarshal([]byte(handler), &fields) != nil {
		return
	}
	fields["handler"] = json.RawMessage(strconv.Quote(name))
	h, err := json.Marshal(fields)
	if err != nil {
		t.Fatal(err)
	}
	lbxtest.ValidateHostile(t, lbxtest.HandlerConfig(h))
}
