package partition

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(JSONMerger{})
	caddy.RegisterModule(ConcatMerger{})
	caddy.RegisterModule(NDJSONMerger{})
	caddy.RegisterModule(FirstMerger{})
}

// Part is the successful (2xx) response of one partition, read in full
// (up to max_response_body).
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
// http.handlers.partition.merge, so other plugins can add their own.
type Merger interface {
	// Prepare checks one successful sub-response as soon as it arrives
	// and may store a parsed form in p.Value. An error makes the
	// partition count as failed toward fail_limit. Prepare is called
	// concurrently for different parts.
	Prepare(p *Part) error

	// Merge combines the accepted parts, given in partition order. An
	// error fails the whole request (502).
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
// counts as a failed partition. Numbers are kept exactly as written;
// object keys come out sorted.
type JSONMerger struct{}

// CaddyModule returns the Caddy module information.
func (JSONMerger) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.partition.merge.json",
		New: func() caddy.Module { return new(JSONMerger) },
	}
}

// Prepare parses the body.
func (JSONMerger) Prepare(p *Part) error {
	v, err := decodeJSON(p.Body)
	if err != nil {
		return err
	}
	p.Value = v
	return nil
}

func decodeJSON(body []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("invalid JSON: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("invalid JSON: data after the top-level value")
	}
	return v, nil
}

// Merge merges the parsed parts.
func (JSONMerger) Merge(parts []*Part) (Merged, error) {
	var acc any
	for i, p := range parts {
		if i == 0 {
			acc = p.Value
			continue
		}
		acc = MergeJSON(acc, p.Value)
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(acc); err != nil {
		return Merged{}, err
	}
	return Merged{
		Header: http.Header{"Content-Type": {"application/json"}},
		Body:   buf.Bytes(),
	}, nil
}

// MergeJSON merges src into dst (values as decoded by encoding/json) and
// returns the result: objects recursively, arrays concatenated, anything
// else replaced by src. dst may be modified.
func MergeJSON(dst, src any) any {
	switch s := src.(type) {
	case map[string]any:
		d, ok := dst.(map[string]any)
		if !ok {
			return s
		}
		for k, sv := range s {
			if dv, ok := d[k]; ok {
				d[k] = MergeJSON(dv, sv)
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

// ConcatMerger concatenates the bodies in partition order. The
// Content-Type is the first part's.
type ConcatMerger struct{}

// CaddyModule returns the Caddy module information.
func (ConcatMerger) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.partition.merge.concat",
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
		ID:  "http.handlers.partition.merge.ndjson",
		New: func() caddy.Module { return new(NDJSONMerger) },
	}
}

// Prepare accepts any body.
func (NDJSONMerger) Prepare(*Part) error { return nil }

// Merge joins the parts.
func (NDJSONMerger) Merge(parts []*Part) (Merged, error) {
	var buf bytes.Buffer
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
		ID:  "http.handlers.partition.merge.first",
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

// UnmarshalCaddyfile sets up the merger from Caddyfile tokens; it takes no
// options:
//
//	merge json|concat|ndjson|first
func (*JSONMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return noOptions(d) }

// UnmarshalCaddyfile: see JSONMerger.UnmarshalCaddyfile.
func (*ConcatMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return noOptions(d) }

// UnmarshalCaddyfile: see JSONMerger.UnmarshalCaddyfile.
func (*NDJSONMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return noOptions(d) }

// UnmarshalCaddyfile: see JSONMerger.UnmarshalCaddyfile.
func (*FirstMerger) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { return noOptions(d) }

func noOptions(d *caddyfile.Dispenser) error {
	d.Next() // the merger's name
	name := d.Val()
	if d.NextArg() {
		return d.Errf("merge %s takes no arguments", name)
	}
	if d.NextBlock(d.Nesting()) {
		return d.Errf("merge %s takes no options", name)
	}
	return nil
}

// Interface guards
var (
	_ Merger                = (*JSONMerger)(nil)
	_ Merger                = (*ConcatMerger)(nil)
	_ Merger                = (*NDJSONMerger)(nil)
	_ Merger                = (*FirstMerger)(nil)
	_ Sufficer              = (*FirstMerger)(nil)
	_ caddyfile.Unmarshaler = (*JSONMerger)(nil)
	_ caddyfile.Unmarshaler = (*ConcatMerger)(nil)
	_ caddyfile.Unmarshaler = (*NDJSONMerger)(nil)
	_ caddyfile.Unmarshaler = (*FirstMerger)(nil)
)
