package lbpolicy

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/lbxtest"
)

func TestEjectionEmitsEvent(t *testing.T) {
	ctx, rec := lbxtest.SubscribeEvents(t, eventUpstreamEjected)
	o := Outlier{Consecutive: 2}
	o.provision(zap.NewNop(), events.New(ctx))
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	dial := t.Name() + ":80"
	s := table.Stats(dial)
	o.judge(table, s, dial, true)
	if len(rec.Events()) != 0 {
		t.Fatal("event before the host was ejected")
	}
	o.judge(table, s, dial, true)
	evs := rec.Events()
	if len(evs) != 1 {
		t.Fatalf("%d upstream_ejected events; want 1", len(evs))
	}
	if e := evs[0]; e.Name() != eventUpstreamEjected || e.Data["host"] != dial || e.Data["reason"] != "consecutive_failures" || e.Data["for_ms"] != int64(30000) {
		t.Fatalf("event %s %v", e.Name(), e.Data)
	}
}

func TestRestorationEmitsEventOnce(t *testing.T) {
	ctx, rec := lbxtest.SubscribeEvents(t, eventUpstreamRestored)
	o := Outlier{Consecutive: 1, BaseEjectionTime: caddy.Duration(time.Millisecond)}
	o.provision(zap.NewNop(), events.New(ctx))
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	dial := t.Name() + ":80"
	s := table.Stats(dial)
	o.judge(table, s, dial, true) // ejected for 1ms
	if !s.Ejected(monoclock.Now()) {
		t.Fatal("not ejected")
	}
	if s.TakeRestored(monoclock.Now()) {
		t.Fatal("restored while still ejected")
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Ejected(monoclock.Now()) {
		if time.Now().After(deadline) {
			t.Fatal("ejection of 1ms did not end")
		}
		time.Sleep(time.Millisecond)
	}
	o.judge(table, s, dial, false)
	o.judge(table, s, dial, false)
	evs := rec.Events()
	if len(evs) != 1 {
		t.Fatalf("want exactly one upstream_restored event, got %d", len(evs))
	}
	if e := evs[0]; e.Data["host"] != dial {
		t.Fatalf("event data %v", e.Data)
	}
}
