package caddyopt

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

// readBlock runs read on each option of the test block in, the way a
// parser's loop does, and returns the first error.
func readBlock(in string, read func(d *caddyfile.Dispenser) error) error {
	d := caddyfile.NewTestDispenser(in)
	d.Next() // the block's name
	for d.NextBlock(0) {
		if err := read(d); err != nil {
			return err
		}
	}
	return nil
}

// TestErrors pins the wording of each step's errors and the line they
// name; a step that succeeds must leave the dispenser where the block
// goes on.
func TestErrors(t *testing.T) {
	oneArg := func(d *caddyfile.Dispenser) error { _, err := OneArg(d, "x"); return err }
	for _, tc := range []struct {
		name, in string
		read     func(d *caddyfile.Dispenser) error
		want     string // "" means no error
	}{
		{"once", "x {\n a 1\n b 2\n a 3\n}", func() func(*caddyfile.Dispenser) error {
			once := NewOnce("x")
			return func(d *caddyfile.Dispenser) error {
				err := once.Check(d)
				d.RemainingArgs() // the value
				return err
			}
		}(), "x: a specified more than once, at Testfile:4"},
		{"once by name", "x {\n tag a 1\n tag b 2\n tag a 3\n}", func() func(*caddyfile.Dispenser) error {
			once := NewOnce("x")
			return func(d *caddyfile.Dispenser) error {
				args := d.RemainingArgs()
				return once.CheckName(d, `tag "`+args[0]+`"`)
			}
		}(), `x: tag "a" specified more than once, at Testfile:4`},
		{"one arg", "x {\n a 1\n b 2\n}", oneArg, ""},
		{"one arg missing", "x {\n a\n}", oneArg, "x: a: missing value, at Testfile:2"},
		{"one arg extra", "x {\n a 1 2\n}", oneArg, `x: a: one value expected, got another: "2", at Testfile:2`},
		{"one arg block", "x {\n a 1 {\n  b\n }\n}", oneArg, "x: a: unexpected block; it takes no options, at Testfile:2"},
		{"arg then block", "x {\n a 1 {\n  b\n }\n}", func(d *caddyfile.Dispenser) error {
			if _, err := Arg(d, "x"); err != nil {
				return err
			}
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				if d.Val() != "b" {
					return d.Errf("read %q in the block", d.Val())
				}
			}
			return nil
		}, ""},
		{"args", "x {\n a 1 2\n}", func(d *caddyfile.Dispenser) error {
			args, err := Args(d, "x")
			if err == nil && len(args) != 2 {
				return d.Errf("args %q", args)
			}
			return err
		}, ""},
		{"args missing", "x {\n a\n}", func(d *caddyfile.Dispenser) error { _, err := Args(d, "x"); return err }, "x: a: missing value, at Testfile:2"},
		{"no args", "x {\n a\n b\n}", func(d *caddyfile.Dispenser) error { return NoArgs(d, "x") }, ""},
		{"no args given one", "x {\n a 1\n}", func(d *caddyfile.Dispenser) error { return NoArgs(d, "x") }, `x: a: unexpected argument "1"; it takes none, at Testfile:2`},
		{"no args given a block", "x {\n a {\n  b\n }\n}", func(d *caddyfile.Dispenser) error { return NoArgs(d, "x") }, "x: a: unexpected block; it takes no options, at Testfile:2"},
		{"block only", "x {\n a {\n  b\n }\n}", func(d *caddyfile.Dispenser) error {
			if err := BlockOnly(d, "x: a"); err != nil {
				return err
			}
			for nesting := d.Nesting(); d.NextBlock(nesting); {
			}
			return nil
		}, ""},
		{"block only given one", "x {\n a 1 {\n  b\n }\n}", func(d *caddyfile.Dispenser) error { return BlockOnly(d, "x: a") }, `x: a: unexpected argument "1"; options go in a block, at Testfile:2`},
		{"unknown", "x {\n c 1\n}", func(d *caddyfile.Dispenser) error { return Unknown(d, "x", "a", "b") }, `x: unknown option "c" (want a or b), at Testfile:2`},
		{"duration", "x {\n a soon\n}", func(d *caddyfile.Dispenser) error { _, err := Duration(d, "x"); return err }, `x: a "soon": want a duration such as 1s, at Testfile:2`},
		{"duration 0", "x {\n a 0\n}", func(d *caddyfile.Dispenser) error { _, err := Duration(d, "x"); return err }, ""},
		{"positive duration 0", "x {\n a 0s\n}", func(d *caddyfile.Dispenser) error { _, err := PositiveDuration(d, "x"); return err }, `x: a "0s": want a positive duration such as 1s, at Testfile:2`},
		{"positive duration bad", "x {\n a soon\n}", func(d *caddyfile.Dispenser) error { _, err := PositiveDuration(d, "x"); return err }, `x: a "soon": want a positive duration such as 1s, at Testfile:2`},
		{"positive duration extra", "x {\n a 1s 2s\n}", func(d *caddyfile.Dispenser) error { _, err := PositiveDuration(d, "x"); return err }, `x: a: one value expected, got another: "2s", at Testfile:2`},
		{"int", "x {\n a 1.5\n}", func(d *caddyfile.Dispenser) error { _, err := Int(d, "x"); return err }, `x: a "1.5": want a whole number, at Testfile:2`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := readBlock(tc.in, tc.read)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("error %v; want none", err)
			case tc.want != "" && (err == nil || err.Error() != tc.want):
				t.Fatalf("error %v; want %q", err, tc.want)
			}
		})
	}
}

// TestValues: the value steps return what they read.
func TestValues(t *testing.T) {
	var dur, pos time.Duration
	var n int
	err := readBlock("x {\n d 1d\n p 1.5s\n n -3\n}", func(d *caddyfile.Dispenser) (err error) {
		switch d.Val() {
		case "d":
			dur, err = Duration(d, "x")
		case "p":
			pos, err = PositiveDuration(d, "x")
		case "n":
			n, err = Int(d, "x")
		}
		return err
	})
	if err != nil || dur != 24*time.Hour || pos != 1500*time.Millisecond || n != -3 {
		t.Fatalf("read %v, %v, %d, error %v; want 24h, 1.5s, -3", dur, pos, n, err)
	}
}

// TestMark: a name marked as given, as a value on the directive's line,
// may not be given again in its block.
func TestMark(t *testing.T) {
	d := caddyfile.NewTestDispenser("x 80 {\n port 81\n}")
	d.Next()
	d.NextArg() // 80
	once := NewOnce("x")
	once.Mark("port")
	if !d.NextBlock(0) {
		t.Fatal("no block")
	}
	if err := once.Check(d); err == nil || err.Error() != "x: port specified more than once, at Testfile:2" {
		t.Fatalf("error %v; want port specified more than once", err)
	}
}

// TestNoOptions covers a module's name line.
func TestNoOptions(t *testing.T) {
	for in, want := range map[string]string{
		"m":           "",
		"m {\n}":      "",
		"m 1":         `m: unexpected argument "1"; it takes none, at Testfile:1`,
		"m {\n a\n}":  "m: unexpected block; it takes no options, at Testfile:1",
		"m {\n a 1\n": "m: unexpected block; it takes no options, at Testfile:1",
	} {
		d := caddyfile.NewTestDispenser(in)
		d.Next()
		err := NoOptions(d, "m")
		if want == "" && err != nil || want != "" && (err == nil || err.Error() != want) {
			t.Errorf("%q: error %v; want %q", in, err, want)
		}
	}
}

// TestBlock covers the block of options: the name line, each option
// once, and the option's own error, each at its line; Checked reports a
// check's error at the dispenser's line.
func TestBlock(t *testing.T) {
	for in, want := range map[string]string{
		"b":                     "",
		"b {\n a 1\n c 2\n}":    "",
		"b 1":                   `b: unexpected argument "1"; options go in a block, at Testfile:1`,
		"b {\n a 1\n a 2\n}":    "b: a specified more than once, at Testfile:3",
		"b {\n a 1\n z 1\n}":    `b: unknown option "z" (want a or c), at Testfile:3`,
		"b {\n c -1\n}":         "b: c -1 is below the minimum 0, at Testfile:2",
		"b {\n a {\n  x\n }\n}": `b: a: missing value, at Testfile:2`,
	} {
		var seen []string
		d := caddyfile.NewTestDispenser(in)
		err := Block(d, "b", func(opt string) error {
			seen = append(seen, opt)
			switch opt {
			case "a":
				_, err := OneArg(d, "b")
				return err
			case "c":
				val, err := Int(d, "b")
				if err != nil {
					return err
				}
				if val < 0 {
					return Checked(d, "b", fmt.Errorf("c %d is below the minimum 0", val))
				}
				return Checked(d, "b", nil)
			}
			return Unknown(d, "b", "a", "c")
		})
		if want == "" && err != nil || want != "" && (err == nil || err.Error() != want) {
			t.Errorf("%q: error %v; want %q (options read: %v)", in, err, want, seen)
		}
	}
}

func TestList(t *testing.T) {
	for want, words := range map[string][]string{
		"":          nil,
		"a":         {"a"},
		"a or b":    {"a", "b"},
		"a, b or c": {"a", "b", "c"},
	} {
		if got := List(words); got != want {
			t.Errorf("List(%q) = %q; want %q", words, got, want)
		}
	}
}

// testApp is an app with one option, for GlobalApp.
type testApp struct {
	Name string `json:"name,omitempty"`
}

func (a *testApp) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	for d.NextBlock(0) {
		v, err := OneArg(d, "lbx_test")
		if err != nil {
			return err
		}
		a.Name = v
	}
	return nil
}

// TestGlobalApp: the option sets up the app from its block, and a second
// one is refused at its line.
func TestGlobalApp(t *testing.T) {
	parse := GlobalApp[testApp]("lbx_test")
	v, err := parse(caddyfile.NewTestDispenser("lbx_test {\n name a\n}"), nil)
	if err != nil {
		t.Fatal(err)
	}
	app, ok := v.(httpcaddyfile.App)
	if !ok || app.Name != "lbx_test" {
		t.Fatalf("value %#v; want the httpcaddyfile.App lbx_test", v)
	}
	var got testApp
	if err := json.Unmarshal(app.Value, &got); err != nil || got.Name != "a" {
		t.Fatalf("app JSON %s (%v); want name a", app.Value, err)
	}
	if _, err := parse(caddyfile.NewTestDispenser("\n\nlbx_test {\n name b\n}"), v); err == nil ||
		err.Error() != "lbx_test specified more than once; use one lbx_test block, at Testfile:3" {
		t.Fatalf("second option: error %v; want it refused at Testfile:3", err)
	}
	if _, err := parse(caddyfile.NewTestDispenser("lbx_test {\n name\n}"), nil); err == nil || !strings.Contains(err.Error(), "lbx_test: name: missing value") {
		t.Fatalf("app error %v; want the app's own", err)
	}
}
