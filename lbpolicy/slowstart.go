package lbpolicy

import (
	"fmt"
	"math"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// SlowStart ramps up the share of an upstream that joins a pool already
// serving, or returns to it, so that a cold host (empty caches, JIT not
// warm, connection pools empty) is not handed a full share at once. For
// `window` after its (re)start, the upstream's effective weight is
//
//	weight × max(min_weight_percent/100, (elapsed / window) ^ (1 / aggression))
//
// as in Envoy. An upstream (re)starts when it first appears in a pool whose
// other members have already served traffic (when a whole pool is new, no
// one ramps: there is nothing to protect it from), when its outlier
// ejection ends, and when Caddy's health checks see it healthy again after
// it was unhealthy.
type SlowStart struct {
	// How long the ramp lasts. Required.
	Window caddy.Duration `json:"window,omitempty"`

	// The effective weight at the start of the ramp, in percent of the
	// full weight. Default: 10.
	MinWeightPercent *float64 `json:"min_weight_percent,omitempty"`

	// The shape of the ramp: 1 is linear; above 1 the weight rises faster
	// early on, below 1 it rises slowly first. Default: 1.
	Aggression float64 `json:"aggression,omitempty"`

	windowNs  int64
	floor     float64
	exponent  float64
	invWindow float64
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *SlowStart) UnmarshalJSON(b []byte) error {
	type plain SlowStart
	return jsonfield.Decode(b, (*plain)(x))
}

// defaultSlowStartMinWeight is the default floor of the ramp, in percent
// (Envoy's default).
const defaultSlowStartMinWeight = 10.0

// provision applies defaults.
func (s *SlowStart) provision() {
	if s.MinWeightPercent == nil {
		p := defaultSlowStartMinWeight
		s.MinWeightPercent = &p
	}
	if s.Aggression == 0 {
		s.Aggression = 1
	}
	s.windowNs = int64(s.Window)
	s.floor = *s.MinWeightPercent / 100
	s.exponent = 1 / s.Aggression
	if s.windowNs > 0 {
		s.invWindow = 1 / float64(s.windowNs)
	}
}

// Bounds of the slow-start options: a ramp is warm-up time for a cold
// host, seconds to minutes; a day-long one never ends in practice.
const (
	minSlowStartWindow = time.Millisecond
	maxSlowStartWindow = 24 * time.Hour
	maxAggression      = 100
)

// validate checks the configuration.
func (s *SlowStart) validate() error {
	for _, opt := range []string{"window", "min_weight", "aggression"} {
		if opt == "aggression" && s.Aggression == 0 {
			continue // the default
		}
		if err := s.check(opt); err != nil {
			return fmt.Errorf("slow_start: %v", err)
		}
	}
	return nil
}

// check is the rule for the value of one option (by its Caddyfile name):
// validate applies every rule, and the Caddyfile parser each option's as
// it reads it, so that the error has its line. An aggression of 0 is the
// default, set by provision before validate.
func (s *SlowStart) check(opt string) error {
	switch opt {
	case "window":
		return bounds.Duration(opt, time.Duration(s.Window), minSlowStartWindow, maxSlowStartWindow)
	case "min_weight":
		if s.MinWeightPercent == nil {
			return nil
		}
		if *s.MinWeightPercent == 0 {
			return fmt.Errorf("min_weight_percent must be above 0%%: a host at weight 0 would never be tried")
		}
		return bounds.Percent("min_weight_percent", *s.MinWeightPercent)
	case "aggression":
		return bounds.Positive(opt, s.Aggression, maxAggression)
	}
	return nil
}

// ramping reports whether an upstream whose ramp began at start is still
// ramping at now; small enough to inline, for the common case.
func (s *SlowStart) ramping(start, now int64) bool {
	return start != 0 && now-start < s.windowNs && now >= start
}

// factor returns the fraction of its weight an upstream whose ramp began
// at start (ns, hoststate clock; 0 if it never began) has at now: 1 when
// it is not ramping, else in [floor, 1).
func (s *SlowStart) factor(start, now int64) float64 {
	elapsed := now - start
	if start == 0 || elapsed >= s.windowNs || elapsed < 0 {
		return 1
	}
	f := float64(elapsed) * s.invWindow
	if s.exponent != 1 {
		f = math.Pow(f, s.exponent)
	}
	return max(f, s.floor)
}

// watch sets up the ramps of a new view's members (v.members must be
// set): members new to a pool already serving start theirs now, and a
// count that sees a member healthy again after it was unhealthy starts
// its ramp then (see poolView.noteHealth). The end of an ejection needs
// nothing here: RampStart reads it from the member's state. Every policy
// with slow start builds its views through this, so the triggers are the
// same everywhere.
func (s *SlowStart) watch(v *poolView, logger *zap.Logger) {
	v.returned = func(v *poolView, i int, now int64) {
		v.members[i].stats.StartRamp(now)
		s.logRamp(logger, v.ups[i].Dial, "healthy_again")
	}
	s.rampNewMembers(v, logger)
}

// rampNewMembers starts the slow start of members that have never served
// a request, provided some other member has: joining a pool that serves.
// When the whole pool is new nobody ramps.
func (s *SlowStart) rampNewMembers(v *poolView, logger *zap.Logger) {
	serving := false
	for i := range v.members {
		if v.members[i].stats.Served() {
			serving = true
			break
		}
	}
	if !serving {
		return
	}
	now := monoclock.Now()
	for i := range v.members {
		if v.members[i].stats.StartRampIfNew(now) {
			s.logRamp(logger, v.ups[i].Dial, "new")
		}
	}
}

// logRamp logs the start of an upstream's ramp, once per start.
func (s *SlowStart) logRamp(logger *zap.Logger, dial, why string) {
	if ce := logger.Check(zap.InfoLevel, "upstream slow start"); ce != nil {
		ce.Write(zap.String("upstream", dial), zap.String("reason", why),
			zap.Stringer("window", time.Duration(s.Window)),
			zap.Float64("min_weight_percent", *s.MinWeightPercent))
	}
}

// percent returns the effective weight of the upstream whose state is
// stats at now, in percent of its weight, for reports; nil when it is not
// ramping.
func (s *SlowStart) percent(stats *hoststate.Stats, now int64) *float64 {
	f := s.factor(stats.RampStart(now), now)
	if f >= 1 {
		return nil
	}
	pct := f * 100
	return &pct
}

// rampingIn returns, for reports, whether member i of v is ramping at
// now; nil when s is nil (slow start off) or v has no member state.
func (s *SlowStart) rampingIn(v *poolView, now int64) func(i int) bool {
	if s == nil || v.members == nil {
		return nil
	}
	return func(i int) bool { return s.factor(v.members[i].stats.RampStart(now), now) < 1 }
}
