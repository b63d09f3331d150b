package lbpolicy

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/healthx"
	"github.com/caddy-lbx/lbx/internal/hoststate"
)

func provisionPanic(t testing.TB, p *PanicSelection) *PanicSelection {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := p.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Cleanup() })
	return p
}

// TestPanicWrapperHidesEjected: a stock policy behind the panic wrapper
// with outlier ejection never gets an ejected upstream, until so many are
// ejected that the pool is in panic mode, where health is ignored.
func TestPanicWrapperHidesEjected(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy": "round_robin"}`),
		Outlier:   &healthx.Outlier{MaxEjectionPercent: percent(100)},
	})
	pool := newPool(t, 4)
	p.Select(pool, nil, nil) // builds the view and takes the references
	eject := func(i int) {
		_, _, ok := p.table.Stats(pool[i].Dial).Eject(hoststate.Now(), time.Hour,
			func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures)
		if !ok {
			t.Fatalf("ejecting %d", i)
		}
	}
	count := func() map[int]int {
		// past the availability cache, so the ejection is seen
		p.view.Load().countedAt.Store(-countEvery)
		got := map[int]int{}
		for range 400 {
			u := p.Select(pool, nil, nil)
			for i := range pool {
				if pool[i] == u {
					got[i]++
				}
			}
		}
		return got
	}

	eject(1)
	got := count()
	if got[1] != 0 || got[0]+got[2]+got[3] != 400 {
		t.Fatalf("with pool[1] ejected (not in panic): picks %v", got)
	}
	if rep, _ := p.ReportPool(); rep.Available != 3 || rep.Upstreams[1].Available {
		t.Fatalf("report: available %d, pool[1] available %v", rep.Available, rep.Upstreams[1].Available)
	}

	eject(2)
	eject(3) // 1 of 4 left: below the 50% threshold
	got = count()
	if got[1] == 0 || got[2] == 0 || got[3] == 0 {
		t.Fatalf("in panic mode every upstream must be used again: picks %v", got)
	}
	if !p.panic.on.Load() {
		t.Fatal("pool with 1 of 4 available is not in panic mode")
	}
}

func TestPanicOutlierAroundEWMAIsAnError(t *testing.T) {
	p := &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "ewma"}`), Outlier: &healthx.Outlier{}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	wantErr(t, p.Provision(ctx), "configure outlier ejection inside the ewma policy")
	_ = p.Cleanup()
}
