// Package selective provides the selective handler, brpc's SelectiveChannel
// in Caddy: it balances requests among named groups of upstreams (data
// centres, clusters, DNS names), retries a failed call on another group
// after the group's own retries, and can send a backup request to another
// group when the first has not answered within a delay.
//
// A group is a list of routes, usually one reverse_proxy with its own
// upstreams, load balancing, retries and transport; it may instead be a
// partition fan-out or another selective. Every attempt on a group is an
// isolated copy of the client request (its own placeholders and
// variables); the first to answer with a status that is not a failure
// wins and streams to the client, and the others are cancelled down to
// their backends.
package selective

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
)

func init() {
	caddy.RegisterModule(new(Handler))
}

// Handler balances each request among its `groups`: it chooses a group
// by its `policy`, sends the request through the group's routes, retries a failed
// call on another group up to `max_retry` times, and, with `backup_request` or
// `backup_request_auto` set, sends a second attempt to an idle replica the
// call is not using (in another group, or the same one) if the first has
// not answered within the delay and looks stuck rather than queued,
// taking whichever answers first. The rules for when and where a backup
// goes, and for its budget, are stated once in docs/selective.md
// ("Backup requests").
//
// A call fails, for retries, as `retry_on` says: by default on a dial error,
// a timeout, another proxy error (a reset, a closed connection) and the
// statuses 502, 503 and 504. A request whose method is not safe is
// retried only on dial errors (the request never reached a backend),
// unless `retry_any_method` is set, as in Caddy's reverse_proxy.
// When every attempt failed, the client gets the last failure: its
// response as the group answered it, or the group's error (502, or 504
// for a timeout), for handle_errors.
//
// Placeholders of the client request, for logs and later handlers:
// {http.selective.group} (the group that answered), {http.selective.attempts},
// {http.selective.tried} (the groups tried, in order, comma-separated),
// {http.selective.backup} (none, sent, won, queued, refused or busy) and
// {http.selective.error} (the last failure, when the call failed). The
// answering attempt's reverse_proxy placeholders, such as
// {http.reverse_proxy.upstream.hostport}, are copied to the client
// request. The access log gets a field selective_group.
type Handler struct {
	// The groups, at least one and at most 64, each with a unique name.
	Groups []*Group `json:"groups,omitempty"`

	// How a group is chosen for each attempt. Default: latency.
	Policy *Policy `json:"policy,omitempty"`

	// How many times a failed call is retried on another group, after the
	// group's own retries (its reverse_proxy's lb_retries). Each retry goes
	// to a group this request has not tried while there is one. A backup
	// request is not a retry. From 0 to 16. Default: 1.
	MaxRetry *int `json:"max_retry,omitempty"`

	// What counts as a failure to retry: "dial" (no connection was made),
	// "timeout", "error" (any other error of the group: a reset, a closed
	// connection, no upstream available) and status codes from 100 to 599
	// as strings, e.g. "503". Giving the list replaces the default:
	// ["dial", "timeout", "error", "502", "503", "504"].
	RetryOn []string `json:"retry_on,omitempty"`

	// Retry requests of any method on every failure RetryOn lists. By
	// default a request that may have reached a backend is retried only
	// when its method is safe (GET, HEAD, OPTIONS or TRACE; Caddy's
	// reverse_proxy retries GET only); a dial error is retried whatever
	// the method. The body is replayed from memory. Default: false.
	RetryAnyMethod bool `json:"retry_any_method,omitempty"`

	// The delay after which a request that has not had response headers
	// yet may be sent a second time, the first answer winning: brpc's
	// backup_request_ms. The backup is sent only when the first attempt
	// looks stuck (its replica has finished nothing for half the delay;
	// one making progress is merely queued, and is looked at again every
	// half delay), and only to a replica with spare capacity that the
	// call is not using: another group's, or another in the same group.
	// Only requests matching BackupMatch are hedged, within BackupBudget.
	// From 1ms to 1h. Default: 0 (no backup requests, unless
	// backup_request_auto is set).
	BackupRequest caddy.Duration `json:"backup_request,omitempty"`
	// Set the backup delay from each group's own recent answer latencies
	// instead of a fixed backup_request (not both): the delay for a call
	// is a high quantile of the latencies of the group its first attempt
	// went to. Default: off.
	BackupRequestAuto *BackupAuto `json:"backup_request_auto,omitempty"`

	// The requests that may be sent twice (a backup request), as matcher
	// sets, any of which must match. Default: method GET or HEAD, without
	// an Upgrade header.
	BackupMatchRaw caddyhttp.RawMatcherSets `json:"backup_match,omitempty" caddy:"namespace=http.matchers"`

	// The most backup requests, as a percentage of the calls this handler
	// serves, so that hedging never doubles the load during a brown-out: a
	// token bucket that each call fills by this share of one backup request
	// and holds at most 10 of them. Refused backups are counted. Above 0,
	// at most 100. Default: 10.
	BackupBudget *float64 `json:"backup_budget,omitempty"`

	// The deadline of the whole call, from the moment the handler starts:
	// reading the request body, all attempts and the response body. A
	// request body not received by then is answered 408 Request Timeout
	// (no group has seen the request). A selective or partition nested in
	// a group takes this deadline instead of its own timeout (brpc's
	// rule: the outer channel's timeout overrides its sub-channels'). A
	// group's transport timeouts still bound each of its own round trips.
	// From 1ms to 24h. Default: 0 (none of its own; an outer one still
	// applies, and without one the body is bounded by the server's read
	// timeouts only: read_idle_timeout, 1m by default, and read_body).
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// The largest request body kept in memory to replay on a retry or a
	// backup request, in bytes. A larger body is streamed to one group,
	// and that call is neither retried nor hedged. From 1 B to 1 GiB.
	// Default: 1 MiB.
	MaxReplayBody int64 `json:"max_replay_body,omitempty"`

	// A response header that names the group that answered, the attempts
	// made and the backup request, e.g. "X-Selective: dc2; attempts=2;
	// tried=dc1,dc2; backup=none". Default: empty (no header).
	StatusHeader string `json:"status_header,omitempty"`

	groups      []*group
	retryOn     retrySet
	maxRetry    int
	backupMatch caddyhttp.MatcherSets
	budget      *budget
	// table holds the estimator settings and the groups' baseline latency
	// (the same estimator as lb_policy least_time's); the groups' states are
	// kept outside its registry, in groupStates.
	table  *hoststate.Table
	server *caddyhttp.Server
	logger *zap.Logger
	events events.Emitter
	// calls counts the calls served, for the admin view.
	calls atomic.Uint64
	// backupBusy counts backup requests not sent because the group
	// chosen had no spare capacity (see group.spare).
	backupBusy atomic.Uint64
	// backupQueued counts calls whose backup was held back because the
	// first attempt was queued at a replica making progress, not stuck.
	backupQueued atomic.Uint64
}

// Group is one group of Handler: a name, a weight, and the routes that
// answer a request sent to it.
type Group struct {
	// The group's name, unique within the handler: 1 to 64 letters,
	// digits, '.', '-' or '_'. It names the group in placeholders, the
	// status header, the admin view and metrics, and, with the routes,
	// keys the state kept across config reloads: a group that keeps its
	// name and routes keeps its latency estimate and in-flight count.
	Name string `json:"name,omitempty"`

	// The group's weight: its capacity is its usable upstreams times the
	// weight (brpc: a channel's capacity is its servers'), and the hash
	// policy spreads keys in proportion to it. From 1 to 1000000. Default: 1.
	Weight int `json:"weight,omitempty"`

	// The routes a request sent to the group goes through, as in a
	// subroute: usually one reverse_proxy handler. A group that writes no
	// response fails with 502. A reverse_proxy here (or in a subroute
	// here) with no selection policy gets least_time (written `ewma`,
	// its earlier name), at provisioning.
	Routes caddyhttp.RouteList `json:"routes,omitempty"`
}

// BackupAuto sets the backup delay from a group's observed latencies
// (Handler's backup_request_auto). The latencies are the times to
// response headers of the group's attempts over the last 5 to 10
// seconds, kept in a fixed-size histogram (about 9% resolution); an
// attempt cancelled before it answered counts with the time it had
// waited, so hedged stalls keep the tail in view.
//
// The quantile is the share of calls that may wait for the delay before
// a backup is considered: at the default 95th percentile, about 5% of
// calls reach the timer (The Tail at Scale's suggestion), under the
// default backup_budget of 10%, and of those only the stuck ones are
// hedged. A lower quantile hedges more calls; a higher one waits longer.
type BackupAuto struct {
	// The quantile of the recent latencies the delay follows, in
	// percent: from 50 to 99.9. Default: 95.
	Quantile float64 `json:"quantile,omitempty"`
	// The shortest delay: the quantile is raised to it. From 1ms to 1h.
	// Default: 1ms.
	Min caddy.Duration `json:"min,omitempty"`
	// The longest delay: the quantile is lowered to it. It is also the
	// delay until the group has answered 100 attempts in the window, a
	// conservative start. From min to 1h. Default: 1s.
	Max caddy.Duration `json:"max,omitempty"`
}

// Defaults and bounds of backup_request_auto.
const (
	defaultAutoQuantile = 95.0
	minAutoQuantile     = 50.0
	maxAutoQuantile     = 99.9
	defaultAutoMin      = time.Millisecond
	defaultAutoMax      = time.Second
	// autoMinSamples: answers in the window before the quantile is used.
	autoMinSamples = 100
	// autoWindow: how long each of the histogram's two windows lasts.
	autoWindow = 5 * time.Second
	// autoRefresh: how long a group's computed delay is reused (ns).
	autoRefresh = int64(50 * time.Millisecond)
)

func (a *BackupAuto) quantile() float64 {
	if a.Quantile == 0 {
		return defaultAutoQuantile
	}
	return a.Quantile
}

func (a *BackupAuto) bounds() (lo, hi time.Duration) {
	lo, hi = defaultAutoMin, defaultAutoMax
	if a.Min != 0 {
		lo = time.Duration(a.Min)
	}
	if a.Max != 0 {
		hi = time.Duration(a.Max)
	}
	return lo, hi
}

// validate checks the auto delay's options.
func (a *BackupAuto) validate() error {
	if a.Quantile != 0 && (a.Quantile < minAutoQuantile || a.Quantile > maxAutoQuantile) {
		return fmt.Errorf("backup_request_auto quantile %g is outside %g to %g (percent)", a.Quantile, minAutoQuantile, maxAutoQuantile)
	}
	if a.Min != 0 {
		if err := bounds.Duration("backup_request_auto min", time.Duration(a.Min), minBackupRequest, maxBackupRequest); err != nil {
			return err
		}
	}
	if a.Max != 0 {
		if err := bounds.Duration("backup_request_auto max", time.Duration(a.Max), minBackupRequest, maxBackupRequest); err != nil {
			return err
		}
	}
	if lo, hi := a.bounds(); lo > hi {
		return fmt.Errorf("backup_request_auto min %v is above max %v", lo, hi)
	}
	return nil
}

// backupDelay returns the backup delay of a call whose first attempt
// went to group g: backup_request, or with backup_request_auto the
// group's quantile within the bounds (max until it has enough answers).
func (h *Handler) backupDelay(g *group, now int64) time.Duration {
	a := h.BackupRequestAuto
	if a == nil {
		return time.Duration(h.BackupRequest)
	}
	if at := g.autoAt.Load(); at != 0 && now-at < autoRefresh {
		return time.Duration(g.autoNs.Load())
	}
	lo, hi := a.bounds()
	d := hi
	if q, n := g.state.lat.Quantile(now, a.quantile()/100); n >= autoMinSamples {
		d = min(max(time.Duration(q), lo), hi)
	}
	g.autoNs.Store(int64(d))
	g.autoAt.Store(now)
	return d
}

// hedges reports whether the handler may send backup requests.
func (h *Handler) hedges() bool { return h.BackupRequest > 0 || h.BackupRequestAuto != nil }

// Policy is how Handler chooses a group.
type Policy struct {
	// The policy:
	//   - "latency" (default): the group with the lowest expected cost,
	//     its attempts in flight divided by its capacity times its latency
	//     estimate, with the same estimator and tie band as lb_policy least_time:
	//     among groups of similar latency, weighted least-requests by
	//     capacity.
	//   - "weighted": at random, in proportion to capacity.
	//   - "hash": a consistent (weighted rendezvous) hash of Key, so a key
	//     stays on its group; when its group is unusable it goes to the
	//     key's next group, so the keys of a group that is down spread over
	//     the others in proportion to their weights. An empty key is
	//     chosen by latency.
	//   - "failover": groups in the order given are priorities. A group
	//     takes all the traffic left to it while at least Threshold percent
	//     of its upstreams are usable; below that it takes its usable share
	//     divided by Threshold, and the rest spills to the next group
	//     (Envoy's priority levels with an overprovisioning factor of
	//     100/Threshold).
	Name string `json:"policy,omitempty"`

	// The hash key, with placeholders, e.g. "{http.request.header.X-User}".
	// Required with hash, refused otherwise.
	Key string `json:"key,omitempty"`

	// The failover threshold, in percent: above 0, at most 100. Only with
	// failover. Default: 70 (Envoy's overprovisioning factor 1.4).
	Threshold float64 `json:"threshold,omitempty"`
}

// UnmarshalJSON decodes the handler strictly, as Caddy decodes modules,
// naming the option whose value does not decode.
func (h *Handler) UnmarshalJSON(b []byte) error {
	type plain Handler
	return jsonfield.Decode(b, (*plain)(h))
}

// CaddyModule returns the Caddy module information.
func (*Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.selective",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Bounds of the options.
const (
	maxGroups        = 64
	maxGroupName     = 64
	maxRetryLimit    = 16
	maxWeight        = 1_000_000
	minBackupRequest = time.Millisecond
	maxBackupRequest = time.Hour
	minTimeout       = time.Millisecond
	maxTimeout       = 24 * time.Hour
	maxReplayLimit   = 1 << 30

	defaultMaxRetry      = 1
	defaultBackupBudget  = 10.0
	defaultMaxReplayBody = 1 << 20
	defaultThreshold     = 70.0
)

// Policy names.
const (
	policyLatency  = "latency"
	policyWeighted = "weighted"
	policyHash     = "hash"
	policyFailover = "failover"
)

var policyNames = []string{policyLatency, policyWeighted, policyHash, policyFailover}

// Provision checks the configuration, then sets up the groups: nothing is
// started before every option is known to be in bounds.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.Validate(); err != nil {
		return err
	}
	h.events = events.New(ctx)
	h.maxRetry = defaultMaxRetry
	if h.MaxRetry != nil {
		h.maxRetry = *h.MaxRetry
	}
	on := h.RetryOn
	if len(on) == 0 {
		on = defaultRetryOn
	}
	h.retryOn, _ = parseRetryOn(on)
	percent := defaultBackupBudget
	if h.BackupBudget != nil {
		percent = *h.BackupBudget
	}
	h.budget = newBudget(percent)
	if h.BackupMatchRaw != nil {
		for i, set := range h.BackupMatchRaw {
			if err := jsonfield.CheckExpressionMatcher(set); err != nil {
				return fmt.Errorf("selective: backup_match[%d]: %v", i, err)
			}
		}
		mods, err := ctx.LoadModule(h, "BackupMatchRaw")
		if err != nil {
			return fmt.Errorf("selective: backup_match: %v", err)
		}
		if err := h.backupMatch.FromInterface(mods); err != nil {
			return fmt.Errorf("selective: backup_match: %v", err)
		}
	}
	h.table = hoststate.NewTable(hoststate.Config{})
	for _, g := range h.Groups {
		pg, err := provisionGroup(ctx, g)
		if err != nil {
			h.release()
			return fmt.Errorf("selective: group %s: %v", g.Name, err)
		}
		h.groups = append(h.groups, pg)
	}
	if err := registerMetrics(ctx); err != nil {
		h.release()
		return fmt.Errorf("selective: registering metrics: %v", err)
	}
	register(h)
	return nil
}

// Validate checks every option against its bounds.
func (h *Handler) Validate() error {
	if err := h.validate(); err != nil {
		return fmt.Errorf("selective: %v", err)
	}
	return nil
}

func (h *Handler) validate() error {
	if len(h.Groups) == 0 {
		return errors.New("no groups; give at least one")
	}
	if len(h.Groups) > maxGroups {
		return fmt.Errorf("%d groups; at most %d", len(h.Groups), maxGroups)
	}
	seen := make(map[string]bool, len(h.Groups))
	for i, g := range h.Groups {
		if g == nil {
			return fmt.Errorf("groups[%d] is null", i)
		}
		if err := checkGroupName(g.Name); err != nil {
			return fmt.Errorf("groups[%d]: %v", i, err)
		}
		if seen[g.Name] {
			return fmt.Errorf("group %s given twice; names must be unique", g.Name)
		}
		seen[g.Name] = true
		if g.Weight != 0 {
			if err := checkWeight(g.Weight); err != nil {
				return fmt.Errorf("group %s: %v", g.Name, err)
			}
		}
		// (Validate runs again after Provision, which loaded the raw
		// handlers and dropped them.)
		if !slices.ContainsFunc(g.Routes, func(r caddyhttp.Route) bool { return len(r.HandlersRaw) > 0 || len(r.Handlers) > 0 }) {
			return fmt.Errorf("group %s has no handler in its routes; give it one such as reverse_proxy", g.Name)
		}
	}
	if err := h.Policy.validate(); err != nil {
		return err
	}
	if h.MaxRetry != nil {
		if err := checkMaxRetry(*h.MaxRetry); err != nil {
			return err
		}
	}
	if len(h.RetryOn) > 0 {
		if _, err := parseRetryOn(h.RetryOn); err != nil {
			return err
		}
	}
	if h.BackupRequest != 0 {
		if err := checkBackupRequest(time.Duration(h.BackupRequest)); err != nil {
			return err
		}
	}
	if h.BackupRequestAuto != nil {
		if h.BackupRequest != 0 {
			return errors.New("backup_request and backup_request_auto both given; give one")
		}
		if err := h.BackupRequestAuto.validate(); err != nil {
			return err
		}
	}
	if h.BackupBudget != nil {
		if err := checkBackupBudget(*h.BackupBudget); err != nil {
			return err
		}
	}
	if h.Timeout != 0 {
		if err := checkTimeout(time.Duration(h.Timeout)); err != nil {
			return err
		}
	}
	if h.MaxReplayBody != 0 {
		if err := checkMaxReplayBody(h.MaxReplayBody); err != nil {
			return err
		}
	}
	if h.StatusHeader != "" && !validHeaderName(h.StatusHeader) {
		return fmt.Errorf("status_header %q is not a valid header name", h.StatusHeader)
	}
	return nil
}

// The rules for each option, shared with the Caddyfile parser.

func checkMaxRetry(n int) error { return bounds.Int("max_retry", n, 0, maxRetryLimit) }
func checkWeight(w int) error   { return bounds.Int("weight", w, 1, maxWeight) }
func checkBackupRequest(d time.Duration) error {
	return bounds.Duration("backup_request", d, minBackupRequest, maxBackupRequest)
}
func checkBackupBudget(p float64) error { return bounds.Positive("backup_budget", p, 100) }
func checkTimeout(d time.Duration) error {
	return bounds.Duration("timeout", d, minTimeout, maxTimeout)
}
func checkMaxReplayBody(n int64) error {
	if n < 1 || n > maxReplayLimit {
		return fmt.Errorf("max_replay_body %d is outside 1 B to 1 GiB", n)
	}
	return nil
}
func checkThreshold(p float64) error { return bounds.Positive("threshold", p, 100) }

// checkGroupName is the rule for a group's name.
func checkGroupName(name string) error {
	return bounds.Name("group", name, maxGroupName)
}

// validHeaderName reports whether s is a token (RFC 9110).
func validHeaderName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == '!' || c == '#' || c == '$' || c == '%' || c == '&' || c == '\'' || c == '*' || c == '+' || c == '^' || c == '`' || c == '|' || c == '~') {
			return false
		}
	}
	return s != ""
}

func (p *Policy) name() string {
	if p == nil || p.Name == "" {
		return policyLatency
	}
	return p.Name
}

func (p *Policy) threshold() float64 {
	if p == nil || p.Threshold == 0 {
		return defaultThreshold
	}
	return p.Threshold
}

func (p *Policy) validate() error {
	if p == nil {
		return nil
	}
	switch p.Name {
	case "", policyLatency, policyWeighted, policyHash, policyFailover:
	default:
		return fmt.Errorf("policy %q is not one of %v", p.Name, policyNames)
	}
	switch {
	case p.Name == policyHash && p.Key == "":
		return errors.New("policy hash needs a key, e.g. {http.request.header.X-User}")
	case p.Name != policyHash && p.Key != "":
		return fmt.Errorf("policy %s takes no key (only hash does)", p.name())
	case p.Name != policyFailover && p.Threshold != 0:
		return fmt.Errorf("policy %s takes no threshold (only failover does)", p.name())
	case p.Threshold != 0:
		return checkThreshold(p.Threshold)
	}
	return nil
}

// SendsBackupRequests reports whether the handler hedges: the selection
// policies of its groups then record what each attempt used, for a backup
// to leave it out (see lbpolicy.Avoid).
func (h *Handler) SendsBackupRequests() bool { return h.hedges() }

// Cleanup releases the groups' state and unregisters the handler.
func (h *Handler) Cleanup() error {
	unregister(h)
	h.release()
	return nil
}

func (h *Handler) release() {
	for _, g := range h.groups {
		g.release()
	}
	h.groups = nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ capacityReporter            = (*Handler)(nil)
)
