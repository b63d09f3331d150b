package bounds

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestBounds(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want string // "" for no error
	}{
		{Duration("interval", time.Nanosecond, 100*time.Millisecond, time.Hour), "interval 1ns is below the minimum 100ms"},
		{Duration("interval", 2*time.Hour, time.Millisecond, time.Hour), "interval 2h0m0s is above the maximum 1h0m0s"},
		{Duration("interval", time.Second, time.Millisecond, time.Hour), ""},
		{Int("count", 0, 1, 10), "count 0 is below the minimum 1"},
		{Int("count", 11, 1, 10), "count 11 is above the maximum 10"},
		{Int("count", 10, 1, 10), ""},
		{Float("factor", math.NaN(), 0, 1), "factor NaN is not a finite number"},
		{Float("factor", math.Inf(1), 0, 1), "factor +Inf is not a finite number"},
		{Float("factor", -1, 0, 1), "factor -1 is below the minimum 0"},
		{Float("factor", 0.5, 0, 1), ""},
		{Positive("aggression", 0, 10), "aggression must be above 0"},
		{Positive("aggression", math.NaN(), 10), "aggression NaN is not a finite number"},
		{Positive("aggression", 1e-3, 10), ""},
		{Percent("threshold", 101), "threshold 101% is not a percentage from 0% to 100%"},
		{Percent("threshold", math.NaN()), "threshold NaN% is not a percentage"},
		{Percent("threshold", 0), ""},
		{Percent("threshold", 100), ""},
		{Name("branch", "users-2.v_1", 64), ""},
		{Name("branch", "", 64), "branch has no name"},
		{Name("group", "a/b", 64), `group name "a/b" has '/'; use letters, digits, '.', '-' and '_'`},
		{Name("group", strings.Repeat("x", 65), 64), "is longer than 64 bytes"},
	} {
		switch {
		case tt.want == "" && tt.err != nil:
			t.Errorf("unexpected error %q", tt.err)
		case tt.want != "" && (tt.err == nil || !strings.Contains(tt.err.Error(), tt.want)):
			t.Errorf("error %v; want %q", tt.err, tt.want)
		}
	}
}
