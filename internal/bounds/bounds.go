// Package bounds states how a configuration value outside its allowed
// range is reported, so that every module words it the same way: the
// option, the value, and the limit it broke.
package bounds

import (
	"fmt"
	"math"
	"time"
)

// Duration checks that d, the value of option name, lies in [lo, hi].
func Duration(name string, d, lo, hi time.Duration) error {
	switch {
	case d < lo:
		return fmt.Errorf("%s %v is below the minimum %v", name, d, lo)
	case d > hi:
		return fmt.Errorf("%s %v is above the maximum %v", name, d, hi)
	}
	return nil
}

// Int checks that n, the value of option name, lies in [lo, hi].
func Int(name string, n, lo, hi int) error {
	switch {
	case n < lo:
		return fmt.Errorf("%s %d is below the minimum %d", name, n, lo)
	case n > hi:
		return fmt.Errorf("%s %d is above the maximum %d", name, n, hi)
	}
	return nil
}

// Float checks that v, the value of option name, is a finite number in
// [lo, hi]. NaN and the infinities are refused whatever the range.
func Float(name string, v, lo, hi float64) error {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return fmt.Errorf("%s %v is not a finite number", name, v)
	case v < lo:
		return fmt.Errorf("%s %v is below the minimum %v", name, v, lo)
	case v > hi:
		return fmt.Errorf("%s %v is above the maximum %v", name, v, hi)
	}
	return nil
}

// Positive checks that v, the value of option name, is a finite number
// above 0 and at most hi.
func Positive(name string, v, hi float64) error {
	if err := Float(name, v, 0, hi); err != nil {
		return err
	}
	if v == 0 {
		return fmt.Errorf("%s must be above 0", name)
	}
	return nil
}

// Percent checks that v, the value of option name, is a percentage in
// [0, 100].
func Percent(name string, v float64) error {
	if math.IsNaN(v) || v < 0 || v > 100 {
		return fmt.Errorf("%s %v%% is not a percentage from 0%% to 100%%", name, v)
	}
	return nil
}

// Name checks name, the name of a kind of element such as "group" or
// "branch": not empty, at most max bytes, and only letters, digits, '.',
// '-' and '_', so that it reads the same in headers, placeholders and
// metric labels.
func Name(kind, name string, max int) error {
	if name == "" {
		return fmt.Errorf("%s has no name", kind)
	}
	if len(name) > max {
		return fmt.Errorf("%s name %.20q... is longer than %d bytes", kind, name, max)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_') {
			return fmt.Errorf("%s name %q has %q; use letters, digits, '.', '-' and '_'", kind, name, c)
		}
	}
	return nil
}
