package lbpolicy

import (
	"fmt"
	"math"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
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
