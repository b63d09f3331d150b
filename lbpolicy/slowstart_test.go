package lbpolicy

import (
	"math"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/healthx"
	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// TestSlowStartShareFollowsRamp puts one of four equally fast upstreams at
// several points of its ramp and checks its share: admitted with
// probability factor, then one of four equals, so about factor/4.
func TestSlowStartShareFollowsRamp(t *testing.T) {
	const window = 10 * time.Second
	s := provisionEWMA(t, &EWMASelection{SlowStart: &healthx.SlowStart{Window: caddy.Duration(window)}})
	pool := newPool(t, 4)
	for _, u := range pool {
		observe(s, u, 2*time.Millisecond, hoststate.Success)
	}
	ramping := s.table.Stats(pool[3].Dial)
	const picks = 4000
	prev := -1.0
	for _, at := range []float64{0, 0.25, 0.5, 0.75, 1} {
		ramping.StartRamp(hoststate.Now() - int64(at*float64(window)))
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
	for _, choices := range []Choices{ChoicesAll, 2} {
		s := provisionEWMA(t, &EWMASelection{Choices: choices, SlowStart: &healthx.SlowStart{Window: caddy.Duration(time.Minute)}})
		pool := newPool(t, 3)
		now := hoststate.Now()
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
	s := provisionEWMA(t, &EWMASelection{SlowStart: &healthx.SlowStart{Window: caddy.Duration(time.Minute)}})
	fresh := newPool(t, 3)
	s.Select(fresh, nil, nil)
	for _, u := range fresh {
		if r := s.table.Stats(u.Dial).RampStart(hoststate.Now()); r != 0 {
			t.Fatalf("%s ramps in a pool where nobody served yet", u.Dial)
		}
	}
	for _, u := range fresh {
		observe(s, u, time.Millisecond, hoststate.Success)
	}
	grown := append(fresh[:3:3], newPool(t, 4)[3])
	before := hoststate.Now()
	s.Select(grown, nil, nil)
	if r := s.table.Stats(grown[3].Dial).RampStart(hoststate.Now()); r < before {
		t.Fatalf("new member's ramp start = %d, want at least %d", r, before)
	}
	for _, u := range fresh {
		if r := s.table.Stats(u.Dial).RampStart(hoststate.Now()); r != 0 {
			t.Fatalf("old member %s ramps", u.Dial)
		}
	}
	var rep hoststate.PoolReport
	for _, r := range s.ReportPools() {
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
}
