package jsonfield

import (
	"encoding/json"
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

// TestCheckExpressionMatcher: the forms Caddy decodes pass, and every
// object form it would panic on is an error naming what is wrong.
func TestCheckExpressionMatcher(t *testing.T) {
	for raw, want := range map[string]string{
		`"{path} == '/'"`:                "",
		`{"expr": "true", "name": "n"}`:  "",
		`{"x": 1}`:                       "member expr is missing",
		`{"expr": "true"}`:               "member name is missing",
		`{"expr": 1, "name": "n"}`:       "member expr must be a string, got 1",
		`{"expr": "true", "name": null}`: "member name must be a string, got null",
		`7`:                              "want a CEL expression as a string",
		`["true"]`:                       "want a CEL expression as a string",
		`null`:                           "want a CEL expression as a string",
	} {
		err := CheckExpressionMatcher(caddy.ModuleMap{"expression": json.RawMessage(raw)})
		switch {
		case want == "" && err != nil:
			t.Errorf("%s: %v; want no error", raw, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("%s: %v; want an error containing %q", raw, err, want)
		}
	}
	if err := CheckExpressionMatcher(caddy.ModuleMap{"path": json.RawMessage(`{"x": 1}`)}); err != nil {
		t.Errorf("a set without expression: %v", err)
	}
}
