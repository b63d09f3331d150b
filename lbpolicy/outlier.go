package lbpolicy

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// Outlier configures outlier ejection from live traffic, like Envoy's
// outlier detection: an upstream is taken out of selection for a while when
// it fails `consecutive_failures` attempts in a row, when (every `interval`)
// its success rate is far below that of the rest of the pool, or, if
// `failure_percentage_threshold` is set, when its share of failed attempts is
// above that threshold. An ejected upstream returns by itself when its time
// is up; each ejection in a row lasts longer (base × number of ejections,
// capped), and the multiplier shrinks again while the upstream behaves.
type Outlier struct {
	// Failed attempts in a row that eject an upstream. Default: 5.
	Consecutive int `json:"consecutive_failures,omitempty"`

	// Response status codes that count as a failed attempt, besides
	// transport errors and timeouts, for ejection and for the latency
	// estimate. Default: [502, 503, 504], which is also what counts as
	// failed without an outlier block.
	FailureStatus []int `json:"failure_status,omitempty"`

	// How long the first ejection lasts; the n-th in a row lasts n times
	// as long. Default: 30s.
	BaseEjectionTime caddy.Duration `json:"base_ejection_time,omitempty"`

	// The longest an ejection lasts. Default: 300s.
	MaxEjectionTime caddy.Duration `json:"max_ejection_time,omitempty"`

	// The most upstreams of the pool that may be ejected at once, in
	// percent; one upstream may always be ejected. An upstream that
	// reaches the failure count while the pool is at the cap stays in
	// (and is logged); the interval rules eject the worst upstreams first
	// and log the ones left in once per evaluation. Default: 10.
	MaxEjectionPercent *float64 `json:"max_ejection_percent,omitempty"`

	// How often success rates and failure percentages are evaluated; each
	// evaluation looks at the attempts judged since the previous one.
	// Default: 10s.
	Interval caddy.Duration `json:"interval,omitempty"`

	// Turns success-rate ejection off. It is on by default: every
	// `interval`, when at least `success_rate_min_hosts` upstreams of the
	// pool had at least `success_rate_min_requests` attempts each, an
	// upstream among them whose success rate is below mean −
	// `success_rate_stdev_factor` × standard deviation (of those upstreams' success rates) is ejected.
	// Default: false.
	DisableSuccessRate bool `json:"disable_success_rate,omitempty"`

	// How many upstreams must have had `success_rate_min_requests`
	// attempts in an interval for success rates to be compared. Default: 5.
	SuccessRateMinHosts int `json:"success_rate_min_hosts,omitempty"`

	// How many attempts an upstream needs in an interval for its success
	// rate to count. Default: 100.
	SuccessRateMinRequests int `json:"success_rate_min_requests,omitempty"`

	// How many standard deviations below the mean success rate an
	// upstream's must be for it to be ejected. Default: 1.9.
	SuccessRateStdevFactor float64 `json:"success_rate_stdev_factor,omitempty"`

	// The failure percentage, from 0 to 100, above which an upstream with
	// `failure_percentage_min_requests` attempts in an interval is
	// ejected, provided at least `failure_percentage_min_hosts` upstreams
	// had that many.
	// Default: none (failure-percentage ejection is off).
	FailurePercentageThreshold *float64 `json:"failure_percentage_threshold,omitempty"`

	// How many upstreams must have had `failure_percentage_min_requests`
	// attempts in an interval for failure percentages to be judged.
	// Default: 5.
	FailurePercentageMinHosts int `json:"failure_percentage_min_hosts,omitempty"`

	// How many attempts an upstream needs in an interval for its failure
	// percentage to be judged. Default: 50.
	FailurePercentageMinRequests int `json:"failure_percentage_min_requests,omitempty"`

	// Keeps an ejected upstream out until its time is up even when the
	// handler's active health checks pass. By default, as in Envoy, as
	// many passing checks in a row as health_passes end an ejection
	// early; turn that off when the health endpoint can pass while real
	// requests fail. Default: false.
	KeepEjectedOnHealthCheck bool `json:"keep_ejected_on_health_check,omitempty"`

	logger *zap.Logger
	events events.Emitter
	// sweepDone is closed when the interval loop started by install ends;
	// nil when none was started.
	sweepDone chan struct{}
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *Outlier) UnmarshalJSON(b []byte) error {
	type plain Outlier
	return jsonfield.Decode(b, (*plain)(x))
}

// Outlier defaults, as in Envoy.
const (
	defaultConsecutiveFailures = 5
	defaultBaseEjectionTime    = 30 * time.Second
	defaultMaxEjectionTime     = 300 * time.Second
	defaultMaxEjectionPercent  = 10.0

	defaultOutlierInterval              = 10 * time.Second
	defaultSuccessRateMinHosts          = 5
	defaultSuccessRateMinRequests       = 100
	defaultSuccessRateStdevFactor       = 1.9
	defaultFailurePercentageMinHosts    = 5
	defaultFailurePercentageMinRequests = 50
)

// defaultFailureStatus is the response statuses that count as a failed
// attempt: an outlier block's failure_status when it gives none, and the
// rule for every observed attempt when there is no outlier block. Not to
// be modified.
var defaultFailureStatus = []int{502, 503, 504}

// provision applies defaults and sets where ejections are logged and
// announced.
func (o *Outlier) provision(logger *zap.Logger, emitter events.Emitter) {
	o.logger, o.events = logger, emitter
	if o.Consecutive == 0 {
		o.Consecutive = defaultConsecutiveFailures
	}
	if o.FailureStatus == nil {
		o.FailureStatus = slices.Clone(defaultFailureStatus)
	}
	if o.BaseEjectionTime == 0 {
		o.BaseEjectionTime = caddy.Duration(defaultBaseEjectionTime)
	}
	if o.MaxEjectionTime == 0 {
		o.MaxEjectionTime = caddy.Duration(max(defaultMaxEjectionTime, time.Duration(o.BaseEjectionTime)))
	}
	if o.MaxEjectionPercent == nil {
		p := defaultMaxEjectionPercent
		o.MaxEjectionPercent = &p
	}
	if o.Interval == 0 {
		o.Interval = caddy.Duration(defaultOutlierInterval)
	}
	if o.SuccessRateMinHosts == 0 {
		o.SuccessRateMinHosts = defaultSuccessRateMinHosts
	}
	if o.SuccessRateMinRequests == 0 {
		o.SuccessRateMinRequests = defaultSuccessRateMinRequests
	}
	if o.SuccessRateStdevFactor == 0 {
		o.SuccessRateStdevFactor = defaultSuccessRateStdevFactor
	}
	if o.FailurePercentageMinHosts == 0 {
		o.FailurePercentageMinHosts = defaultFailurePercentageMinHosts
	}
	if o.FailurePercentageMinRequests == 0 {
		o.FailurePercentageMinRequests = defaultFailurePercentageMinRequests
	}
}

// Bounds of the outlier options. The interval rules compare rates over an
// interval, so one much shorter than a second judges too few attempts to
// mean anything, while a ticker at nanoseconds burns a core; ejections
// longer than a day are an outage in slow motion.
const (
	minOutlierInterval = 100 * time.Millisecond
	maxOutlierInterval = time.Hour
	minEjectionTime    = time.Millisecond
	maxEjectionTime    = 24 * time.Hour
	maxOutlierCount    = 1_000_000_000
	maxStdevFactor     = 100
)

// outlierOptions lists the options check knows, in the order validate
// reports them.
var outlierOptions = []string{
	"consecutive_failures", "failure_status", "base_ejection_time", "max_ejection_time",
	"max_ejection_percent", "interval", "success_rate_min_hosts", "success_rate_min_requests",
	"success_rate_stdev_factor", "failure_percentage_threshold", "failure_percentage_min_hosts",
	"failure_percentage_min_requests",
}

// validate checks the configuration.
func (o *Outlier) validate() error {
	for _, opt := range outlierOptions {
		if err := o.check(opt); err != nil {
			return fmt.Errorf("outlier: %v", err)
		}
	}
	return nil
}

// check is the rule for the value of one option: validate applies every
// rule, and the Caddyfile parser each option's as it reads it, so that the
// error has its line. A duration or count of 0 is the default, set by
// provision before validate; in a Caddyfile it is an error.
func (o *Outlier) check(opt string) error {
	switch opt {
	case "consecutive_failures":
		return bounds.Int(opt, o.Consecutive, 1, maxOutlierCount)
	case "success_rate_min_hosts":
		return bounds.Int(opt, o.SuccessRateMinHosts, 1, maxOutlierCount)
	case "success_rate_min_requests":
		return bounds.Int(opt, o.SuccessRateMinRequests, 1, maxOutlierCount)
	case "failure_percentage_min_hosts":
		return bounds.Int(opt, o.FailurePercentageMinHosts, 1, maxOutlierCount)
	case "failure_percentage_min_requests":
		return bounds.Int(opt, o.FailurePercentageMinRequests, 1, maxOutlierCount)
	case "failure_status":
		for _, c := range o.FailureStatus {
			if c < 100 || c > 599 {
				return fmt.Errorf("failure_status %d is not an HTTP status code", c)
			}
		}
	case "base_ejection_time":
		return bounds.Duration(opt, time.Duration(o.BaseEjectionTime), minEjectionTime, maxEjectionTime)
	case "max_ejection_time":
		if err := bounds.Duration(opt, time.Duration(o.MaxEjectionTime), minEjectionTime, maxEjectionTime); err != nil {
			return err
		}
		if o.BaseEjectionTime != 0 && o.MaxEjectionTime < o.BaseEjectionTime {
			return fmt.Errorf("max_ejection_time %v is shorter than base_ejection_time %v",
				time.Duration(o.MaxEjectionTime), time.Duration(o.BaseEjectionTime))
		}
	case "interval":
		return bounds.Duration(opt, time.Duration(o.Interval), minOutlierInterval, maxOutlierInterval)
	case "success_rate_stdev_factor":
		return bounds.Positive(opt, o.SuccessRateStdevFactor, maxStdevFactor)
	case "max_ejection_percent":
		if o.MaxEjectionPercent != nil {
			return bounds.Percent(opt, *o.MaxEjectionPercent)
		}
	case "failure_percentage_threshold":
		if o.FailurePercentageThreshold != nil {
			return bounds.Percent(opt, *o.FailurePercentageThreshold)
		}
	}
	return nil
}

// failedStatus reports whether a response status counts as a failure.
func (o *Outlier) failedStatus(code int) bool { return slices.Contains(o.FailureStatus, code) }

// ejectionTime is how long the multiplier-th ejection in a row lasts.
func (o *Outlier) ejectionTime(multiplier int64) time.Duration {
	base, most := time.Duration(o.BaseEjectionTime), time.Duration(o.MaxEjectionTime)
	if base <= 0 || multiplier > int64(most/base) {
		return most // and no overflow, however long the run of ejections
	}
	return base * time.Duration(multiplier)
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
	now := monoclock.Now()
	if s.TakeRestored(now) {
		o.announceRestored(dial, "ejection_time_elapsed")
	}
	if n < int64(o.Consecutive) || s.Ejected(now) {
		return
	}
	t.LockEjections()
	defer t.UnlockEjections()
	ejected, total := t.CountEjected(now)
	if !o.mayEject(ejected, total) {
		s.NoteOverflow()
		if ce := o.logger.Check(zap.WarnLevel, "outlier not ejected: pool at max_ejection_percent"); ce != nil && n == int64(o.Consecutive) {
			ce.Write(zap.String("upstream", dial), zap.String("reason", hoststate.ReasonConsecutiveFailures.String()),
				zap.Int("ejected", ejected), zap.Int("upstreams", total),
				zap.Float64("max_ejection_percent", *o.MaxEjectionPercent))
		}
		return
	}
	o.eject(s, now, hoststate.ReasonConsecutiveFailures, zap.Int("consecutive_failures", o.Consecutive))
}

// eject ejects s for reason, with the backoff multiplier, and logs and
// announces it; detail is added to the log line. It is the one ejection
// path of every rule. It reports false when s was already ejected.
func (o *Outlier) eject(s *hoststate.Stats, now int64, reason hoststate.EjectReason, detail ...zap.Field) bool {
	until, m, ok := s.Eject(now, time.Duration(o.BaseEjectionTime), o.ejectionTime, reason)
	if !ok {
		return false
	}
	d := time.Duration(until - now)
	if ce := o.logger.Check(zap.WarnLevel, "upstream ejected"); ce != nil {
		fields := append([]zap.Field{zap.String("upstream", s.Dial()), zap.String("reason", reason.String())}, detail...)
		ce.Write(append(fields, zap.Int64("ejections_in_a_row", m), zap.Stringer("for", d))...)
	}
	o.events.Emit(eventUpstreamEjected, map[string]any{
		"host": s.Dial(), "reason": reason.String(), "for_ms": d.Milliseconds(), "ejections_in_a_row": m,
	})
	return true
}
