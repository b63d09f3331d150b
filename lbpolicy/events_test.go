package lbpolicy

import (
	"context"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// recorder is an event handler that keeps what it is given.
type recorder chan caddy.Event

func (r recorder) Handle(_ context.Context, e caddy.Event) error {
	r <- e
	return nil
}

// subscribe returns a context with an events app and a channel receiving
// the named events.
func subscribe(t *testing.T, names ...string) (caddy.Context, recorder) {
	t.Helper()
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	app, err := ctx.App("events") // reverse_proxy loads it the same way
	if err != nil {
		t.Fatal(err)
	}
	rec := make(recorder, 16)
	for _, n := range names {
		if err := app.(*caddyevents.App).On(n, rec); err != nil {
			t.Fatal(err)
		}
	}
	return ctx, rec
}

func TestEjectionEmitsEvent(t *testing.T) {
	ctx, rec := subscribe(t, eventUpstreamEjected)
	o := Outlier{Consecutive: 2}
	o.provision(zap.NewNop(), events.New(ctx))
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	dial := t.Name() + ":80"
	s := table.Stats(dial)
	o.judge(table, s, dial, true)
	if len(rec) != 0 {
		t.Fatal("event before the host was ejected")
	}
	o.judge(table, s, dial, true)
	select {
	case e := <-rec:
		if e.Name() != eventUpstreamEjected || e.Data["host"] != dial || e.Data["reason"] != "consecutive_failures" || e.Data["for_ms"] != int64(30000) {
			t.Fatalf("event %s %v", e.Name(), e.Data)
		}
	default:
		t.Fatal("no upstream_ejected event")
	}
}

func TestRestorationEmitsEventOnce(t *testing.T) {
	ctx, rec := subscribe(t, eventUpstreamRestored)
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
	if len(rec) != 1 {
		t.Fatalf("want exactly one upstream_restored event, got %d", len(rec))
	}
	if e := <-rec; e.Data["host"] != dial {
		t.Fatalf("event data %v", e.Data)
	}
}
