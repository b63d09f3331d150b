package rebalance

import (
	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// EventShed is the Caddy event a node emits after each interval in which
// it shed connections, or closed shed ones that reached no response
// boundary within boundary_timeout. Data: node, metric, local (smoothed
// load), average (cluster average), members_counted, count (connections
// shed), idle, active, hijacked (count by kind), forced (shed earlier and
// closed this interval at boundary_timeout).
const EventShed = "rebalance_shed"

// emitter is the rebalance app's events.Emitter, with the app's event.
type emitter struct{ events.Emitter }

// newEmitter returns an emitter for ctx's module (see events.New).
func newEmitter(ctx caddy.Context) emitter { return emitter{events.New(ctx)} }

// emitShed announces an interval that shed res, or forced closes.
func (e emitter) emitShed(node, metric string, local float64, d shed.Decision, res ShedResult, forced int) {
	e.Emit(EventShed, map[string]any{
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
