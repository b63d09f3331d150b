// Package jsonfield decodes a module's JSON configuration so that a value
// that fails to decode is reported with its option's name. encoding/json
// names the field only for a type mismatch; an error from a value's own
// decoder (a caddy.Duration that is not a duration) arrives bare, and in a
// config of hundreds of lines "time: invalid duration" points nowhere.
package jsonfield

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"sort"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// Decode unmarshals data into v, a pointer to a struct, strictly (unknown
// fields are errors, as Caddy decodes modules). When a value fails to
// decode, the error starts with its JSON key: `interval: time: invalid
// duration "soon"`. A type that decodes itself with Decode nests the keys:
// `outlier: interval: …`.
//
// A module's UnmarshalJSON calls it with a pointer to a defined type that
// has the module's fields but not its methods, so it does not recurse:
//
//	func (m *Module) UnmarshalJSON(b []byte) error {
//		type plain Module
//		return jsonfield.Decode(b, (*plain)(m))
//	}
func Decode(data []byte, v any) error {
	err := strict(data, v)
	if err == nil {
		return nil
	}
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	if errors.As(err, &syntaxErr) || errors.As(err, &typeErr) && typeErr.Field != "" {
		return err // json names the field, or there is none to name
	}
	if key := failingKey(data, v); key != "" {
		return fmt.Errorf("%s: %w", key, err)
	}
	return err
}

func strict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

// failingKey returns the first key of the JSON object data whose value
// does not decode into its field of the struct v points to, or "".
func failingKey(data []byte, v any) string {
	var fields map[string]json.RawMessage
	if json.Unmarshal(data, &fields) != nil {
		return ""
	}
	t := reflect.TypeOf(v)
	if t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return ""
	}
	byKey := fieldsByKey(t.Elem())
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		ft, ok := byKey[k]
		if !ok {
			continue // unknown: the decoder's own error says so
		}
		if strict(fields[k], reflect.New(ft).Interface()) != nil {
			return k
		}
	}
	return ""
}

// fieldsByKey maps the JSON keys of struct type t to their field types.
func fieldsByKey(t reflect.Type) map[string]reflect.Type {
	out := make(map[string]reflect.Type, t.NumField())
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
			// encoding/json promotes an embedded struct's fields.
			maps.Copy(out, fieldsByKey(f.Type))
			continue
		}
		switch name {
		case "-":
			continue
		case "":
			name = f.Name
		}
		out[name] = f.Type
	}
	return out
}

// CheckExpressionMatcher checks the expression matcher of a matcher set,
// if it has one, before Caddy decodes it: Caddy's (v2.11) takes a string,
// or an object with the string members expr and name, and panics on any
// other object (one without name among them) instead of returning an
// error, which would cut a POST /load short with no answer.
func CheckExpressionMatcher(set caddy.ModuleMap) error {
	raw, ok := set["expression"]
	if !ok || isString(raw) {
		return nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
		return fmt.Errorf("expression: want a CEL expression as a string, or an object with expr and name; got %s", bytes.TrimSpace(raw))
	}
	for _, k := range []string{"expr", "name"} {
		if obj[k] == nil {
			return fmt.Errorf("expression: member %s is missing; Caddy needs both expr and name in the object form", k)
		}
		if !isString(obj[k]) {
			return fmt.Errorf("expression: member %s must be a string, got %s", k, bytes.TrimSpace(obj[k]))
		}
	}
	return nil
}

// isString reports whether raw is a JSON string (null is not).
func isString(raw json.RawMessage) bool {
	var s string
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && raw[0] == '"' && json.Unmarshal(raw, &s) == nil
}
