package healthx

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestSlowStartFactor(t *testing.T) {
	const window = int64(10 * time.Second)
	pct := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		name       string
		cfg        SlowStart
		start, now int64
		want       float64
	}{
		{"never ramped", SlowStart{}, 0, 5 * window, 1},
		{"at the start: floor", SlowStart{}, 100, 100, 0.1},
		{"below the floor", SlowStart{}, 100, 100 + window/20, 0.1},
		{"linear, half way", SlowStart{}, 100, 100 + window/2, 0.5},
		{"just before the end", SlowStart{}, 100, 100 + window - 1, float64(window-1) / float64(window)},
		{"exactly at the end", SlowStart{}, 100, 100 + window, 1},
		{"after the end", SlowStart{}, 100, 100 + 2*window, 1},
		{"start in the future (clock lag)", SlowStart{}, 200, 100, 1},
		{"aggression 2, quarter way", SlowStart{Aggression: 2}, 100, 100 + window/4, 0.5},
		{"aggression 0.5, half way", SlowStart{Aggression: 0.5}, 100, 100 + window/2, 0.25},
		{"floor 50%", SlowStart{MinWeightPercent: pct(50)}, 100, 100 + window/4, 0.5},
		{"floor 100%: no ramp", SlowStart{MinWeightPercent: pct(100)}, 100, 101, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.cfg
			s.Window = caddy.Duration(window)
			if err := s.Validate(); err != nil {
				t.Fatal(err)
			}
			s.Provision()
			if got := s.Factor(tc.start, tc.now); math.Abs(got-tc.want) > 1e-9 {
				t.Fatalf("Factor = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestSlowStartValidate(t *testing.T) {
	pct := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		cfg  SlowStart
		want string
	}{
		{SlowStart{}, "window 0s is below the minimum 1ms"},
		{SlowStart{Window: -1}, "window -1ns is below the minimum 1ms"},
		{SlowStart{Window: caddy.Duration(time.Second), MinWeightPercent: pct(0)}, "min_weight_percent must be above 0"},
		{SlowStart{Window: caddy.Duration(time.Second), MinWeightPercent: pct(101)}, "min_weight_percent 101% is not a percentage"},
		{SlowStart{Window: caddy.Duration(time.Second), Aggression: -1}, "aggression -1 is below the minimum 0"},
		{SlowStart{Window: caddy.Duration(time.Second), Aggression: math.Inf(1)}, "aggression +Inf is not a finite number"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want error containing %q", tc.cfg, err, tc.want)
		}
	}
}

// unmarshalOption feeds input, an option with its arguments and block, to
// unmarshal with the dispenser on the option's name, and checks the error
// against wantErr (a substring; "" for none). It reports whether the
// option parsed, for the caller to check the result.
func unmarshalOption(t *testing.T, input, wantErr string, unmarshal func(*caddyfile.Dispenser) error) bool {
	t.Helper()
	d := caddyfile.NewTestDispenser(input)
	d.Next()
	err := unmarshal(d)
	switch {
	case wantErr == "" && err != nil:
		t.Fatal(err)
	case wantErr != "" && (err == nil || !strings.Contains(err.Error(), wantErr)):
		t.Fatalf("error = %v, want one containing %q", err, wantErr)
	}
	return wantErr == ""
}

func TestSlowStartUnmarshalCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		input, wantErr string
		want           SlowStart
	}{
		{input: `slow_start 30s`, want: SlowStart{Window: caddy.Duration(30 * time.Second)}},
		{input: "slow_start 1m {\n min_weight 25%\n aggression 1.5\n}", want: SlowStart{Window: caddy.Duration(time.Minute), Aggression: 1.5}},
		{input: `slow_start`, wantErr: "wrong argument count"},
		{input: `slow_start 0s`, wantErr: `window 0s is below the minimum 1ms`},
		{input: `slow_start soon`, wantErr: `invalid window "soon"`},
		{input: `slow_start 30s 10%`, wantErr: "wrong argument count"},
		{input: "slow_start 30s {\n min_weight 0%\n}", wantErr: "min_weight_percent must be above 0%"},
		{input: "slow_start 30s {\n min_weight 120%\n}", wantErr: `invalid min_weight "120%"`},
		{input: "slow_start 30s {\n min_weight\n}", wantErr: "wrong argument count"},
		{input: "slow_start 30s {\n aggression 0\n}", wantErr: `aggression must be above 0`},
		{input: "slow_start 30s {\n aggression fast\n}", wantErr: `invalid aggression "fast"`},
		{input: "slow_start 30s {\n aggression 2 3\n}", wantErr: "wrong argument count"},
		{input: "slow_start 30s {\n aggression 2\n aggression 3\n}", wantErr: "aggression specified more than once"},
		{input: "slow_start 30s {\n ramp 3\n}", wantErr: `unrecognized option "ramp"`},
	} {
		t.Run(tc.input, func(t *testing.T) {
			var s SlowStart
			if !unmarshalOption(t, tc.input, tc.wantErr, s.UnmarshalCaddyfile) {
				return
			}
			if s.Window != tc.want.Window || s.Aggression != tc.want.Aggression {
				t.Fatalf("got %+v, want %+v", s, tc.want)
			}
		})
	}
}
