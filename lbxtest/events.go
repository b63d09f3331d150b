package lbxtest

import (
	"context"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// EventRecorder is a Caddy event handler that keeps the events it is
// given, for a test to read. It never blocks the emitter.
type EventRecorder struct {
	mu     sync.Mutex
	events []caddy.Event
}

// Handle implements caddyevents.Handler.
func (r *EventRecorder) Handle(_ context.Context, e caddy.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
	return nil
}

// Events returns the events recorded so far, oldest first.
func (r *EventRecorder) Events() []caddy.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]caddy.Event(nil), r.events...)
}

// SubscribeEvents returns a context with an events app, loaded the way
// reverse_proxy loads it, and a recorder of the named events.
func SubscribeEvents(t testing.TB, names ...string) (caddy.Context, *EventRecorder) {
	t.Helper()
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	app, err := ctx.App("events")
	if err != nil {
		t.Fatal(err)
	}
	rec := new(EventRecorder)
	for _, n := range names {
		if err := app.(*caddyevents.App).On(n, rec); err != nil {
			t.Fatal(err)
		}
	}
	return ctx, rec
}
