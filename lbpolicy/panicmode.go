package lbpolicy

import (
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddy-lbx/lbx/internal/events"
)

// defaultPanicThreshold is the availability, in percent, below which a pool
// is in panic mode unless configured otherwise (Envoy's default).
const defaultPanicThreshold = 50.0

// panicMode decides, per request, whether a pool has so few available
// upstreams that health should be ignored, and logs and counts the
// transitions. It is shared by the least_time policy and the panic wrapper; the
// state it decides on is each pool's (panicState, in the pool's view).
type panicMode struct {
	threshold float64 // fraction of the pool, 0 disables
	policy    string
	logger    *zap.Logger
	events    events.Emitter
}

// panicState is one pool's panic mode: whether it is on, and how often it
// was entered.
type panicState struct {
	on      atomic.Bool
	entered atomic.Uint64
}

func newPanicMode(percent *float64, policy string, logger *zap.Logger, emitter events.Emitter) panicMode {
	p := defaultPanicThreshold
	if percent != nil {
		p = *percent
	}
	return panicMode{threshold: p / 100, policy: policy, logger: logger, events: emitter}
}

// check reports whether pool (described by v) is in panic mode at now: fewer
// than threshold of its members are available. One upstream short of the
// threshold is panic; exactly at it is not.
func (m *panicMode) check(v *poolView, pool reverseproxy.UpstreamPool, now int64) bool {
	if m.threshold <= 0 {
		return false
	}
	return m.decide(&v.panic, v.availability(pool, now), len(pool))
}

// decide applies the threshold to a count of available upstreams of the
// pool whose state is st and records a transition.
func (m *panicMode) decide(st *panicState, avail, total int) bool {
	panicking := float64(avail) < m.threshold*float64(total)
	if panicking != st.on.Load() && st.on.CompareAndSwap(!panicking, panicking) {
		m.transition(st, panicking, avail, total)
	}
	return panicking
}

func (m *panicMode) transition(st *panicState, on bool, avail, total int) {
	msg, lvl, event := "pool left panic mode; selecting among healthy upstreams again", zapcore.InfoLevel, eventPanicLeft
	if on {
		st.entered.Add(1)
		msg, lvl, event = "pool entered panic mode; selecting among all upstreams, ignoring health", zapcore.WarnLevel, eventPanicEntered
	}
	m.events.Emit(event, map[string]any{
		"policy": m.policy, "available": avail, "upstreams": total, "threshold_percent": m.threshold * 100,
	})
	if ce := m.logger.Check(lvl, msg); ce != nil {
		ce.Write(
			zap.String("policy", m.policy),
			zap.Int("available", avail),
			zap.Int("upstreams", total),
			zap.Float64("threshold_percent", m.threshold*100),
		)
	}
}

// percent returns the threshold as configured, in percent.
func (m *panicMode) percent() float64 { return m.threshold * 100 }
