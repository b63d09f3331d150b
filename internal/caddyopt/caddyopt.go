// Package caddyopt holds the Caddyfile parsing steps every lbx directive,
// global option and module block shares, so that each kind of error is
// worded once, at the line it is about:
//
//	<what>: <option> specified more than once
//	<what>: unknown option "x" (want a, b or c)
//	<what>: <option>: missing value
//	<what>: <option>: one value expected, got another: "x"
//	<what>: <option> "x": want a duration such as 1s (or what it takes)
//	<what>: unexpected argument "x"; it takes none
//	<what>: unexpected block; it takes no options
//	<what>: unexpected argument "x"; options go in a block
//
// what names the block the option is in, as the user wrote it: the
// directive, global option or module ("partition", "rebalance",
// "lb_policy ewma", "dynamic serf") after the blocks that enclose it
// ("lb_policy ewma: outlier", "partition: serf_tag"); in the last three it
// ends with the name that takes no argument or no block ("partition: merge
// json", "dynamic serf: exclude_self"). The steps read from the token the
// dispenser is on; none consumes a directive's or module's name, which
// callers do with d.Next() as Caddy's own parsers do.
package caddyopt

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Once rejects an option that appears twice in one block.
type Once struct {
	what string
	seen map[string]bool
}

// NewOnce starts tracking the options of one block; errors start with
// what.
func NewOnce(what string) *Once { return &Once{what: what, seen: make(map[string]bool)} }

// Check records the option the dispenser is on and fails when it was seen
// before.
func (o *Once) Check(d *caddyfile.Dispenser) error { return o.CheckName(d, d.Val()) }

// CheckName records name, an option or a keyed entry of the block such as
// `tag "zone"`, and fails when it was seen before.
func (o *Once) CheckName(d *caddyfile.Dispenser, name string) error {
	if o.seen[name] {
		return d.Errf("%s: %s specified more than once", o.what, name)
	}
	o.seen[name] = true
	return nil
}

// Mark records name as given, as for a value written on the directive's
// own line that its block may not give again.
func (o *Once) Mark(name string) { o.seen[name] = true }

// Arg reads exactly one argument for the option the dispenser is on; a
// block may follow it.
func Arg(d *caddyfile.Dispenser, what string) (string, error) {
	opt := d.Val()
	if !d.NextArg() {
		return "", Missing(d, what)
	}
	val := d.Val()
	if d.NextArg() {
		return "", d.Errf("%s: %s: one value expected, got another: %q", what, opt, d.Val())
	}
	return val, nil
}

// OneArg reads exactly one argument for the option the dispenser is on,
// which takes no block.
func OneArg(d *caddyfile.Dispenser, what string) (string, error) {
	opt := d.Val()
	val, err := Arg(d, what)
	if err != nil {
		return "", err
	}
	return val, noBlock(d, what+": "+opt)
}

// Args reads the one or more arguments of the option the dispenser is on,
// which takes no block.
func Args(d *caddyfile.Dispenser, what string) ([]string, error) {
	opt := d.Val()
	args := d.RemainingArgs()
	if len(args) == 0 {
		return nil, Missing(d, what)
	}
	return args, noBlock(d, what+": "+opt)
}

// NoArgs checks that the option the dispenser is on has no argument and
// no block.
func NoArgs(d *caddyfile.Dispenser, what string) error {
	return NoOptions(d, what+": "+d.Val())
}

// NoOptions checks that the directive or module whose name the dispenser
// is on, which what names, has no argument and no block.
func NoOptions(d *caddyfile.Dispenser, what string) error {
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; it takes none", what, d.Val())
	}
	return noBlock(d, what)
}

// noBlock fails when a block follows on the dispenser's line.
func noBlock(d *caddyfile.Dispenser, what string) error {
	if d.NextBlock(d.Nesting()) {
		d.Prev() // back to the brace, so that the error names its line
		return d.Errf("%s: unexpected block; it takes no options", what)
	}
	return nil
}

// BlockOnly checks that the directive, module or option whose name the
// dispenser is on, which what names, has no argument: its settings all go
// in a block.
func BlockOnly(d *caddyfile.Dispenser, what string) error {
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; options go in a block", what, d.Val())
	}
	return nil
}

// Block reads a block of options: it consumes the name of the
// directive, global option or module (the token the dispenser is on)
// and reads the rest as Options does.
func Block(d *caddyfile.Dispenser, what string, option func(opt string) error) error {
	d.Next() // the name
	return Options(d, what, option)
}

// Options reads the block of options of the directive, global option or
// module whose name the dispenser has just consumed: it refuses
// arguments on the name's line, and calls option for each option of the
// block with the dispenser on the option's name, after refusing one given
// twice. option reads the option's values and checks them.
func Options(d *caddyfile.Dispenser, what string, option func(opt string) error) error {
	if err := BlockOnly(d, what); err != nil {
		return err
	}
	once := NewOnce(what)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := once.Check(d); err != nil {
			return err
		}
		if err := option(d.Val()); err != nil {
			return err
		}
	}
	return nil
}

// Checked returns the error of a check of an option's value (a bounds
// check shared with the module's JSON validation), if any, at the
// dispenser's line and starting with what.
func Checked(d *caddyfile.Dispenser, what string, err error) error {
	if err == nil {
		return nil
	}
	return Errf(d, what, "%v", err)
}

// Missing is the error for the option the dispenser is on when it needs
// a value and has none.
func Missing(d *caddyfile.Dispenser, what string) error {
	return d.Errf("%s: %s: missing value", what, d.Val())
}

// Unknown is the error for an option the block does not have; want lists
// the options it does.
func Unknown(d *caddyfile.Dispenser, what string, want ...string) error {
	return d.Errf("%s: unknown option %q (want %s)", what, d.Val(), List(want))
}

// Invalid is the error for a value of the option opt that does not parse:
// want says what the option takes.
func Invalid(d *caddyfile.Dispenser, what, opt, val, want string) error {
	return d.Errf("%s: %s %q: want %s", what, opt, val, want)
}

// Duration reads the one argument of the option the dispenser is on as a
// duration. Its range is the caller's to check.
func Duration(d *caddyfile.Dispenser, what string) (time.Duration, error) {
	opt := d.Val()
	val, err := OneArg(d, what)
	if err != nil {
		return 0, err
	}
	return DurationValue(d, what, opt, val)
}

// DurationValue parses val, the value of option opt, as a duration
// (Caddy's syntax: 1s, 1.5h, 1d), for options that read their argument
// themselves.
func DurationValue(d *caddyfile.Dispenser, what, opt, val string) (time.Duration, error) {
	dur, err := caddy.ParseDuration(val)
	if err != nil {
		return 0, Invalid(d, what, opt, val, "a duration such as 1s")
	}
	return dur, nil
}

// PositiveDuration is Duration for an option whose 0 would mean its
// default in JSON, so that writing 0 is refused rather than ignored.
func PositiveDuration(d *caddyfile.Dispenser, what string) (time.Duration, error) {
	opt := d.Val()
	val, err := OneArg(d, what)
	if err != nil {
		return 0, err
	}
	if dur, err := caddy.ParseDuration(val); err == nil && dur > 0 {
		return dur, nil
	}
	return 0, Invalid(d, what, opt, val, "a positive duration such as 1s")
}

// Int reads the one argument of the option the dispenser is on as a whole
// number. Its range is the caller's to check.
func Int(d *caddyfile.Dispenser, what string) (int, error) {
	opt := d.Val()
	val, err := OneArg(d, what)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(val)
	if err != nil {
		return 0, Invalid(d, what, opt, val, "a whole number")
	}
	return n, nil
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

// GlobalApp returns the parser of the global option name, which sets up
// the app of the same name from its block with the app's
// UnmarshalCaddyfile. The option may appear once.
func GlobalApp[T any, P interface {
	*T
	caddyfile.Unmarshaler
}](name string) httpcaddyfile.UnmarshalGlobalFunc {
	return func(d *caddyfile.Dispenser, existing any) (any, error) {
		if existing != nil {
			d.Next() // the option's name, so that the error has its line
			return nil, d.Errf("%s specified more than once; use one %s block", name, name)
		}
		app := P(new(T))
		if err := app.UnmarshalCaddyfile(d); err != nil {
			return nil, err
		}
		return httpcaddyfile.App{Name: name, Value: caddyconfig.JSON(app, nil)}, nil
	}
}

// Routes reads the block of seg, an option such as `group <name> {…}` or
// `branch [<name>] {…}` of a combo handler's block, as the routes of a
// subroute: directives, as in a route, ordered as Caddy orders them. h is
// the enclosing directive's helper (its options and named matchers apply
// inside); what names the option in errors, as in "selective: group a",
// and noun is what the block holds the handlers of ("group", "branch").
func Routes(h httpcaddyfile.Helper, seg caddyfile.Segment, what, noun string) (caddyhttp.RouteList, error) {
	// The block, behind the option's name alone, is what Caddy's
	// subroute parser reads.
	toks := []caddyfile.Token{seg[0]}
	for i, t := range seg {
		if t.Text == "{" && i > 0 && t.Line == seg[0].Line {
			toks = append(toks, seg[i:]...)
			break
		}
	}
	at := caddyfile.NewDispenser(seg)
	at.Next()
	if len(toks) == 1 {
		return nil, Errf(at, what, "missing block; give the %s's handler, e.g. { reverse_proxy ... }", noun)
	}
	handler, err := httpcaddyfile.ParseSegmentAsSubroute(h.WithDispenser(caddyfile.NewDispenser(toks)))
	if err != nil {
		return nil, err
	}
	sub, ok := handler.(*caddyhttp.Subroute)
	if !ok || len(sub.Routes) == 0 {
		return nil, Errf(at, what, "empty block; give the %s's handler, e.g. { reverse_proxy ... }", noun)
	}
	return sub.Routes, nil
}
