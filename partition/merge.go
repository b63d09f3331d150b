package partition

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
	"github.com/caddy-lbx/lbx/internal/jsonscan"
)

func init() {
	caddy.RegisterModule(JSONMerger{})
	caddy.RegisterModule(ConcatMerger{})
	caddy.RegisterModule(NDJSONMerger{})
	caddy.RegisterModule(FirstMerger{})
}

// Part is the successful (2xx) response of one partition, read in full
// (up to max_response_body, and max_merged_body for all parts together).
type Part struct {
	// Partition index within the scheme.
	Index int
	// Status code and headers of the sub-response (hop-by-hop headers
	// already removed by reverse_proxy).
	Status int
	Header http.Header
	Body   []byte
	// Value is what the merger's Prepare stored for this part.
	Value any
}

// Merged is the response the handler writes.
type Merged struct {
	Status int         // 0 means 200
	Header http.Header // copied to the response; may be nil
	Body   []byte
}

// Merger combines the sub-responses of one fan-out into one response
// (brpc's ResponseMerger). Mergers are modules in the namespace
// http.partition.mergers, so other plugins can add their own.
type Merger interface {
	// Prepare checks one successful sub-response as soon as it arrives
	// and may store a parsed form in p.Value. An error makes the
	// partition count as failed toward fail_limit. Prepare is called
	// concurrently for different parts.
	Prepare(p *Part) error

	// Merge combines the accepted parts, given in partition order. An
	// error, or a body over max_merged_body, fails the whole request
	// (502). Keep memory near the output's size: the handler bounds what
	// it holds, not what a merger allocates.
	Merge(parts []*Part) (Merged, error)
}

// Sufficer is implemented by mergers that can answer before every
// partition has: Enough reports whether n accepted parts suffice, after
// which the handler cancels the other sub-requests.
type Sufficer interface {
	Enough(n int) bool
}

// JSONMerger merges JSON documents the way protobuf's MergeFrom merges
// messages (brpc's default ResponseMerger): objects are merged key by
// key, recursively; arrays are concatenated; any other value (string,
// number, boolean, null), or a value whose type differs from the one
// already there, is overwritten by the later partition's. Partitions are
// merged in index order. A sub-response that is not one valid JSON value
// counts as a failed partition. The output is compact; the keys of
// merged objects come out sorted, and every other value (numbers and
// strings included) is copied as written. The merge works on the bodies'
// bytes, without decoding values it copies, so its memory is about the
// size of its output plus a small record per key of the objects it
// merges.
type JSONMerger struct {
	// The name of a member added to the merged body, when it is an
	// object, that lists the partitions missing from the answer (those
	// that failed within fail_limit) as an array of their indices: [1,3],
	// or [] when the answer is complete. It replaces a member of the same
	// name from the partitions. A merged body that is not an object gets
	// no member (the X-Partition-Missing header says it still). At most
	// 256 bytes of UTF-8. Default: none.
	MissingField string `json:"missing_field,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (JSONMerger) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.partition.mergers.json",
		New: func() caddy.Module { return new(JSONMerger) },
	}
}

// Prepare checks that the body is one JSON value.
func (JSONMerger) Prepare(p *Part) error {
	if json.Valid(p.Body) {
		return nil
	}
	// Unmarshal checks the whole syntax before it decodes anything: this
	// only finds the error, without allocating a decoded copy.
	err := json.Unmarshal(p.Body, new(struct{}))
	if err == nil {
		err = errors.New("not one JSON value")
	}
	return fmt.Errorf("invalid JSON: %v", err)
}

// Validate checks missing_field.
func (m JSONMerger) Validate() error {
	if m.MissingField == "" {
		return nil
	}
	return checkMissingField(m.MissingField)
}

// Merge merges the parts' bodies, which Prepare checked, as a complete
// answer.
func (m JSONMerger) Merge(parts []*Part) (Merged, error) {
	return m.MergePartial(parts, nil)
}

// MergePartial merges the parts' bodies, which Prepare checked, and adds
// the missing partitions' indices as missing_field when it is set.
func (m JSONMerger) MergePartial(parts []*Part, missing []int) (Merged, error) {
	vals := make([][]byte, len(parts))
	size := len("null\n")
	for i, p := range parts {
		vals[i] = bytes.TrimSpace(p.Body)
		size += len(vals[i])
	}
	// The output is never longer than its inputs together.
	out := make([]byte, 0, size)
	if len(vals) == 0 {
		out = append(out, "null"...)
	} else {
		out = appendMergedJSON(out, vals)
	}
	out = append(out, '\n')
	if m.MissingField != "" {
		out = withMissing(out, m.MissingField, missing)
	}
	return Merged{
		Header: http.Header{"Content-Type": {"application/json"}},
		Body:   out,
	}, nil
}

// appendMergedJSON appends to out the merge of vals, valid JSON values
// without surrounding space, in partition order.
func appendMergedJSON(out []byte, vals [][]byte) []byte {
	// A value of another kind than the one before replaces it: only the
	// run of objects, or of arrays, that ends with the last value counts.
	last := vals[len(vals)-1]
	kind := last[0]
	if kind != '{' && kind != '[' {
		return appendCompact(out, last)
	}
	first := len(vals) - 1
	for first > 0 && vals[first-1][0] == kind {
		first--
	}
	vals = vals[first:]
	if len(vals) == 1 {
		return appendCompact(out, last)
	}

	if kind == '[' {
		out = append(out, '[')
		n := 0
		for _, v := range vals {
			inner := bytes.TrimSpace(v[1 : len(v)-1])
			if len(inner) == 0 {
				continue
			}
			if n > 0 {
				out = append(out, ',')
			}
			out = appendCompact(out, inner)
			n++
		}
		return append(out, ']')
	}

	var ms []member
	for i, v := range vals {
		ms = appendMembers(ms, v, i)
	}
	// Stable: members of one key stay in partition order.
	slices.SortStableFunc(ms, func(a, b member) int { return bytes.Compare(a.name, b.name) })
	out = append(out, '{')
	var group [][]byte
	for i := 0; i < len(ms); {
		j := i + 1
		for j < len(ms) && bytes.Equal(ms[j].name, ms[i].name) {
			j++
		}
		group = group[:0]
		for k := i; k < j; k++ {
			// A key repeated within one object: the last one wins, as
			// when decoding.
			if k+1 < j && ms[k+1].obj == ms[k].obj {
				continue
			}
			group = append(group, ms[k].val)
		}
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, ms[i].key...)
		out = append(out, ':')
		out = appendMergedJSON(out, group)
		i = j
	}
	return append(out, '}')
}

// member is one member of an object being merged: its key as written
// (quoted), the key's text (for comparison), its value, and which of the
// merged objects it is from.
type member struct {
	key, name, val []byte
	obj            int
}

// appendMembers appends the members of obj, a valid JSON object, to ms.
func appendMembers(ms []member, obj []byte, from int) []member {
	jsonscan.Members(obj, func(m jsonscan.Member) bool {
		ms = append(ms, member{key: m.Key, name: jsonscan.StringText(m.Key), val: m.Value, obj: from})
		return true
	})
	return ms
}

// appendCompact appends src, valid JSON (or a run of array elements),
// without the space between tokens.
func appendCompact(dst, src []byte) []byte {
	start := 0
	for i := 0; i < len(src); i++ {
		switch src[i] {
		case '"':
			i = jsonscan.SkipString(src, i) - 1
		case ' ', '\t', '\n', '\r':
			dst = append(dst, src[start:i]...)
			start = i + 1
		}
	}
	return append(dst, src[start:]...)
}

// ConcatMerger concatenates the bodies in partition order. The
// Content-Type is the first part's.
type ConcatMerger struct{}

// CaddyModule returns the Caddy module information.
func (ConcatMerger) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.partition.mergers.concat",
		New: func() caddy.Module { return new(ConcatMerger) },
	}
}

// Prepare accepts any body.
func (ConcatMerger) Prepare(*Part) error { return nil }

// Merge concatenates.
func (ConcatMerger) Merge(parts []*Part) (Merged, error) {
	n := 0
	for _, p := range parts {
		n += len(p.Body)
	}
	body := make([]byte, 0, n)
	for _, p := range parts {
		body = append(body, p.Body...)
	}
	m := Merged{Body: body}
	if len(parts) > 0 {
		if ct := parts[0].Header.Get("Content-Type"); ct != "" {
			m.Header = http.Header{"Content-Type": {ct}}
		}
	}
	return m, nil
}

// NDJSONMerger joins newline-delimited JSON (or any line-oriented) bodies
// in partition order, making sure each part ends with a newline. Empty
// bodies contribute nothing. Lines are not parsed. The Content-Type is
// application/x-ndjson.
type NDJSONMerger struct{}

// CaddyModule returns the Caddy module information.
func (NDJSONMerger) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.partition.mergers.ndjson",
		New: func() caddy.Module { return new(NDJSONMerger) },
	}
}

// Prepare accepts any body.
func (NDJSONMerger) Prepare(*Part) error { return nil }

// Merge joins the parts.
func (NDJSONMerger) Merge(parts []*Part) (Merged, error) {
	var buf bytes.Buffer
	n := 0
	for _, p := range parts {
		n += len(p.Body) + 1
	}
	buf.Grow(n)
	for _, p := range parts {
		if len(p.Body) == 0 {
			continue
		}
		buf.Write(p.Body)
		if p.Body[len(p.Body)-1] != '\n' {
			buf.WriteByte('\n')
		}
	}
	return Merged{
		Header: http.Header{"Content-Type": {"application/x-ndjson"}},
		Body:   buf.Bytes(),
	}, nil
}

// FirstMerger answers with the first successful sub-response to arrive —
// its status, headers and body — and cancels the others (a "race" of the
// partitions, e.g. for replicated data).
type FirstMerger struct{}

// CaddyModule returns the Caddy module information.
func (FirstMerger) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.partition.mergers.first",
		New: func() caddy.Module { return new(FirstMerger) },
	}
}

// Prepare accepts any successful response.
func (FirstMerger) Prepare(*Part) error { return nil }

// Enough: one part is enough.
func (FirstMerger) Enough(n int) bool { return n >= 1 }

// Merge returns the first part.
func (FirstMerger) Merge(parts []*Part) (Merged, error) {
	if len(parts) == 0 {
		return Merged{}, errors.New("no part to answer with")
	}
	p := parts[0]
	return Merged{Status: p.Status, Header: p.Header, Body: p.Body}, nil
}

// UnmarshalCaddyfile sets up the merger from Caddyfile tokens:
//
//	merge json [{
//		missing_field <name>
//	}]
func (m *JSONMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	// errors start "merge json"; the directive (partition, parallel)
	// that reads the merger puts its name before it
	what := "merge json"
	return caddyopt.Block(d, what, func(opt string) error {
		if opt != "missing_field" {
			return caddyopt.Unknown(d, what, "missing_field")
		}
		v, err := caddyopt.OneArg(d, what)
		if err != nil {
			return err
		}
		m.MissingField = v
		return caddyopt.Checked(d, what, checkMissingField(v))
	})
}

// UnmarshalCaddyfile sets up the merger from Caddyfile tokens; it takes no
// options:
//
//	merge concat|ndjson|first
func (*ConcatMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return unmarshalMerger(d) }

// UnmarshalCaddyfile: see ConcatMerger.UnmarshalCaddyfile.
func (*NDJSONMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return unmarshalMerger(d) }

// UnmarshalCaddyfile: see ConcatMerger.UnmarshalCaddyfile.
func (*FirstMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return unmarshalMerger(d) }

// unmarshalMerger reads the `merge <name>` line of a merger that has no
// options.
func unmarshalMerger(d *caddyfile.Dispenser) error {
	d.Next() // the merger's name
	return caddyopt.NoOptions(d, "merge "+d.Val())
}

// Interface guards
var (
	_ Merger                = (*JSONMerger)(nil)
	_ PartialMerger         = (*JSONMerger)(nil)
	_ caddy.Validator       = (*JSONMerger)(nil)
	_ Merger                = (*ConcatMerger)(nil)
	_ Merger                = (*NDJSONMerger)(nil)
	_ Merger                = (*FirstMerger)(nil)
	_ Sufficer              = (*FirstMerger)(nil)
	_ caddyfile.Unmarshaler = (*JSONMerger)(nil)
	_ caddyfile.Unmarshaler = (*ConcatMerger)(nil)
	_ caddyfile.Unmarshaler = (*NDJSONMerger)(nil)
	_ caddyfile.Unmarshaler = (*FirstMerger)(nil)
)
