// Package jsonscan finds where the tokens of a JSON document end,
// without decoding them. Its functions work on valid JSON (check it first
// with json.Valid): they only find boundaries, so that the mergers and the
// body splitter can copy values as written instead of decoding and
// re-encoding them.
package jsonscan

import (
	"bytes"
	"encoding/json"
)

// SkipSpace returns the index of the first byte at or after i that is not
// JSON white space (len(b) if there is none).
func SkipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// SkipString returns the index after the string that starts at b[i].
func SkipString(b []byte, i int) int {
	for i++; ; i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
}

// SkipValue returns the index after the value that starts at b[i].
func SkipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return SkipString(b, i)
	case '{', '[':
		depth := 0
		for ; ; i++ {
			switch b[i] {
			case '"':
				i = SkipString(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
		}
	}
	for i < len(b) {
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
		i++
	}
	return i
}

// StringText returns the text of a quoted JSON string: the bytes between
// the quotes when it has no escapes (no allocation), else its decoded
// content.
func StringText(quoted []byte) []byte {
	inner := quoted[1 : len(quoted)-1]
	if bytes.IndexByte(inner, '\\') < 0 {
		return inner
	}
	var s string
	_ = json.Unmarshal(quoted, &s) // valid: the caller checked the document
	return []byte(s)
}

// Member is one member of an object: its key as written (quoted) and its
// value as written.
type Member struct {
	Key, Value []byte
}

// Members calls f with each member of obj, a valid JSON object without
// surrounding space, in order, and stops when f returns false.
func Members(obj []byte, f func(m Member) bool) {
	i := 1
	for {
		i = SkipSpace(obj, i)
		switch obj[i] {
		case '}':
			return
		case ',':
			i = SkipSpace(obj, i+1)
		}
		end := SkipString(obj, i)
		key := obj[i:end]
		i = SkipSpace(obj, SkipSpace(obj, end)+1) // past the colon
		vend := SkipValue(obj, i)
		if !f(Member{Key: key, Value: obj[i:vend]}) {
			return
		}
		i = vend
	}
}

// Elements calls f with each element of arr, a valid JSON array without
// surrounding space, as written, in order, and stops when f returns false.
func Elements(arr []byte, f func(elem []byte) bool) {
	i := 1
	for {
		i = SkipSpace(arr, i)
		switch arr[i] {
		case ']':
			return
		case ',':
			i = SkipSpace(arr, i+1)
		}
		end := SkipValue(arr, i)
		if !f(arr[i:end]) {
			return
		}
		i = end
	}
}
