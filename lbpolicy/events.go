package lbpolicy

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// Events lbx emits through Caddy's events app, for other modules to
// subscribe to. Their data uses reverse_proxy's shape where it fits
// ("host": the dial address).
const (
	// eventUpstreamEjected: outlier detection ejected an upstream. Data:
	// host, reason, for_ms, ejections_in_a_row.
	eventUpstreamEjected = "upstream_ejected"
	// eventUpstreamRestored: an ejected upstream's time ran out; announced
	// with the first attempt made to it afterwards. Data: host.
	eventUpstreamRestored = "upstream_restored"
	// eventPanicEntered: a pool entered panic mode. Data: policy,
	// available, upstreams, threshold_percent.
	eventPanicEntered = "panic_entered"
	// eventPanicLeft: a pool left panic mode. Same data.
	eventPanicLeft = "panic_left"
)

// emitter sends Caddy events on behalf of the module whose context it was
// made from. The zero emitter sends nothing.
type emitter struct {
	app *caddyevents.App
	ctx caddy.Context
}

// newEmitter returns an emitter for ctx's module. Without an events app in
// the config (as in unit tests with a bare context) it sends nothing;
// inside reverse_proxy there always is one, since the handler loads it.
func newEmitter(ctx caddy.Context) emitter {
	app, err := ctx.AppIfConfigured("events")
	if err != nil {
		return emitter{}
	}
	return emitter{app: app.(*caddyevents.App), ctx: ctx}
}

// emit sends the event if anything could observe it.
func (e emitter) emit(name string, data map[string]any) {
	if e.app != nil && e.app.ShouldEmit(name) {
		e.app.Emit(e.ctx, name, data)
	}
}
