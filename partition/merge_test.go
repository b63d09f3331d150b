package partition

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
)

func parts(t *testing.T, m Merger, bodies ...string) ([]*Part, error) {
	t.Helper()
	var ps []*Part
	for i, b := range bodies {
		p := &Part{Index: i, Status: 200, Header: http.Header{"Content-Type": {"text/x-" + itoa(i+1)}}, Body: []byte(b)}
		if err := m.Prepare(p); err != nil {
			return ps, err
		}
		ps = append(ps, p)
	}
	return ps, nil
}

func TestMergers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		merger Merger
		in     []string
		want   string
		ctype  string
		err    string // from Prepare
	}{
		{
			name: "json objects merge recursively", merger: JSONMerger{},
			in:   []string{`{"a":{"x":1,"l":[1]},"s":"p0"}`, `{"a":{"y":2,"l":[2,3]},"s":"p1"}`},
			want: `{"a":{"l":[1,2,3],"x":1,"y":2},"s":"p1"}` + "\n", ctype: "application/json",
		},
		{
			name: "json top-level arrays concatenate", merger: JSONMerger{},
			in:   []string{`[1,{"a":1}]`, `[]`, `[2]`},
			want: "[1,{\"a\":1},2]\n", ctype: "application/json",
		},
		{
			name: "json scalars and type changes overwrite", merger: JSONMerger{},
			in:   []string{`{"n":1,"o":{"x":1},"a":[1],"z":null}`, `{"n":2.50,"o":[1],"a":{"k":true},"z":0}`},
			want: `{"a":{"k":true},"n":2.50,"o":[1],"z":0}` + "\n", ctype: "application/json",
		},
		{
			name: "json keeps numbers and does not escape HTML", merger: JSONMerger{},
			in:   []string{`{"big":12345678901234567890123}`, `{"h":"<a&b>"}`},
			want: `{"big":12345678901234567890123,"h":"<a&b>"}` + "\n", ctype: "application/json",
		},
		{
			name: "json deep nesting", merger: JSONMerger{},
			in:   []string{`{"a":{"b":{"c":{"d":[1]}}}}`, `{"a":{"b":{"c":{"d":[2],"e":"x"}}}}`},
			want: `{"a":{"b":{"c":{"d":[1,2],"e":"x"}}}}` + "\n", ctype: "application/json",
		},
		{name: "json invalid", merger: JSONMerger{}, in: []string{`{"a":1}`, `{"a":`}, err: "invalid JSON"},
		{name: "json trailing data", merger: JSONMerger{}, in: []string{`{"a":1} {"b":2}`}, err: "after top-level value"},
		{name: "json empty body", merger: JSONMerger{}, in: []string{``}, err: "invalid JSON"},
		{
			name: "json copies unmerged values as written, compacted", merger: JSONMerger{},
			in:   []string{" {\"b\": {\"z\": 1, \"y\": \"\\u003c a\"}, \"a\" : [ 1 , 2 ]}\n", `{"a":[],"c":null}`},
			want: `{"a":[1,2],"b":{"z":1,"y":"\u003c a"},"c":null}` + "\n", ctype: "application/json",
		},
		{
			name: "json escaped keys are the same key", merger: JSONMerger{},
			in:   []string{`{"\u0061":[1],"b":1,"b":2}`, `{"a":[2]}`},
			want: `{"\u0061":[1,2],"b":2}` + "\n", ctype: "application/json",
		},
		{
			name: "json only the run of one kind that ends last counts", merger: JSONMerger{},
			in:   []string{`{"a":{"x":1}}`, `{"a":[1]}`, `{"a":{"y":2}}`, `{"a":{"z":3}}`},
			want: `{"a":{"y":2,"z":3}}` + "\n", ctype: "application/json",
		},
		{
			name: "json strings with brackets and quotes", merger: JSONMerger{},
			in:   []string{`{"s":["]}\"{[", "x y"]}`, `{"s":["\\"]}`},
			want: `{"s":["]}\"{[","x y","\\"]}` + "\n", ctype: "application/json",
		},
		{
			name: "concat", merger: ConcatMerger{},
			in: []string{"a", "", "bc"}, want: "abc", ctype: "text/x-1",
		},
		{
			name: "ndjson adds missing newlines", merger: NDJSONMerger{},
			in: []string{"{\"a\":1}\n{\"a\":2}\n", "", "{\"a\":3}"}, want: "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n", ctype: "application/x-ndjson",
		},
		{
			name: "first", merger: FirstMerger{},
			in: []string{"winner", "loser"}, want: "winner", ctype: "text/x-1",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps, err := parts(t, tc.merger, tc.in...)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Prepare error %v; want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			m, err := tc.merger.Merge(ps)
			if err != nil {
				t.Fatal(err)
			}
			if string(m.Body) != tc.want {
				t.Errorf("body %s; want %s", m.Body, tc.want)
			}
			if ct := m.Header.Get("Content-Type"); ct != tc.ctype {
				t.Errorf("Content-Type %q; want %q", ct, tc.ctype)
			}
		})
	}
	if !(FirstMerger{}).Enough(1) {
		t.Error("first: one part must be enough")
	}
}

func TestChooseFollowsCapacity(t *testing.T) {
	tag := func(s string) Tag { tg, _ := ParseTag(s); return tg }
	// Scheme 3: one replica per partition (capacity 1). Scheme 4: two
	// per partition (capacity 2). Scheme 5: p4 missing (capacity 0).
	var entries []Entry
	for i := range 3 {
		entries = append(entries, Entry{"a:1", tag(itoa(i) + "/3")})
	}
	for i := range 4 {
		entries = append(entries, Entry{"b:1", tag(itoa(i) + "/4")}, Entry{"c:1", tag(itoa(i) + "/4")})
	}
	for i := range 4 {
		entries = append(entries, Entry{"d:1", tag(itoa(i) + "/5")})
	}
	l, err := buildLayout(entries, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	const draws = 30000
	counts := map[int]int{}
	for range draws {
		counts[l.choose(rng.IntN, 0).count]++
	}
	if counts[5] != 0 {
		t.Errorf("scheme with a missing partition chosen %d times", counts[5])
	}
	// Expected shares 1/3 and 2/3; allow 5 standard deviations.
	p := 1.0 / 3
	sd := math.Sqrt(draws * p * (1 - p))
	if got := float64(counts[3]); math.Abs(got-draws*p) > 5*sd {
		t.Errorf("scheme 3 chosen %v times of %d; want %.0f ± %.0f", got, draws, draws*p, 5*sd)
	}
	if counts[3]+counts[4] != draws {
		t.Errorf("counts %v", counts)
	}

	empty, _ := buildLayout(entries[len(entries)-4:], nil, nil)
	if s := empty.choose(rng.IntN, 0); s != nil {
		t.Errorf("all capacity 0: chose scheme %d", s.count)
	}
}

// mergeDecoded is the JSON merge on decoded values, the reference for
// JSONMerger: objects recursively, arrays concatenated, anything else
// replaced by src.
func mergeDecoded(dst, src any) any {
	switch s := src.(type) {
	case map[string]any:
		d, ok := dst.(map[string]any)
		if !ok {
			return s
		}
		for k, sv := range s {
			if dv, ok := d[k]; ok {
				d[k] = mergeDecoded(dv, sv)
			} else {
				d[k] = sv
			}
		}
		return d
	case []any:
		d, ok := dst.([]any)
		if !ok {
			return s
		}
		return append(d, s...)
	default:
		return src
	}
}

func decodeNumbers(t testing.TB, b []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decoding %q: %v", b, err)
	}
	return v
}
