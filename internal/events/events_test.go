package events

import (
	"context"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestEmitReachesSubscribers: with an events app, an event reaches its
// subscribers with its name and data, and one nobody subscribed to is
// not sent.
func TestEmitReachesSubscribers(t *testing.T) {
	ctx, rec := lbxtest.SubscribeEvents(t, "lbx_test")
	e := New(ctx)
	e.Emit("lbx_test_other", map[string]any{"host": "b:80"})
	e.Emit("lbx_test", map[string]any{"host": "a:80"})
	evs := rec.Events()
	if len(evs) != 1 {
		t.Fatalf("%d events delivered; want the one subscribed to", len(evs))
	}
	if got := evs[0]; got.Name() != "lbx_test" || got.Data["host"] != "a:80" {
		t.Fatalf("event %s %v; want lbx_test with host a:80", got.Name(), got.Data)
	}
}

// TestNoEventsApp: without an events app in the config an Emitter sends
// nothing and does not create one; the zero Emitter sends nothing either.
func TestNoEventsApp(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	e := New(ctx)
	if e.app != nil {
		t.Fatal("the Emitter has an events app without one configured")
	}
	e.Emit("lbx_test", map[string]any{"x": 1}) // must not panic
	Emitter{}.Emit("lbx_test", nil)
	if _, err := ctx.AppIfConfigured("events"); err == nil {
		t.Fatal("the events app was created")
	}
}
