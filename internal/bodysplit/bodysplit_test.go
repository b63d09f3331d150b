package bodysplit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// TestHashWorkedExample pins the hash to values computed by hand (an
// independent FNV-1a implementation, and the standard test vector for
// "a"), as stated in the package doc and docs/partition.md.
func TestHashWorkedExample(t *testing.T) {
	for _, tc := range []struct {
		key  string
		hash uint64
	}{
		{"", 0xcbf29ce484222325}, // the offset basis
		{"a", 0xaf63dc4c8601ec8c},
		{"user:42", 0x6c151ea4dcd221c2},
	} {
		if got := HashKey([]byte(tc.key)); got != tc.hash {
			t.Errorf("HashKey(%q) = %#x; want %#x", tc.key, got, tc.hash)
		}
	}
	if p := HashKey([]byte("user:42")) % 3; p != 2 {
		t.Errorf(`"user:42" among 3: partition %d; want 2`, p)
	}
	s := mustNew(t, Config{Field: "ids"})
	out, err := s.Split([]byte(`{"ids":["user:42"]}`), 3)
	if err != nil {
		t.Fatal(err)
	}
	if out[0] != nil || out[1] != nil || string(out[2]) != `{"ids":["user:42"]}` {
		t.Errorf("split of user:42 among 3: %q", out)
	}
}

func mustNew(t *testing.T, c Config) *Splitter {
	t.Helper()
	s, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// part returns the partition FNV-1a-64 gives key among n.
func part(key string, n int) int { return int(HashKey([]byte(key)) % uint64(n)) }

func TestSplit(t *testing.T) {
	// Keys whose partitions among 2 are known, to build expectations.
	var in0, in1 []string
	for i := 0; len(in0) < 2 || len(in1) < 2; i++ {
		k := fmt.Sprint(i)
		if part(k, 2) == 0 {
			in0 = append(in0, k)
		} else {
			in1 = append(in1, k)
		}
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		body string
		n    int
		want []string // "" for nil
	}{
		{
			name: "strings by hash, the rest as written",
			cfg:  Config{Field: "ids"},
			body: fmt.Sprintf(` { "a" : 1 ,"ids": [ "%s" , "%s","%s"  ,"%s" ], "z":[ true ] }`+"\n", in0[0], in1[0], in0[1], in1[1]),
			n:    2,
			want: []string{
				fmt.Sprintf(` { "a" : 1 ,"ids": ["%s","%s"], "z":[ true ] }`+"\n", in0[0], in0[1]),
				fmt.Sprintf(` { "a" : 1 ,"ids": ["%s","%s"], "z":[ true ] }`+"\n", in1[0], in1[1]),
			},
		},
		{
			name: "numbers hash their literal",
			cfg:  Config{Field: "ids"},
			body: fmt.Sprintf(`{"ids":[%s,%s]}`, in1[0], in0[0]),
			n:    2,
			want: []string{fmt.Sprintf(`{"ids":[%s]}`, in0[0]), fmt.Sprintf(`{"ids":[%s]}`, in1[0])},
		},
		{
			name: "escaped strings hash their content",
			cfg:  Config{Field: "ids"},
			body: `{"ids":["\u0075ser:42"]}`,
			n:    3,
			want: []string{"", "", `{"ids":["\u0075ser:42"]}`},
		},
		{
			name: "key member of objects, nested path",
			cfg:  Config{Field: "q.items", Key: "id"},
			body: fmt.Sprintf(`{"q":{"x":[1],"items":[{"id":"%s","v":[1,2]},{"v":0,"id":%s}]},"n":null}`, in1[0], in0[0]),
			n:    2,
			want: []string{
				fmt.Sprintf(`{"q":{"x":[1],"items":[{"v":0,"id":%s}]},"n":null}`, in0[0]),
				fmt.Sprintf(`{"q":{"x":[1],"items":[{"id":"%s","v":[1,2]}]},"n":null}`, in1[0]),
			},
		},
		{
			name: "index: element i to partition i, any type",
			cfg:  Config{Field: "subs", By: ByIndex},
			body: `{"subs":[{"a":1}, [2], null]}`,
			n:    3,
			want: []string{`{"subs":[{"a":1}]}`, `{"subs":[[2]]}`, `{"subs":[null]}`},
		},
		{
			name: "empty array: every partition skipped",
			cfg:  Config{Field: "ids"},
			body: `{"ids":[ ]}`,
			n:    3,
			want: []string{"", "", ""},
		},
		{
			name: "one partition gets everything",
			cfg:  Config{Field: "ids"},
			body: `{"ids":[1,"2",3]}`,
			n:    1,
			want: []string{`{"ids":[1,"2",3]}`},
		},
		{
			name: "escaped member names on the path",
			cfg:  Config{Field: "ids"},
			body: `{"\u0069ds":[7]}`,
			n:    1,
			want: []string{`{"\u0069ds":[7]}`},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := mustNew(t, tc.cfg).Split([]byte(tc.body), tc.n)
			if err != nil {
				t.Fatal(err)
			}
			if len(out) != tc.n {
				t.Fatalf("%d bodies; want %d", len(out), tc.n)
			}
			for i, b := range out {
				if (b == nil) != (tc.want[i] == "") || string(b) != tc.want[i] {
					t.Errorf("partition %d: %q; want %q", i, b, tc.want[i])
				}
				if b != nil && len(b) > len(tc.body) {
					t.Errorf("partition %d: %d bytes, longer than the body (%d)", i, len(b), len(tc.body))
				}
			}
		})
	}
}

func TestSplitErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		body string
		n    int
		kind Kind
		msg  string
	}{
		{Config{Field: "ids"}, ``, 2, NotJSON, "request body is empty"},
		{Config{Field: "ids"}, `{"ids":[1,]}`, 2, NotJSON, "request body is not valid JSON"},
		{Config{Field: "ids"}, `{"ids":[1]} {}`, 2, NotJSON, "not valid JSON"},
		{Config{Field: "ids"}, ` [1,2]`, 2, NotObject, "request body is an array; split_body needs a JSON object"},
		{Config{Field: "ids"}, `{"id":[1]}`, 2, FieldMissing, `request body has no field "ids"`},
		{Config{Field: "q.ids"}, `{"q":{"id":[1]}}`, 2, FieldMissing, `request body has no field "q.ids"`},
		{Config{Field: "q.ids"}, `{"q":"x"}`, 2, NotObject, `field "q" is a string; want an object holding "q.ids"`},
		{Config{Field: "ids"}, `{"ids":{"a":1}}`, 2, NotArray, `field "ids" is an object; want an array`},
		{Config{Field: "ids"}, `{"ids":null}`, 2, NotArray, `field "ids" is null; want an array`},
		{Config{Field: "ids"}, `{"ids":[1],"ids":[2]}`, 2, Duplicate, `field "ids" appears twice`},
		{Config{Field: "ids"}, `{"ids":[1,{"a":1}]}`, 2, ElementType, `element 1 of "ids" is an object; want a string or a number`},
		{Config{Field: "ids"}, `{"ids":[true]}`, 2, ElementType, `element 0 of "ids" is a boolean`},
		{Config{Field: "ids", Key: "id"}, `{"ids":[{"id":1},2]}`, 2, ElementType, `element 1 of "ids" is a number; with key "id" the elements must be objects`},
		{Config{Field: "ids", Key: "id"}, `{"ids":[{"di":1}]}`, 2, KeyMissing, `element 0 of "ids" has no member "id" (the key)`},
		{Config{Field: "ids", Key: "id"}, `{"ids":[{"id":[1]}]}`, 2, ElementType, `element 0 of "ids": key "id" is an array; want a string or a number`},
		{Config{Field: "ids", Key: "id"}, `{"ids":[{"id":1,"id":2}]}`, 2, Duplicate, `element 0 of "ids" has the key "id" twice`},
		{Config{Field: "ids", MaxElements: 2}, `{"ids":[1,2,3]}`, 2, TooMany, `field "ids" has more than 2 elements (max_elements)`},
		{Config{Field: "ids", By: ByIndex}, `{"ids":[1,2,3]}`, 2, Length, `field "ids" has 3 elements; by index needs one per part (partition or branch), 2`},
		{Config{Field: "ids", By: ByIndex}, `{"ids":[1]}`, 2, Length, `has 1 elements`},
		{Config{Field: "ids"}, `{"ids":[1]}`, 0, Length, "no part to split"},
	} {
		out, err := mustNew(t, tc.cfg).Split([]byte(tc.body), tc.n)
		var se *Error
		if !errors.As(err, &se) || se.Kind != tc.kind || !strings.Contains(se.Msg, tc.msg) {
			t.Errorf("%+v %q: %q, %v; want kind %d with %q", tc.cfg, tc.body, out, err, tc.kind, tc.msg)
		}
	}
}

func TestConfigChecks(t *testing.T) {
	long := strings.Repeat("x", 257)
	for _, tc := range []struct {
		cfg Config
		err string // "" for none
	}{
		{Config{Field: "ids"}, ""},
		{Config{Field: "a.b.c.d.e.f.g.h", By: ByIndex, MaxElements: MaxMaxElements}, ""},
		{Config{}, "field is empty"},
		{Config{Field: "a.b.c.d.e.f.g.h.i"}, `field "a.b.c.d.e.f.g.h.i" has 9 names; at most 8`},
		{Config{Field: "a..b"}, `field "a..b": name 2 of the path is empty`},
		{Config{Field: ".a"}, `name 1 of the path is empty`},
		{Config{Field: long}, "is 257 bytes; at most 256"},
		{Config{Field: "a\xff"}, "not valid UTF-8"},
		{Config{Field: "ids", By: "range"}, `by "range": want hash or index`},
		{Config{Field: "ids", By: ByIndex, Key: "id"}, `key "id": a key applies to by hash only`},
		{Config{Field: "ids", Key: long}, "at most 256"},
		{Config{Field: "ids", MaxElements: -1}, "max_elements -1 is below the minimum 1"},
		{Config{Field: "ids", MaxElements: MaxMaxElements + 1}, "max_elements 10000001 is above the maximum 10000000"},
	} {
		_, err := New(tc.cfg)
		if (err == nil) != (tc.err == "") || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%+v: %v; want %q", tc.cfg, err, tc.err)
		}
	}
	var c Config
	c.SetDefaults()
	if c.By != ByHash || c.MaxElements != DefaultMaxElements {
		t.Errorf("defaults: %+v", c)
	}
}

// checkSplit checks what FuzzSplit promises for one split: each body is
// valid JSON, at most as long as the input, and equal to the input with
// the field's array replaced; every element lands in exactly one body, in
// its original order, at the partition its key (or position) says.
func checkSplit(t *testing.T, s *Splitter, body []byte, n int, out [][]byte) {
	t.Helper()
	var orig map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&orig); err != nil {
		t.Fatalf("split a body encoding/json cannot decode as an object: %v", err)
	}
	elems := arrayAt(t, orig, s.path)
	var got []any
	for i, b := range out {
		if b == nil {
			continue
		}
		if !json.Valid(b) {
			t.Fatalf("partition %d: not JSON: %q", i, b)
		}
		if len(b) > len(body) {
			t.Fatalf("partition %d: %d bytes, longer than the body (%d)", i, len(b), len(body))
		}
		var sub map[string]any
		d := json.NewDecoder(bytes.NewReader(b))
		d.UseNumber()
		if err := d.Decode(&sub); err != nil {
			t.Fatal(err)
		}
		mine := arrayAt(t, sub, s.path)
		if len(mine) == 0 {
			t.Fatalf("partition %d: a body with no element", i)
		}
		for j, e := range mine {
			if s.byIndex {
				if j != 0 || fmt.Sprint(e) != fmt.Sprint(elems[i]) {
					t.Fatalf("partition %d holds %v; want element %d", i, mine, i)
				}
			}
			got = append(got, e)
		}
		// The rest of the body is the same.
		setAt(sub, s.path, nil)
		setAt(orig, s.path, nil)
		if fmt.Sprint(sub) != fmt.Sprint(orig) {
			t.Fatalf("partition %d: the body outside the array changed: %v; want %v", i, sub, orig)
		}
		setAt(orig, s.path, elems)
	}
	// The multiset of elements is the original's.
	key := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	a, b := make([]string, 0, len(elems)), make([]string, 0, len(got))
	for _, e := range elems {
		a = append(a, key(e))
	}
	for _, e := range got {
		b = append(b, key(e))
	}
	slices.Sort(a)
	slices.Sort(b)
	if !slices.Equal(a, b) {
		t.Fatalf("elements %v; split into %v", a, b)
	}
}

func arrayAt(t *testing.T, m map[string]any, path []string) []any {
	t.Helper()
	for _, name := range path[:len(path)-1] {
		m = m[name].(map[string]any)
	}
	arr, ok := m[path[len(path)-1]].([]any)
	if !ok {
		t.Fatalf("no array at %v", path)
	}
	return arr
}

func setAt(m map[string]any, path []string, v any) {
	for _, name := range path[:len(path)-1] {
		m = m[name].(map[string]any)
	}
	m[path[len(path)-1]] = v
}

// FuzzSplit: whatever the body, Split never panics, and a split it makes
// keeps its promises (see checkSplit).
func FuzzSplit(f *testing.F) {
	f.Add([]byte(`{"ids":[1,"2",3.0,-4e1,"\u00e9"]}`), uint8(3), uint8(0))
	f.Add([]byte(`{"q":{"ids":[{"id":1},{"id":"x","y":[]}]},"ids":0}`), uint8(2), uint8(1))
	f.Add([]byte(`{"ids":[{"a":1},[],null]}`), uint8(3), uint8(2))
	f.Add([]byte(` {"ids" : [ "a" , "b" ] , "x" : "]" } `), uint8(5), uint8(0))
	f.Add([]byte(`{"ids":[1,],}`), uint8(2), uint8(0))
	f.Add([]byte(`[{"ids":[1]}]`), uint8(1), uint8(0))
	f.Add([]byte(`{"ids":[1],"ids":[2]}`), uint8(1), uint8(0))
	splitters := []*Splitter{
		mustNewF(f, Config{Field: "ids"}),
		mustNewF(f, Config{Field: "q.ids", Key: "id"}),
		mustNewF(f, Config{Field: "ids", By: ByIndex}),
	}
	f.Fuzz(func(t *testing.T, body []byte, n, which uint8) {
		s := splitters[int(which)%len(splitters)]
		parts := int(n%16) + 1
		out, err := s.Split(body, parts)
		if err != nil {
			var se *Error
			if !errors.As(err, &se) || se.Kind == 0 || se.Msg == "" {
				t.Fatalf("error %v (%T) is not a *bodysplit.Error with a kind and a message", err, err)
			}
			return
		}
		if len(out) != parts {
			t.Fatalf("%d bodies for %d partitions", len(out), parts)
		}
		checkSplit(t, s, body, parts, out)
	})
}

func mustNewF(f *testing.F, c Config) *Splitter {
	s, err := New(c)
	if err != nil {
		f.Fatal(err)
	}
	return s
}

// benchBody is a body of about size bytes: n string ids of equal length
// (about size/n bytes each).
func benchBody(n, size int) []byte {
	pad := strings.Repeat("x", max(size/n-16, 0))
	var b bytes.Buffer
	b.Grow(size + 64)
	b.WriteString(`{"ids":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `"user:%08d:%s"`, i, pad)
	}
	b.WriteString(`]}`)
	return b.Bytes()
}

// BenchmarkSplit: a 1 MiB body holding 10,000 ids (about 100 bytes
// each), among 3 and 16 partitions.
func BenchmarkSplit(b *testing.B) {
	body := benchBody(10_000, 1<<20)
	s, err := New(Config{Field: "ids"})
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{3, 16} {
		b.Run(fmt.Sprintf("parts=%d", n), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := s.Split(body, n); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
