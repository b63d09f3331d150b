package partition

import (
	"strings"
	"testing"
)

func TestParseTag(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Tag
		err  string // substring; "" means valid
	}{
		{in: "0/1", want: Tag{0, 1}},
		{in: "2/3", want: Tag{2, 3}},
		{in: "0/1024", want: Tag{0, 1024}},
		{in: "3/3", err: `invalid partition tag "3/3": partition index 3 must be less than the partition count 3`},
		{in: "0/0", err: `"0/0": partition count must be at least 1`},
		{in: "-1/3", err: `partition index "-1" is not a non-negative integer`},
		{in: "+1/3", err: `partition index "+1" is not`},
		{in: "1/x", err: `partition count "x" is not a positive integer`},
		{in: "1.5/3", err: `partition index "1.5"`},
		{in: "1/3.0", err: `partition count "3.0"`},
		{in: " 1/3", err: `partition index " 1"`},
		{in: "1/", err: `partition count ""`},
		{in: "/3", err: `partition index ""`},
		{in: "13", err: `invalid partition tag "13": want N/M`},
		{in: "1/2/3", err: `partition count "2/3"`},
		{in: "0/1025", err: "exceeds the maximum of 1024"},
		{in: "0/99999999999", err: `partition count "99999999999"`},
	} {
		got, err := ParseTag(tc.in)
		if tc.err == "" {
			if err != nil || got != tc.want {
				t.Errorf("ParseTag(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
			if got.String() != tc.in {
				t.Errorf("Tag.String() = %q; want %q", got.String(), tc.in)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("ParseTag(%q) error %v; want it to contain %q", tc.in, err, tc.err)
		}
	}
}

func TestCheckDial(t *testing.T) {
	for _, ok := range []string{"127.0.0.1:8004", "localhost:80", "[::1]:9000", "unix//run/x.sock"} {
		if _, err := checkDial(ok); err != nil {
			t.Errorf("checkDial(%q): %v", ok, err)
		}
	}
	for in, want := range map[string]string{
		"http://127.0.0.1:80": "without a scheme",
		"127.0.0.1:80-82":     "exactly one socket",
		":80":                 "missing host",
		"127.0.0.1:x":         "invalid upstream address",
		"foo":                 `invalid upstream address "foo": missing port; give host:port, e.g. foo:80`,
		"10.0.0.1":            "missing port",
		"foo:0":               "missing port",
	} {
		if _, err := checkDial(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("checkDial(%q) = %v; want an error containing %q", in, err, want)
		}
	}
}

func TestParseNamingFile(t *testing.T) {
	data := `# the seed's server_list
0.0.0.0:8004  0/3  # The first partition of the three
0.0.0.0:8004  1/3   # and so forth
0.0.0.0:8004  2/3

   # indented comment
0.0.0.0:8005  0/4
0.0.0.0:8005  0/4    # duplicate: collapses
0.0.0.0:8005  4/4    # bad: index out of range
0.0.0.0:8006         # bad: no tag
0.0.0.0:8006 1/4 extra
#0.0.0.0:8004  2/3
0.0.0.0:8004  1/4    # same address, another tag: kept
nonsense:port 1/4
`
	entries, bad := ParseNamingFile("server_list", []byte(data))
	want := []Entry{
		{"0.0.0.0:8004", Tag{0, 3}},
		{"0.0.0.0:8004", Tag{1, 3}},
		{"0.0.0.0:8004", Tag{2, 3}},
		{"0.0.0.0:8005", Tag{0, 4}},
		{"0.0.0.0:8004", Tag{1, 4}},
	}
	if len(entries) != len(want) {
		t.Fatalf("entries %v; want %v", entries, want)
	}
	for i := range want {
		if entries[i] != want[i] {
			t.Errorf("entry %d: %v; want %v", i, entries[i], want[i])
		}
	}
	wantBad := []string{
		`server_list:9: invalid partition tag "4/4": partition index 4 must be less than the partition count 4`,
		`server_list:10: upstream "0.0.0.0:8006" has no partition tag`,
		`server_list:11: want "address N/M", got 3 fields`,
		`server_list:14: invalid upstream address "nonsense:port"`,
	}
	if len(bad) != len(wantBad) {
		t.Fatalf("bad lines %v; want %d", bad, len(wantBad))
	}
	for i, w := range wantBad {
		if !strings.HasPrefix(bad[i].Error(), w) {
			t.Errorf("bad line %d: %q; want prefix %q", i, bad[i].Error(), w)
		}
	}
}

func TestBuildLayout(t *testing.T) {
	e := func(dial, tag string) Entry {
		tg, err := ParseTag(tag)
		if err != nil {
			t.Fatal(err)
		}
		return Entry{Dial: dial, Tag: tg}
	}
	l, err := buildLayout([]Entry{
		e("a:1", "0/4"), e("a:1", "1/4"), e("b:1", "0/3"), e("b:1", "1/3"), e("c:1", "1/4"),
	}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.schemes) != 2 || l.schemes[0].count != 3 || l.schemes[1].count != 4 {
		t.Fatalf("schemes %+v", l.schemes)
	}
	if l.schemes[0].capacity(0) != 0 || l.schemes[1].capacity(0) != 0 {
		t.Errorf("incomplete schemes must have capacity 0")
	}
	if got := l.describe(0); got != "3 partitions: capacity 0 (no usable replica for p2); 4 partitions: capacity 0 (no usable replica for p2, p3)" {
		t.Errorf("describe: %q", got)
	}
	if s := l.schemes[1]; len(s.parts[1]) != 2 || s.parts[0][0] != s.parts[1][0] {
		t.Errorf("one replica per address, shared by its tags: %+v", s.parts)
	}
	// Replica state carries over to the next layout.
	l2, err := buildLayout([]Entry{e("a:1", "0/1")}, l, nil)
	if err != nil {
		t.Fatal(err)
	}
	if l2.byAddr["a:1"] != l.byAddr["a:1"] {
		t.Error("replica state was not carried over")
	}
	if l2.schemes[0].capacity(0) != 1 {
		t.Errorf("capacity %d; want 1", l2.schemes[0].capacity(0))
	}

	var many []Entry
	for m := 1; m <= MaxSchemes+1; m++ {
		many = append(many, e("a:1", "0/"+itoa(m)))
	}
	if _, err := buildLayout(many, nil, nil); err == nil || !strings.Contains(err.Error(), "9 partition schemes (partition counts 1, 2, 3, 4, 5, 6, 7, 8, 9); at most 8 may coexist") {
		t.Errorf("9 schemes: %v", err)
	}
	if _, err := buildLayout(many[:MaxSchemes], nil, nil); err != nil {
		t.Errorf("8 schemes: %v", err)
	}
}

func itoa(n int) string { return Tag{0, n}.String()[2:] }
