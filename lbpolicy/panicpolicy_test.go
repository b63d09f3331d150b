package lbpolicy

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
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
		Outlier:   &Outlier{MaxEjectionPercent: percent(100)},
	})
	pool := newPool(t, 4)
	p.Select(pool, nil, nil) // builds the view and takes the references
	eject := func(i int) {
		_, _, ok := p.table.Stats(pool[i].Dial).Eject(monoclock.Now(), time.Hour,
			func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures)
		if !ok {
			t.Fatalf("ejecting %d", i)
		}
	}
	count := func() map[int]int {
		// past the availability cache, so the ejection is seen
		p.views.last.Load().countedAt.Store(-countEvery)
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
	if rep := p.poolStatuses()[0]; rep.Available != 3 || rep.Upstreams[1].Available {
		t.Fatalf("report: available %d, pool[1] available %v", rep.Available, rep.Upstreams[1].Available)
	}

	eject(2)
	eject(3) // 1 of 4 left: below the 50% threshold
	got = count()
	if got[1] == 0 || got[2] == 0 || got[3] == 0 {
		t.Fatalf("in panic mode every upstream must be used again: picks %v", got)
	}
	if !p.views.last.Load().panic.on.Load() {
		t.Fatal("pool with 1 of 4 available is not in panic mode")
	}
}

func TestPanicOutlierAroundEWMAIsAnError(t *testing.T) {
	p := &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "ewma"}`), Outlier: &Outlier{}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	wantErr(t, p.Provision(ctx), "configure outlier ejection inside the ewma policy")
	_ = p.Cleanup()
}

// TestPanicModeIsPerPool: one policy serving two pools (as for the
// partitions of a partition handler), one healthy and one mostly ejected,
// alternately, with fresh Upstream values every time. Each pool has its
// own view and panic mode: the mostly-ejected one enters panic once, the
// healthy one never, instead of one shared mode flipping on every request.
func TestPanicModeIsPerPool(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	s := &LeastTimeSelection{Outlier: &Outlier{MaxEjectionPercent: percent(100)}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	s.logger = zap.New(core)
	s.panic.logger = s.logger
	t.Cleanup(func() { _ = s.Cleanup() })

	both := newPool(t, 8) // distinct dial addresses
	healthy, sick := both[:4], both[4:]
	fresh := func(pool reverseproxy.UpstreamPool) reverseproxy.UpstreamPool {
		out := make(reverseproxy.UpstreamPool, len(pool))
		for i, u := range pool {
			out[i] = &reverseproxy.Upstream{Host: u.Host, Dial: u.Dial}
		}
		return out
	}
	for _, u := range sick[1:] {
		if _, _, ok := s.table.Stats(u.Dial).Eject(monoclock.Now(), time.Hour,
			func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
			t.Fatal("eject")
		}
	}
	for range 200 {
		if s.Select(fresh(healthy), nil, nil) == nil || s.Select(fresh(sick), nil, nil) == nil {
			t.Fatal("nothing chosen")
		}
	}
	if n := s.views.n; n != 2 {
		t.Fatalf("%d views for two pools of fresh Upstream values; want 2", n)
	}
	entered := logs.FilterMessageSnippet("entered panic").Len()
	left := logs.FilterMessageSnippet("left panic").Len()
	if entered != 1 || left != 0 {
		t.Fatalf("panic mode entered %d and left %d times; want the sick pool to enter once", entered, left)
	}
	for _, rep := range s.poolStatuses() {
		if want := rep.Upstreams[0].Dial == sick[0].Dial; rep.Panic != want {
			t.Fatalf("pool of %s: panic %v, want %v", rep.Upstreams[0].Dial, rep.Panic, want)
		}
	}
}
