package rebalance

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// EventShed is the Caddy event a node emits after each interval in which
// it shed connections, or closed shed ones that reached no response
// boundary within boundary_timeout. Data: node, metric, local (smoothed
// load), average (cluster average), members_counted, count (connections
// shed), idle, active, hijacked (count by kind), forced (shed earlier and
// closed this interval at boundary_timeout).
const EventShed = "rebalance_shed"

// emitter sends Caddy events on behalf of the rebalance app whose context
// it was made from. The zero emitter sends nothing.
type emitter struct {
	app *caddyevents.App
	ctx caddy.Context
}

// newEmitter returns an emitter for ctx's module, or the zero emitter when
// the config has no events app (it never creates one).
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

// emitShed announces an interval that shed res, or forced closes.
func (e emitter) emitShed(node, metric string, local float64, d Decision, res ShedResult, forced int) {
	e.emit(EventShed, map[string]any{
		"node":            node,
		"metric":          metric,
		"local":           local,
		"average":         d.Average,
		"members_counted": d.Counted,
		"count":           res.Total(),
		"idle":            res.Idle,
		"active":          res.Active,
		"hijacked":        res.Hijacked,
		"forced":          forced,
	})
}
