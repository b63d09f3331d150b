// Package events sends lbx's Caddy events through the events app of the
// config a module runs in, for every lbx module the same way.
package events

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// Emitter sends Caddy events on behalf of the module whose context it was
// made from. The zero Emitter sends nothing.
type Emitter struct {
	app *caddyevents.App
	ctx caddy.Context
}

// New returns an Emitter for ctx's module. Without an events app in the
// config (as with a bare context in unit tests) it sends nothing: it never
// creates one. Inside reverse_proxy there always is one, since the handler
// loads it.
func New(ctx caddy.Context) Emitter {
	app, err := ctx.AppIfConfigured("events")
	if err != nil {
		return Emitter{}
	}
	return Emitter{app: app.(*caddyevents.App), ctx: ctx}
}

// Emit sends the event name with data if any handler could observe it.
func (e Emitter) Emit(name string, data map[string]any) {
	if e.app != nil && e.app.ShouldEmit(name) {
		e.app.Emit(e.ctx, name, data)
	}
}
