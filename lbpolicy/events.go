package lbpolicy

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// Events lbx emits through Caddy's events app, for other modules to
// subscribe to. Their data uses reverse_proxy's shape where it fits
// ("host": the dial address).
const (
	// EventUpstreamEjected: outlier detection ejected an upstream. Data:
	// host, reason, for_ms, ejections_in_a_row.
	EventUpstreamEjected = "upstream_ejected"
	// EventUpstreamRestored: an ejected upstream's time ran out; announced
	// with the first attempt made to it afterwards. Data: host.
	EventUpstreamRestored = "upstream_restored"
	// EventPanicEntered: a pool entered panic mode. Data: policy,
	// available, upstreams, threshold_percent.
	EventPanicEntered = "panic_entered"
	// EventPanicLeft: a pool left panic mode. Same data.
	EventPanicLeft = "panic_left"
)

// Emitter sends Caddy events on behalf of the module whose context it was
// made from. The zero Emitter sends nothing.
type Emitter struct {
	app *caddyevents.App
	ctx caddy.Context
}

// NewEmitter returns an Emitter for ctx's module. Without an events app in
// the config (as in unit tests with a bare context) it sends nothing;
// inside reverse_proxy there always is one, since the handler loads it.
func NewEmitter(ctx caddy.Context) Emitter {
	app, err := ctx.AppIfConfigured("events")
	if err != nil {
		return Emitter{}
	}
	return Emitter{app: app.(*caddyevents.App), ctx: ctx}
}

// Emit sends the event if anything could observe it.
func (e Emitter) Emit(name string, data map[string]any) {
	if e.app != nil && e.app.ShouldEmit(name) {
		e.app.Emit(e.ctx, name, data)
	}
}
