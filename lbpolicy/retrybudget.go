package lbpolicy

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// RetryBudget limits reverse_proxy's retries (lb_retries, lb_try_duration)
// so that a brown-out does not become a retry storm: a retry is allowed
// only while the retries in flight are fewer than `percent` of the requests
// in flight to the pool, or fewer than `min_concurrent`, whichever is larger
// (Envoy's retry budget). A refused retry ends the request with the error
// of its last attempt, as if no retries were left.
//
// A retry is recognised as a second selection for the same request; the
// policy marks the request's variables at its first selection.
type RetryBudget struct {
	// Retries in flight allowed, in percent of the requests in flight.
	// Default: 20.
	Percent *float64 `json:"percent,omitempty"`

	// Retries in flight always allowed, however few requests are in
	// flight. Default: 3.
	MinConcurrent *int `json:"min_concurrent,omitempty"`

	fraction float64
	floor    int64
	logger   *zap.Logger

	inFlight atomic.Int64  // retry attempts in flight
	refused  atomic.Uint64 // retries refused, in total
	// lastLogNs and loggedRefused rate-limit the log line about refusals.
	lastLogNs     atomic.Int64
	loggedRefused atomic.Uint64

	// first and retry mark a request: the address of first in its
	// variables says a first attempt was made, the address of retry in
	// its replacer that the attempt under way is a retry the budget
	// granted. Comparing pointers costs nothing per request.
	first, retry byte
}

// UnmarshalJSON decodes the configuration strictly, naming the option
// whose value does not decode.
func (x *RetryBudget) UnmarshalJSON(b []byte) error {
	type plain RetryBudget
	return jsonfield.Decode(b, (*plain)(x))
}

// Retry budget defaults, as in Envoy.
const (
	defaultRetryBudgetPercent       = 20.0
	defaultRetryBudgetMinConcurrent = 3
)

// retryBudgetVar is the request variable a policy with a retry budget
// marks requests with, and the replacer key it marks granted retries
// with. A retry must not write the variables: reverse_proxy's transport
// may still be dialing for an earlier attempt in the background, and its
// dial function reads them (a Go map, which a concurrent write crashes);
// the replacer is locked.
const retryBudgetVar = "lbx.retry_budget"

// provision applies defaults.
func (b *RetryBudget) provision(logger *zap.Logger) {
	b.logger = logger
	if b.Percent == nil {
		p := defaultRetryBudgetPercent
		b.Percent = &p
	}
	if b.MinConcurrent == nil {
		n := defaultRetryBudgetMinConcurrent
		b.MinConcurrent = &n
	}
	b.fraction = *b.Percent / 100
	b.floor = int64(*b.MinConcurrent)
}

// maxRetryBudgetFloor bounds min_concurrent: a floor of a million
// retries in flight is no budget at all.
const maxRetryBudgetFloor = 1_000_000

// validate checks the configuration.
func (b *RetryBudget) validate() error {
	if b.Percent != nil {
		if err := bounds.Percent("percent", *b.Percent); err != nil {
			return fmt.Errorf("retry_budget: %v", err)
		}
	}
	if err := b.checkFloor(); err != nil {
		return fmt.Errorf("retry_budget: %v", err)
	}
	return nil
}

// checkFloor is the rule for min_concurrent, shared with the Caddyfile
// parser.
func (b *RetryBudget) checkFloor() error {
	if b.MinConcurrent == nil {
		return nil
	}
	return bounds.Int("min_concurrent", *b.MinConcurrent, 0, maxRetryBudgetFloor)
}

// admit is called by a selection policy before it chooses an upstream for
// r. It reports false when r is a retry the budget cannot afford; the
// policy then chooses nothing. pool is what the requests in flight are
// counted over.
func (b *RetryBudget) admit(pool reverseproxy.UpstreamPool, r *http.Request) bool {
	if r == nil {
		return true
	}
	vars, _ := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	if vars == nil {
		return true
	}
	if vars[retryBudgetVar] != &b.first {
		vars[retryBudgetVar] = &b.first
		return true
	}
	if b.affordable(pool) {
		if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
			repl.Set(retryBudgetVar, &b.retry)
		}
		return true
	}
	b.refuse(pool)
	return false
}

// affordable reports whether one more retry fits the budget now.
func (b *RetryBudget) affordable(pool reverseproxy.UpstreamPool) bool {
	retries := b.inFlight.Load()
	if retries < b.floor {
		return true
	}
	requests := 0
	for _, u := range pool {
		requests += u.Host.NumRequests()
	}
	return float64(retries) < math.Floor(b.fraction*float64(requests))
}

// refuse counts a refused retry and logs refusals, at most once every
// retryBudgetLogEvery.
func (b *RetryBudget) refuse(pool reverseproxy.UpstreamPool) {
	n := b.refused.Add(1)
	now := monoclock.Now()
	last := b.lastLogNs.Load()
	if last != 0 && now-last < int64(retryBudgetLogEvery) || !b.lastLogNs.CompareAndSwap(last, now) {
		return
	}
	since := n - b.loggedRefused.Swap(n)
	if ce := b.logger.Check(zap.WarnLevel, "retry budget exhausted; retries refused"); ce != nil {
		ce.Write(zap.Uint64("refused", since), zap.Uint64("refused_total", n),
			zap.Int64("retries_in_flight", b.inFlight.Load()),
			zap.Float64("percent", *b.Percent), zap.Int("min_concurrent", *b.MinConcurrent),
			zap.Int("upstreams", len(pool)))
	}
}

// retryBudgetLogEvery is the least time between two log lines about
// refused retries.
const retryBudgetLogEvery = 10 * time.Second

// isRetry reports whether the attempt of the request with ctx is a retry
// the budget granted.
func (b *RetryBudget) isRetry(ctx context.Context) bool {
	repl, ok := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return false
	}
	v, _ := repl.Get(retryBudgetVar)
	return v == &b.retry
}
