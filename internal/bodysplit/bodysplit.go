// Package bodysplit builds per-partition request bodies from one JSON
// request body: the elements of an array field are divided among the
// partitions, by a hash of each element's key or by position (brpc's
// CallMapper UseFieldAsSubRequest), and each partition gets a copy of the
// body holding only its own elements. It is pure: no Caddy, no I/O.
//
// The hash is FNV-1a, 64 bits, of the element's key text, modulo the
// partition count. The key text of a string is its decoded content
// (without quotes), of a number its literal as written ("42", "4.2e1" and
// "42.0" are three different keys). Worked example: the key text
// "user:42" hashes to 0x6c151ea4dcd221c2 = 7788164824035369410, and
// 7788164824035369410 mod 3 = 2, so among 3 partitions it goes to
// partition 2 (the standard test vector: "a" hashes to
// 0xaf63dc4c8601ec8c). The hash and its modulus are part of the
// interface: backends may rely on them, so they never change.
package bodysplit

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/jsonscan"
)

// Ways of assigning elements to partitions (Config.By).
const (
	ByHash  = "hash"
	ByIndex = "index"
)

// Bounds of the options.
const (
	// DefaultMaxElements is max_elements when it is not given.
	DefaultMaxElements = 100_000
	// MaxMaxElements is the largest max_elements accepted.
	MaxMaxElements = 10_000_000
	// MaxDepth is the most member names a field path may have.
	MaxDepth = 8
	// maxName is the longest member name in a path, or key, in bytes.
	maxName = 256
)

// Config says how a JSON request body is split among partitions.
type Config struct {
	// The array to split: the name of a member of the body's top-level
	// object, or a dotted path of member names into nested objects
	// ("query.ids"), at most 8 names deep. Member names on the path may
	// not contain dots. Required.
	Field string `json:"field,omitempty"`

	// How the array's elements are assigned to partitions: "hash" (the
	// default) sends each element to partition FNV-1a-64(key text) mod
	// the partition count, where the key text of a string is its
	// decoded content and of a number its literal as written; "index"
	// sends element i to partition i (the array must have exactly one
	// element per partition).
	By string `json:"by,omitempty"`

	// With by "hash": the member of each element whose value (a string
	// or a number) is hashed; the elements must then be objects. Without
	// it, the elements themselves must be strings or numbers. Not
	// allowed with by "index".
	Key string `json:"key,omitempty"`

	// The most elements the array may have; a body with more is refused.
	// From 1 to 10000000. Default: 100000.
	MaxElements int `json:"max_elements,omitempty"`
}

// SetDefaults writes the defaults into the empty fields.
func (c *Config) SetDefaults() {
	if c.By == "" {
		c.By = ByHash
	}
	if c.MaxElements == 0 {
		c.MaxElements = DefaultMaxElements
	}
}

// Validate checks every option, after SetDefaults.
func (c *Config) Validate() error {
	for _, err := range []error{
		CheckField(c.Field),
		CheckBy(c.By),
		CheckKey(c.By, c.Key),
		CheckMaxElements(c.MaxElements),
	} {
		if err != nil {
			return err
		}
	}
	return nil
}

// CheckField checks the field option: one to MaxDepth non-empty member
// names joined by dots, each at most 256 bytes of UTF-8.
func CheckField(field string) error {
	if field == "" {
		return fmt.Errorf("field is empty: name the array to split, e.g. \"ids\" or \"query.ids\"")
	}
	names := strings.Split(field, ".")
	if len(names) > MaxDepth {
		return fmt.Errorf("field %q has %d names; at most %d", field, len(names), MaxDepth)
	}
	for i, n := range names {
		switch {
		case n == "":
			return fmt.Errorf("field %q: name %d of the path is empty", field, i+1)
		case len(n) > maxName:
			return fmt.Errorf("field %q: name %d of the path is %d bytes; at most %d", field, i+1, len(n), maxName)
		case !utf8.ValidString(n):
			return fmt.Errorf("field %q: name %d of the path is not valid UTF-8", field, i+1)
		}
	}
	return nil
}

// CheckBy checks the by option (after defaults: never empty).
func CheckBy(by string) error {
	if by != ByHash && by != ByIndex {
		return fmt.Errorf("by %q: want hash or index", by)
	}
	return nil
}

// CheckKey checks the key option given by: at most 256 bytes of UTF-8,
// and only with by hash.
func CheckKey(by, key string) error {
	switch {
	case key == "":
		return nil
	case by == ByIndex:
		return fmt.Errorf("key %q: a key applies to by hash only; by index sends element i to part i (partition or branch)", key)
	case len(key) > maxName:
		return fmt.Errorf("key %q is %d bytes; at most %d", key, len(key), maxName)
	case !utf8.ValidString(key):
		return fmt.Errorf("key %q is not valid UTF-8", key)
	}
	return nil
}

// CheckMaxElements checks the max_elements option (after defaults).
func CheckMaxElements(n int) error {
	return bounds.Int("max_elements", n, 1, MaxMaxElements)
}

// Kind says why a body could not be split.
type Kind int

// The kinds of Error.
const (
	NotJSON      Kind = iota + 1 // the body is not one JSON value
	NotObject                    // the body, or an object on the path, is not an object
	FieldMissing                 // a name on the path is not a member
	NotArray                     // the field is not an array
	ElementType                  // an element (or its key) is not of the type needed
	KeyMissing                   // an element object lacks the key member
	TooMany                      // more elements than max_elements
	Length                       // by index: the array's length is not the partition count
	Duplicate                    // a member on the path, or the key, appears twice in one object
)

// Error is why a body could not be split: the client's fault (a 400).
type Error struct {
	Kind Kind
	Msg  string
}

func (e *Error) Error() string { return e.Msg }

func errorf(k Kind, format string, args ...any) *Error {
	return &Error{Kind: k, Msg: fmt.Sprintf(format, args...)}
}

// Splitter splits bodies by one Config.
type Splitter struct {
	field   string
	path    []string
	byIndex bool
	key     string
	max     int
}

// New checks c (with its defaults applied) and returns its Splitter.
func New(c Config) (*Splitter, error) {
	c.SetDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &Splitter{
		field:   c.Field,
		path:    strings.Split(c.Field, "."),
		byIndex: c.By == ByIndex,
		key:     c.Key,
		max:     c.MaxElements,
	}, nil
}

// elem is one element of the array: its bytes, as written, and its
// partition.
type elem struct {
	start, end int
	part       int
}

// Split returns n bodies, one per partition: body with the field's array
// holding only that partition's elements, in their original order, and
// every other byte as written. A partition with no element gets nil. The
// error, for a body that cannot be split, is an *Error.
//
// Each sub-body is at most len(body) long, and together they hold at
// most len(body) + (parts-1) × (len(body) − the array's length + 2)
// bytes, parts being the partitions that get elements: every element is
// in one sub-body, and the rest of the body in each.
func (s *Splitter) Split(body []byte, n int) ([][]byte, error) {
	if n < 1 {
		return nil, errorf(Length, "no part to split %q among", s.field)
	}
	arr, arrStart, err := s.find(body)
	if err != nil {
		return nil, err
	}
	elems, err := s.assign(arr, arrStart, n)
	if err != nil {
		return nil, err
	}

	// Each part's size, then each body allocated once.
	outside := len(body) - len(arr)
	sizes := make([]int, n)
	for _, e := range elems {
		if sizes[e.part] > 0 {
			sizes[e.part]++ // the comma
		}
		sizes[e.part] += e.end - e.start
	}
	out := make([][]byte, n)
	for i := range out {
		if sizes[i] == 0 {
			continue // no element: every element is at least one byte
		}
		b := make([]byte, 0, outside+2+sizes[i])
		b = append(b, body[:arrStart]...)
		out[i] = append(b, '[')
	}
	for _, e := range elems {
		b := out[e.part]
		if len(b) > arrStart+1 {
			b = append(b, ',') // after an element
		}
		out[e.part] = append(b, body[e.start:e.end]...)
	}
	for i, b := range out {
		if b != nil {
			b = append(b, ']')
			out[i] = append(b, body[arrStart+len(arr):]...)
		}
	}
	return out, nil
}

// find returns the field's array, as written, and where it starts in body.
func (s *Splitter) find(body []byte) (arr []byte, start int, err error) {
	if !json.Valid(body) {
		if len(body) == 0 {
			return nil, 0, errorf(NotJSON, "request body is empty; split_body needs a JSON object with the array %q", s.field)
		}
		return nil, 0, errorf(NotJSON, "request body is not valid JSON")
	}
	start = jsonscan.SkipSpace(body, 0)
	val := body[start:jsonscan.SkipValue(body, start)]
	if val[0] != '{' {
		return nil, 0, errorf(NotObject, "request body is %s; split_body needs a JSON object", kindName(val[0]))
	}
	for depth, name := range s.path {
		at := strings.Join(s.path[:depth+1], ".")
		found, dup := member(val, name)
		switch {
		case dup:
			return nil, 0, errorf(Duplicate, "field %q appears twice in its object", at)
		case found == nil:
			return nil, 0, errorf(FieldMissing, "request body has no field %q", at)
		case depth < len(s.path)-1 && found[0] != '{':
			return nil, 0, errorf(NotObject, "field %q is %s; want an object holding %q", at, kindName(found[0]), s.field)
		case depth == len(s.path)-1 && found[0] != '[':
			return nil, 0, errorf(NotArray, "field %q is %s; want an array", at, kindName(found[0]))
		}
		// found is a sub-slice of body: its offset is where it starts.
		start += offset(val, found)
		val = found
	}
	return val, start, nil
}

// offset returns where sub, a sub-slice of outer, starts in outer.
func offset(outer, sub []byte) int {
	return cap(outer) - cap(sub)
}

// assign finds the elements of arr (which starts at body[base]) and their
// partitions.
func (s *Splitter) assign(arr []byte, base, n int) ([]elem, error) {
	var elems []elem
	var err error
	count := 0
	jsonscan.Elements(arr, func(v []byte) bool {
		count++
		if count > s.max {
			err = errorf(TooMany, "field %q has more than %d elements (max_elements)", s.field, s.max)
			return false
		}
		i := count - 1
		part := i
		if !s.byIndex {
			var key []byte
			if key, err = s.keyText(v, i); err != nil {
				return false
			}
			part = int(HashKey(key) % uint64(n))
		}
		if elems == nil {
			// A guess from the first element's size, to grow rarely.
			elems = make([]elem, 0, min(s.max, len(arr)/(len(v)+1)+1))
		}
		start := base + offset(arr, v)
		elems = append(elems, elem{start: start, end: start + len(v), part: part})
		return true
	})
	if err != nil {
		return nil, err
	}
	if s.byIndex && count != n {
		return nil, errorf(Length, "field %q has %d elements; by index needs one per part (partition or branch), %d", s.field, count, n)
	}
	return elems, nil
}

// keyText returns the text hashed for element i, v as written.
func (s *Splitter) keyText(v []byte, i int) ([]byte, error) {
	if s.key == "" {
		if !scalar(v[0]) {
			return nil, errorf(ElementType, "element %d of %q is %s; want a string or a number (or set key to hash a member of object elements)", i, s.field, kindName(v[0]))
		}
		return text(v), nil
	}
	if v[0] != '{' {
		return nil, errorf(ElementType, "element %d of %q is %s; with key %q the elements must be objects", i, s.field, kindName(v[0]), s.key)
	}
	found, dup := member(v, s.key)
	switch {
	case dup:
		return nil, errorf(Duplicate, "element %d of %q has the key %q twice", i, s.field, s.key)
	case found == nil:
		return nil, errorf(KeyMissing, "element %d of %q has no member %q (the key)", i, s.field, s.key)
	case !scalar(found[0]):
		return nil, errorf(ElementType, "element %d of %q: key %q is %s; want a string or a number", i, s.field, s.key, kindName(found[0]))
	}
	return text(found), nil
}

// scalar reports whether a value starting with c is a string or a number.
func scalar(c byte) bool { return c == '"' || c == '-' || (c >= '0' && c <= '9') }

// text is the key text of a string or number as written.
func text(v []byte) []byte {
	if v[0] == '"' {
		return jsonscan.StringText(v)
	}
	return v
}

// kindName names the kind of the value that starts with c, for errors.
func kindName(c byte) string {
	switch c {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// FNV-1a, 64 bits.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// HashKey is the hash that assigns an element whose key text is key to a
// partition (HashKey(key) mod the partition count): FNV-1a, 64 bits.
func HashKey(key []byte) uint64 {
	h := uint64(fnvOffset)
	for _, c := range key {
		h ^= uint64(c)
		h *= fnvPrime
	}
	return h
}

// member returns the value of obj's member name (nil if it has none),
// and whether name appears more than once, which parsers read
// differently (the first or the last), so a split refuses it.
func member(obj []byte, name string) (value []byte, dup bool) {
	jsonscan.Members(obj, func(m jsonscan.Member) bool {
		if string(jsonscan.StringText(m.Key)) != name {
			return true
		}
		if value != nil {
			dup = true
			return false
		}
		value = m.Value
		return true
	})
	return value, dup
}
