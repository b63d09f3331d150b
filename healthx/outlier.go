package healthx

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// Outlier configures outlier ejection from live traffic: an upstream that
// fails Consecutive attempts in a row is taken out of selection for a
// while, like Envoy's consecutive-5xx outlier detection. An ejected
// upstream returns by itself when its time is up; each ejection in a row
// lasts longer (base × number of ejections, capped), and the multiplier
// shrinks again while the upstream behaves.
type Outlier struct {
	// Failed attempts in a row that eject an upstream. Default: 5.
	Consecutive int `json:"consecutive_failures,omitempty"`

	// Response status codes that count as a failed attempt, besides
	// transport errors and timeouts. Default: [502, 503, 504].
	FailureStatus []int `json:"failure_status,omitempty"`

	// How long the first ejection lasts; the n-th in a row lasts n times
	// as long. Default: 30s.
	BaseEjectionTime caddy.Duration `json:"base_ejection_time,omitempty"`

	// The longest an ejection lasts. Default: 300s.
	MaxEjectionTime caddy.Duration `json:"max_ejection_time,omitempty"`

	// The most upstreams of the pool that may be ejected at once, in
	// percent; one upstream may always be ejected. An upstream that
	// reaches the failure count while the pool is at the cap stays in
	// (and is logged). Default: 10.
	MaxEjectionPercent *float64 `json:"max_ejection_percent,omitempty"`

	logger *zap.Logger
	events Emitter
}

// Outlier defaults, as in Envoy.
const (
	DefaultConsecutiveFailures = 5
	DefaultBaseEjectionTime    = 30 * time.Second
	DefaultMaxEjectionTime     = 300 * time.Second
	DefaultMaxEjectionPercent  = 10.0
)

// Provision applies defaults and sets where ejections are logged and
// announced.
func (o *Outlier) Provision(logger *zap.Logger, events Emitter) {
	o.logger, o.events = logger, events
	if o.Consecutive == 0 {
		o.Consecutive = DefaultConsecutiveFailures
	}
	if o.FailureStatus == nil {
		o.FailureStatus = []int{502, 503, 504}
	}
	if o.BaseEjectionTime == 0 {
		o.BaseEjectionTime = caddy.Duration(DefaultBaseEjectionTime)
	}
	if o.MaxEjectionTime == 0 {
		o.MaxEjectionTime = caddy.Duration(max(DefaultMaxEjectionTime, time.Duration(o.BaseEjectionTime)))
	}
	if o.MaxEjectionPercent == nil {
		p := DefaultMaxEjectionPercent
		o.MaxEjectionPercent = &p
	}
}

// Validate checks the configuration.
func (o *Outlier) Validate() error {
	switch {
	case o.Consecutive < 1:
		return fmt.Errorf("outlier: consecutive_failures must be at least 1, got %d", o.Consecutive)
	case o.BaseEjectionTime < 0:
		return fmt.Errorf("outlier: base_ejection_time must be positive, got %v", time.Duration(o.BaseEjectionTime))
	case o.MaxEjectionTime < o.BaseEjectionTime:
		return fmt.Errorf("outlier: max_ejection_time %v is shorter than base_ejection_time %v",
			time.Duration(o.MaxEjectionTime), time.Duration(o.BaseEjectionTime))
	case o.MaxEjectionPercent != nil && CheckPercent(*o.MaxEjectionPercent) != nil:
		return fmt.Errorf("outlier: max_ejection_percent must be between 0 and 100, got %v", *o.MaxEjectionPercent)
	}
	for _, c := range o.FailureStatus {
		if c < 100 || c > 599 {
			return fmt.Errorf("outlier: failure_status %d is not an HTTP status code", c)
		}
	}
	return nil
}

// failedStatus reports whether a response status counts as a failure.
func (o *Outlier) failedStatus(code int) bool { return slices.Contains(o.FailureStatus, code) }

// ejectionTime is how long the multiplier-th ejection in a row lasts.
func (o *Outlier) ejectionTime(multiplier int64) time.Duration {
	d := time.Duration(o.BaseEjectionTime) * time.Duration(multiplier)
	return min(d, time.Duration(o.MaxEjectionTime))
}

// mayEject reports whether one more upstream may be ejected from a pool of
// total of which ejected are out: at most MaxEjectionPercent, and always
// at least one.
func (o *Outlier) mayEject(ejected, total int) bool {
	limit := max(int(math.Floor(*o.MaxEjectionPercent/100*float64(total))), 1)
	return ejected < limit
}

// judge records one attempt's outcome on s and ejects it when it has failed
// too often in a row and the pool's cap allows.
func (o *Outlier) judge(t *hoststate.Table, s *hoststate.Stats, dial string, failed bool) {
	n := s.RecordOutcome(failed)
	now := hoststate.Now()
	if s.TakeRestored(now) {
		if ce := o.logger.Check(zap.InfoLevel, "upstream restored after ejection"); ce != nil {
			ce.Write(zap.String("upstream", dial))
		}
		o.events.Emit(EventUpstreamRestored, map[string]any{"host": dial})
	}
	if n < int64(o.Consecutive) || s.Ejected(now) {
		return
	}
	ejected, total := t.CountEjected(now)
	if !o.mayEject(ejected, total) {
		if ce := o.logger.Check(zap.WarnLevel, "outlier not ejected: pool at max_ejection_percent"); ce != nil && n == int64(o.Consecutive) {
			ce.Write(zap.String("upstream", dial), zap.Int("ejected", ejected), zap.Int("upstreams", total),
				zap.Float64("max_ejection_percent", *o.MaxEjectionPercent))
		}
		return
	}
	until, m := s.Eject(now, time.Duration(o.BaseEjectionTime), o.ejectionTime)
	d := time.Duration(until - now)
	if ce := o.logger.Check(zap.WarnLevel, "upstream ejected"); ce != nil {
		ce.Write(zap.String("upstream", dial), zap.String("reason", "consecutive_failures"),
			zap.Int("consecutive_failures", o.Consecutive), zap.Int64("ejections_in_a_row", m),
			zap.Duration("for", d))
	}
	o.events.Emit(EventUpstreamEjected, map[string]any{
		"host": dial, "reason": "consecutive_failures", "for_ms": d.Milliseconds(), "ejections_in_a_row": m,
	})
}

// UnmarshalCaddyfile reads an outlier block, the dispenser on its name:
//
//	outlier {
//		consecutive_failures <n>
//		failure_status       <code...>
//		base_ejection_time   <duration>
//		max_ejection_time    <duration>
//		max_ejection_percent <percent>
//	}
func (o *Outlier) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("outlier: %s specified more than once", opt)
		}
		seen[opt] = true
		switch opt {
		case "consecutive_failures":
			if !d.NextArg() {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(d.Val())
			if err != nil || n < 1 {
				return d.Errf("outlier: invalid consecutive_failures %q: want a whole number of at least 1", d.Val())
			}
			o.Consecutive = n
		case "failure_status":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			o.FailureStatus = []int{}
			for _, a := range args {
				c, err := strconv.Atoi(a)
				if err != nil || c < 100 || c > 599 {
					return d.Errf("outlier: invalid failure_status %q: want HTTP status codes", a)
				}
				o.FailureStatus = append(o.FailureStatus, c)
			}
		case "base_ejection_time", "max_ejection_time":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil || dur <= 0 {
				return d.Errf("outlier: invalid %s %q: want a positive duration", opt, d.Val())
			}
			if opt == "base_ejection_time" {
				o.BaseEjectionTime = caddy.Duration(dur)
			} else {
				o.MaxEjectionTime = caddy.Duration(dur)
			}
		case "max_ejection_percent":
			p, err := ParsePercent(d, "outlier")
			if err != nil {
				return err
			}
			o.MaxEjectionPercent = &p
		default:
			return d.Errf("outlier: unrecognized option %q", opt)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}
