package jsonfield

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

type inner struct {
	Interval caddy.Duration `json:"interval,omitempty"`
}

func (i *inner) UnmarshalJSON(b []byte) error {
	type plain inner
	return Decode(b, (*plain)(i))
}

type outer struct {
	Decay   caddy.Duration `json:"decay,omitempty"`
	Count   int            `json:"count,omitempty"`
	Inner   *inner         `json:"inner,omitempty"`
	skipped int
}

func TestDecodeNamesTheField(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{`{"decay":"soon"}`, `decay: time: invalid duration "soon"`},
		{`{"count":1,"inner":{"interval":"often"}}`, `inner: interval: time: invalid duration "often"`},
		{`{"count":"many"}`, `outer.count`}, // json's own message names it
		{`{"nope":1}`, `unknown field "nope"`},
		{`{"inner":{"nope":1}}`, `unknown field "nope"`},
		{`{"decay":`, `unexpected EOF`},
	} {
		var o outer
		err := Decode([]byte(tt.in), &o)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Decode(%s) = %v; want an error containing %q", tt.in, err, tt.want)
		}
	}
	var o outer
	if err := Decode([]byte(`{"decay":"1s","count":2,"inner":{"interval":"3s"}}`), &o); err != nil {
		t.Fatal(err)
	}
	if o.Decay != caddy.Duration(1e9) || o.Count != 2 || o.Inner == nil || o.Inner.Interval != caddy.Duration(3e9) {
		t.Errorf("decoded %+v", o)
	}
}
