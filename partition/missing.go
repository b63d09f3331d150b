package partition

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/caddy-lbx/lbx/internal/jsonscan"
)

// Partial answers: when fail_limit lets some partitions fail, the merged
// answer says which are missing, in a header and, with the json merger's
// missing_field, in the body.

// MissingHeader is the response header of a merged answer that lists the
// partitions missing from it, e.g. "1, 3"; absent when none is.
const MissingHeader = "X-Partition-Missing"

// PartialMerger is a Merger that can say in the merged body which
// partitions are missing from it.
type PartialMerger interface {
	Merger
	// MergePartial is Merge for an answer from which the partitions of
	// the indices missing (in increasing order, maybe none) are missing.
	MergePartial(parts []*Part, missing []int) (Merged, error)
}

// missingParts returns the indices of the partitions missing from a
// merged answer: those that failed, and not because the merger had
// enough without them (canceled), nor because they were skipped.
func missingParts(outcomes []*outcome) []int {
	var missing []int
	for i, o := range outcomes {
		if o != nil && !o.skipped && o.err != nil && !o.canceled {
			missing = append(missing, i)
		}
	}
	return missing
}

// mergeParts merges parts, telling the merger which partitions are
// missing when it can say so.
func mergeParts(m Merger, parts []*Part, missing []int) (Merged, error) {
	if pm, ok := m.(PartialMerger); ok {
		return pm.MergePartial(parts, missing)
	}
	return m.Merge(parts)
}

// missingHeader is MissingHeader's value: the indices, comma-space
// separated.
func missingHeader(rd round, missing []int) string {
	var b strings.Builder
	for i, m := range missing {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(rd.key(m))
	}
	return b.String()
}

// maxMissingField is the longest missing_field name, in bytes.
const maxMissingField = 256

// checkMissingField checks the json merger's missing_field name.
func checkMissingField(name string) error {
	switch {
	case name == "":
		return errors.New("missing_field is empty: give the name of the member that lists the missing partitions")
	case len(name) > maxMissingField:
		return fmt.Errorf("missing_field %q is %d bytes; at most %d", name, len(name), maxMissingField)
	case !utf8.ValidString(name):
		return fmt.Errorf("missing_field %q is not valid UTF-8, so not a JSON member name", name)
	}
	return nil
}

// withMissing returns body, a merged JSON value (compact, maybe followed
// by a newline), with a member name: the array of missing indices added
// to it when it is an object, in front of the first member whose name
// sorts after it (the merged objects' keys are sorted), replacing any
// member of that name. Any other value is returned as it is.
func withMissing(body []byte, name string, missing []int) []byte {
	v := bytes.TrimSpace(body)
	if len(v) == 0 || v[0] != '{' {
		return body
	}
	key, _ := json.Marshal(name) // a valid UTF-8 string: never fails
	val := make([]byte, 0, 2+4*len(missing))
	val = append(val, '[')
	for i, m := range missing {
		if i > 0 {
			val = append(val, ',')
		}
		val = strconv.AppendInt(val, int64(m), 10)
	}
	val = append(val, ']')

	out := make([]byte, 0, len(body)+len(key)+len(val)+3)
	out = append(out, '{')
	n := 0
	add := func(k, v []byte) {
		if n > 0 {
			out = append(out, ',')
		}
		out = append(out, k...)
		out = append(out, ':')
		out = append(out, v...)
		n++
	}
	placed := false
	jsonscan.Members(v, func(m jsonscan.Member) bool {
		mn := string(jsonscan.StringText(m.Key))
		if mn == name {
			return true
		}
		if !placed && mn > name {
			add(key, val)
			placed = true
		}
		add(m.Key, m.Value)
		return true
	})
	if !placed {
		add(key, val)
	}
	return append(out, '}', '\n')
}
