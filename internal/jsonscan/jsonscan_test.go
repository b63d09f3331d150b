package jsonscan

import (
	"fmt"
	"testing"
)

func TestScan(t *testing.T) {
	obj := []byte(`{ "a" : [1, {"b":"]"}] ,"c\"d":"x\\"  , "e\u0066":null}`)
	var got []string
	Members(obj, func(m Member) bool {
		got = append(got, fmt.Sprintf("%s=%s", StringText(m.Key), m.Value))
		return true
	})
	want := []string{`a=[1, {"b":"]"}]`, `c"d="x\\"`, `ef=null`}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("members %q; want %q", got, want)
	}
	got = nil
	Elements([]byte(`[ 1 ,"a,b", [2,3],{"x":[]} ,-4.5e1]`), func(e []byte) bool {
		got = append(got, string(e))
		return len(got) < 4 // stops after the fourth
	})
	want = []string{`1`, `"a,b"`, `[2,3]`, `{"x":[]}`}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("elements %q; want %q", got, want)
	}
	Elements([]byte(`[ ]`), func([]byte) bool { t.Error("an element in an empty array"); return true })
	Members([]byte(`{ }`), func(Member) bool { t.Error("a member in an empty object"); return true })
	if n := SkipValue([]byte(`12.5e3]`), 0); n != 6 {
		t.Errorf("SkipValue of a number: %d", n)
	}
}
