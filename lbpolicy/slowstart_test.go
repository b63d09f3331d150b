package lbpolicy

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// TestSlowStartShareFollowsRamp puts one of four equally fast upstreams at
// several points of its ramp and checks its share: admitted with
// probability factor, then one of four equals, so about factor/4.
func TestSlowStartShareFollowsRamp(t *testing.T) {
	const window = 10 * time.Second
	s := provisionLeastTime(t, &LeastTimeSelection{SlowStart: &SlowStart{Window: caddy.Duration(window)}})
	pool := newPool(t, 4)
	for _, u := range pool {
		observe(s, u, 2*time.Millisecond, hoststate.Success)
	}
	ramping := s.table.Stats(pool[3].Dial)
	const picks = 4000
	prev := -1.0
	for _, at := range []float64{0, 0.25, 0.5, 0.75, 1} {
		ramping.StartRamp(monoclock.Now() - int64(at*float64(window)))
		share := float64(shares(s, pool, picks)[pool[3]]) / picks
		want := max(at, 0.1) / 4
		t.Logf("ramp at %3.0f%%: share %.3f, want %.3f", at*100, share, want)
		if math.Abs(share-want) > 0.03 {
			t.Errorf("ramp at %.0f%%: share %.3f, want %.3f ± 0.03", at*100, share, want)
		}
		if share <= prev {
			t.Errorf("ramp at %.0f%%: share %.3f did not grow from %.3f", at*100, share, prev)
		}
		prev = share
	}
}

// TestSlowStartNeverRefuses: when every usable upstream is ramping at the
// floor, a draw that admits none of them must still choose one.
func TestSlowStartNeverRefuses(t *testing.T) {
	for _, choices := range []Choices{choicesAll, 2} {
		s := provisionLeastTime(t, &LeastTimeSelection{Choices: choices, SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)}})
		pool := newPool(t, 3)
		now := monoclock.Now()
		for _, u := range pool {
			observe(s, u, time.Millisecond, hoststate.Success)
			s.table.Stats(u.Dial).StartRamp(now)
		}
		for i := range 1000 {
			if s.Select(pool, nil, nil) == nil {
				t.Fatalf("choices %v: selection %d chose nothing", choices, i)
			}
		}
	}
}

// TestSlowStartNewMember: an upstream that joins a pool whose members have
// served ramps; in a pool where nobody has served yet, nobody does.
func TestSlowStartNewMember(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{SlowStart: &SlowStart{Window: caddy.Duration(time.Minute)}})
	fresh := newPool(t, 3)
	s.Select(fresh, nil, nil)
	for _, u := range fresh {
		if r := s.table.Stats(u.Dial).RampStart(monoclock.Now()); r != 0 {
			t.Fatalf("%s ramps in a pool where nobody served yet", u.Dial)
		}
	}
	for _, u := range fresh {
		observe(s, u, time.Millisecond, hoststate.Success)
	}
	grown := append(fresh[:3:3], newPool(t, 4)[3])
	before := monoclock.Now()
	s.Select(grown, nil, nil)
	if r := s.table.Stats(grown[3].Dial).RampStart(monoclock.Now()); r < before {
		t.Fatalf("new member's ramp start = %d, want at least %d", r, before)
	}
	for _, u := range fresh {
		if r := s.table.Stats(u.Dial).RampStart(monoclock.Now()); r != 0 {
			t.Fatalf("old member %s ramps", u.Dial)
		}
	}
	var rep poolStatus
	for _, r := range s.poolStatuses() {
		if len(r.Upstreams) == len(grown) {
			rep = r
		}
	}
	if p := rep.Upstreams[3].SlowStartPercent; p == nil || *p != 10 {
		t.Fatalf("report of the new member: slow start weight %v, want 10%%", fmtPercent(p))
	}
	if rep.Upstreams[0].SlowStartPercent != nil {
		t.Fatal("report shows an old member ramping")
	}
	if want := time.Duration(s.SlowStart.Window).String(); rep.SlowStart != want {
		t.Errorf("report's slow_start %q; want the window %q", rep.SlowStart, want)
	}
}

func TestSlowStartFactor(t *testing.T) {
	const window = int64(10 * time.Second)
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
		{"floor 50%", SlowStart{MinWeightPercent: percent(50)}, 100, 100 + window/4, 0.5},
		{"floor 100%: no ramp", SlowStart{MinWeightPercent: percent(100)}, 100, 101, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.cfg
			s.Window = caddy.Duration(window)
			if err := s.validate(); err != nil {
				t.Fatal(err)
			}
			s.provision()
			if got := s.factor(tc.start, tc.now); math.Abs(got-tc.want) > 1e-9 {
				t.Fatalf("Factor = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestSlowStartValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg  SlowStart
		want string
	}{
		{SlowStart{}, "window 0s is below the minimum 1ms"},
		{SlowStart{Window: -1}, "window -1ns is below the minimum 1ms"},
		{SlowStart{Window: caddy.Duration(time.Second), MinWeightPercent: percent(0)}, "min_weight_percent must be above 0"},
		{SlowStart{Window: caddy.Duration(time.Second), MinWeightPercent: percent(101)}, "min_weight_percent 101% is not a percentage"},
		{SlowStart{Window: caddy.Duration(time.Second), Aggression: -1}, "aggression -1 is below the minimum 0"},
		{SlowStart{Window: caddy.Duration(time.Second), Aggression: math.Inf(1)}, "aggression +Inf is not a finite number"},
	} {
		err := tc.cfg.validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want error containing %q", tc.cfg, err, tc.want)
		}
	}
}

// unmarshalOption feeds input, an option with its arguments and block, to
// unmarshal with the dispenser on the option's name, and checks the error
// against wantErr (a substring; "" for none). It reports whether the
// option parsed, for the caller to check the result.
func unmarshalOption(t *testing.T, input, want string, unmarshal func(*caddyfile.Dispenser) error) bool {
	t.Helper()
	d := caddyfile.NewTestDispenser(input)
	d.Next()
	return wantErr(t, unmarshal(d), want)
}

func TestSlowStartUnmarshalCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		input, wantErr string
		want           SlowStart
	}{
		{input: `slow_start 30s`, want: SlowStart{Window: caddy.Duration(30 * time.Second)}},
		{input: "slow_start 1m {\n min_weight 25%\n aggression 1.5\n}", want: SlowStart{Window: caddy.Duration(time.Minute), Aggression: 1.5}},
		{input: `slow_start`, wantErr: "lb_policy ewma: slow_start: missing value, at Testfile:1"},
		{input: `slow_start 0s`, wantErr: `window 0s is below the minimum 1ms`},
		{input: `slow_start soon`, wantErr: `lb_policy ewma: slow_start "soon": want a duration such as 1s, at Testfile:1`},
		{input: `slow_start 30s 10%`, wantErr: `lb_policy ewma: slow_start: one value expected, got another: "10%", at Testfile:1`},
		{input: "slow_start 30s {\n min_weight 0%\n}", wantErr: "min_weight_percent must be above 0%"},
		{input: "slow_start 30s {\n min_weight 120%\n}", wantErr: `lb_policy ewma: slow_start: min_weight "120%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{input: "slow_start 30s {\n min_weight\n}", wantErr: "lb_policy ewma: slow_start: min_weight: missing value, at Testfile:2"},
		{input: "slow_start 30s {\n aggression 0\n}", wantErr: `aggression must be above 0`},
		{input: "slow_start 30s {\n aggression fast\n}", wantErr: `lb_policy ewma: slow_start: aggression "fast": want a number, at Testfile:2`},
		{input: "slow_start 30s {\n aggression 2 3\n}", wantErr: `lb_policy ewma: slow_start: aggression: one value expected, got another: "3", at Testfile:2`},
		{input: "slow_start 30s {\n aggression 2\n aggression 3\n}", wantErr: "aggression specified more than once"},
		{input: "slow_start 30s {\n ramp 3\n}", wantErr: `lb_policy ewma: slow_start: unknown option "ramp" (want min_weight or aggression), at Testfile:2`},
	} {
		t.Run(tc.input, func(t *testing.T) {
			var s SlowStart
			if !unmarshalOption(t, tc.input, tc.wantErr, func(d *caddyfile.Dispenser) error { return s.unmarshalCaddyfile(d, "lb_policy ewma") }) {
				return
			}
			if s.Window != tc.want.Window || s.Aggression != tc.want.Aggression {
				t.Fatalf("got %+v, want %+v", s, tc.want)
			}
		})
	}
}
