// Package caddyopt holds the Caddyfile parsing steps every lbx directive,
// global option and module block shares, so that their errors read the
// same everywhere: "<what>: <option> specified more than once",
// "<what>: unknown option "x" (want a, b or c)".
package caddyopt

import (
	"fmt"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Once rejects an option that appears twice in one block.
type Once struct {
	what string
	seen map[string]bool
}

// NewOnce starts tracking the options of one block; errors start with
// what (the directive or option the block belongs to).
func NewOnce(what string) *Once { return &Once{what: what, seen: make(map[string]bool)} }

// Check records the option the dispenser is on and fails when it was seen
// before.
func (o *Once) Check(d *caddyfile.Dispenser) error {
	opt := d.Val()
	if o.seen[opt] {
		return d.Errf("%s: %s specified more than once", o.what, opt)
	}
	o.seen[opt] = true
	return nil
}

// OneArg reads exactly one argument for the option the dispenser is on.
func OneArg(d *caddyfile.Dispenser, what string) (string, error) {
	opt := d.Val()
	if !d.NextArg() {
		return "", d.Errf("%s: %s: missing value", what, opt)
	}
	val := d.Val()
	if d.NextArg() {
		return "", d.Errf("%s: %s: one value expected, got another: %q", what, opt, d.Val())
	}
	return val, nil
}

// NoArgs fails when the option the dispenser is on has arguments.
func NoArgs(d *caddyfile.Dispenser, what string) error {
	opt := d.Val()
	if d.NextArg() {
		return d.Errf("%s: %s: unexpected argument %q; it takes none", what, opt, d.Val())
	}
	return nil
}

// NoOptions consumes the name of a directive or module that takes no
// argument and no block, and rejects either.
func NoOptions(d *caddyfile.Dispenser, what string) error {
	d.Next() // the name
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; it takes none", what, d.Val())
	}
	if d.NextBlock(0) {
		return d.Errf("%s: unexpected block; it takes no options", what)
	}
	return nil
}

// BlockOnly consumes the name of a directive or option whose settings all
// go in a block, and rejects arguments on its line.
func BlockOnly(d *caddyfile.Dispenser, what string) error {
	d.Next() // the name
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; options go in a block", what, d.Val())
	}
	return nil
}

// Unknown is the error for an option the block does not have; want lists
// the options it does.
func Unknown(d *caddyfile.Dispenser, what string, want ...string) error {
	return d.Errf("%s: unknown option %q (want %s)", what, d.Val(), List(want))
}

// List writes "a", "a or b", "a, b or c".
func List(words []string) string {
	switch len(words) {
	case 0:
		return ""
	case 1:
		return words[0]
	}
	return strings.Join(words[:len(words)-1], ", ") + " or " + words[len(words)-1]
}

// Errf is an error at the dispenser's line that starts with what.
func Errf(d *caddyfile.Dispenser, what, format string, args ...any) error {
	return d.Errf("%s: %s", what, fmt.Sprintf(format, args...))
}
