package orca

import (
	"encoding/json"

	"github.com/caddy-lbx/lbx/internal/jsonscan"
)

// parseJSON parses the body of a JSON report: one object in the protobuf
// JSON mapping of OrcaLoadReport.
func parseJSON(body string) (Report, error) {
	doc := []byte(body)
	if !json.Valid(doc) {
		return Report{}, fault(ErrSyntax, "", "not valid JSON")
	}
	i := jsonscan.SkipSpace(doc, 0)
	if doc[i] != '{' {
		return Report{}, fault(ErrSyntax, "", "not a JSON object")
	}
	obj := doc[i:jsonscan.SkipValue(doc, i)]
	b := builder{strict: true}
	var err error
	jsonscan.Members(obj, func(m jsonscan.Member) bool {
		err = b.jsonMember(string(jsonscan.StringText(m.Key)), m.Value)
		return err == nil
	})
	if err != nil {
		return Report{}, err
	}
	return b.r, nil
}

// jsonMember sets the top-level member key to the value val.
func (b *builder) jsonMember(key string, val []byte) error {
	if err := b.key(); err != nil {
		return err
	}
	if s, ok := scalarFor(key); ok {
		if isNull(val) {
			return nil // protobuf JSON: null is the field left out
		}
		v, err := jsonNumber(key, val)
		if err != nil {
			return err
		}
		return b.setScalar(s, key, v)
	}
	m := -1
	switch key {
	case "named_metrics", "namedMetrics":
		m = mapNamed
	case "utilization":
		m = mapUtil
	case "request_cost", "requestCost":
		m = mapCost
	}
	if m < 0 || isNull(val) {
		return nil // a key this package does not know: skipped
	}
	if val[0] != '{' {
		return fault(ErrSyntax, mapPrefix[m], "not a JSON object")
	}
	var err error
	jsonscan.Members(val, func(e jsonscan.Member) bool {
		if err = b.key(); err != nil {
			return false
		}
		name := string(jsonscan.StringText(e.Key))
		var v float64
		if v, err = jsonNumber(mapPrefix[m]+"."+name, e.Value); err != nil {
			return false
		}
		err = b.setEntry(m, name, v)
		return err == nil
	})
	return err
}

// jsonNumber reads a JSON number, or a string holding one as protobuf's
// JSON mapping allows ("NaN" and "Infinity" read, and are then refused
// as not finite).
func jsonNumber(key string, val []byte) (float64, error) {
	switch val[0] {
	case '"':
		return number(key, string(val[1:len(val)-1]))
	case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
		return number(key, string(val))
	}
	return 0, fault(ErrValue, key, "not a number")
}

// isNull reports whether a JSON value is null.
func isNull(val []byte) bool { return string(val) == "null" }
