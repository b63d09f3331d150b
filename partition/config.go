package partition

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/lbpolicy"
)

func init() {
	caddy.RegisterModule(new(Handler))
}

// Defaults.
const (
	defaultTimeout         = 30 * time.Second
	defaultPollInterval    = time.Second
	defaultMaxRequestBody  = 1 << 20
	defaultMaxResponseBody = 8 << 20
	// Eight partitions' worth of default-sized sub-responses.
	defaultMaxMergedBody = 8 * defaultMaxResponseBody
	defaultRetries       = 1
)

// Bounds of the options (see Handler.validate).
const (
	// Polling more often burns a core on stat calls and member list
	// copies without making updates noticeably faster.
	minPollInterval = 100 * time.Millisecond
	maxPollInterval = time.Hour
	minTimeout      = time.Millisecond
	maxTimeout      = 24 * time.Hour
	// Bodies are held in memory whole; beyond this, a fan-out is the
	// wrong tool.
	maxBodyLimit = 1 << 30
	maxRetries   = 100
)

// Handler fans a request out to one replica of each partition of a
// partition scheme and writes one merged response (brpc's
// PartitionChannel). Upstreams are tagged "N/M": partition N of a scheme
// of M partitions. When upstreams of several schemes coexist (say 3 and 4
// partitions, during a migration), each request picks one scheme with
// probability proportional to its capacity: the least number of usable
// replicas over its partitions (brpc's DynamicPartitionChannel). A replica
// is usable when Caddy would send it a request (passive health checks,
// max_requests) and lbx's outlier detection has not ejected its address.
// A scheme with a partition that has no usable replica gets no traffic;
// when no scheme has capacity, the answer is 503.
//
// Sub-requests go through an internal reverse_proxy handler configured by
// Proxy: replicas of a partition are chosen with its load balancing policy
// (least_time by default), a failed attempt is retried on another replica
// of the same partition (Retries, default 1), and its transport, header
// operations and passive health checks apply. Each sub-request has its
// own replacer and request variables.
//
// Before any sub-request, the request body is read (413 beyond
// MaxRequestBody) and the Reject rules are checked (400).
//
// A partition fails when its sub-request fails (transport error, timeout,
// non-2xx status), its response is larger than MaxResponseBody, or the
// merger rejects it (e.g. invalid JSON). When FailLimit partitions have
// failed, the handler answers 502 at once (504 when the deadline passed)
// with a text body naming the failed partitions, and cancels the
// sub-requests still running. When the sub-responses together go over
// MaxMergedBody, the answer is 502 at once, whatever FailLimit says.
type Handler struct {
	// Upstreams with their partition tags.
	Upstreams []UpstreamConfig `json:"upstreams,omitempty"`

	// A file of upstreams in brpc's naming service format: one
	// "address N/M" per line; '#' starts a comment; blank lines are
	// ignored. Lines that cannot be parsed, or are longer than 64 KiB,
	// are logged (with the file name and line number) and skipped. The
	// file is polled for changes every PollInterval; a change is read once
	// the file's modification time and size have stayed the same for one
	// poll, and a new version replaces the old atomically. The last good
	// version stays in effect, and the refusal is logged and counted in
	// caddy_lbx_partition_naming_rejected_total, when the file is deleted
	// or unreadable, larger than 64 MiB, does not end with a newline (it
	// may be truncated or half-written), has no valid upstream line, or
	// would remove more than NamingMaxRemovedPercent of the upstreams. An
	// empty list is applied only when a line "# lbx:empty" says so.
	// Replace the file atomically: write a complete file elsewhere on the
	// same file system, then rename it over this one. Its upstreams are
	// added to Upstreams. The file must be usable when the config is
	// loaded.
	NamingFile string `json:"naming_file,omitempty"`

	// The largest share, in percent, of the naming file's upstreams (its
	// entries in the version last applied) that one new version may
	// remove; a version that would remove more is not applied. Make
	// larger changes in steps, or set 100 to allow any. Default: 50.
	NamingMaxRemovedPercent float64 `json:"naming_max_removed_percent,omitempty"`

	// How often the naming file is checked for changes (modification time
	// and size), and the serf member list read. From 100ms to 1h.
	// Default: 1s.
	PollInterval caddy.Duration `json:"poll_interval,omitempty"`

	// Upstreams from the member tags of this node's cluster
	// (which needs the cluster app in the config): each alive member's
	// tag "partition" (by default) holds its partition tags, e.g. "0/3" or
	// "0/3,1/4". They are added to Upstreams and the naming file's, and
	// follow the members: a new list replaces the old atomically.
	Serf *SerfNaming `json:"serf,omitempty"`

	// The options every fan-out handler has: fail_limit, timeout, the
	// body and merge bounds, merge and skip (see FanOut). Skip matchers
	// see {partition.index}, {partition.count}, {partition.scheme} and
	// {partition.tag}; fail_limit is at most MaxPartitions (1024).
	FanOut

	// Rules that reject a request with 400 before any sub-request is
	// sent. They are checked in order against the client request, after
	// its body has been read (a body over MaxRequestBody is answered 413
	// first), with the client request's placeholders; the first rule
	// whose matchers all match rejects the request, and the answer's body
	// is "request rejected: " followed by the rule's message.
	Reject []*RejectRule `json:"reject,omitempty"`

	// How many times a failed sub-request is retried on another replica
	// of its partition (reverse_proxy's load_balancing.retries, which may
	// be given there instead, but not in both places). 0 disables
	// retries, unless the proxy's load_balancing.try_duration is set,
	// which then alone bounds them, as in reverse_proxy. At most 100.
	// Default: 1.
	Retries *int `json:"retries,omitempty"`

	// The reverse_proxy handler the sub-requests go through, without
	// upstreams (they come from Upstreams and NamingFile): load
	// balancing, retries, transport, header operations (header_up may use
	// the partition placeholders), rewrite, passive health checks. Its
	// selection policy defaults to least_time (whose outlier ejection
	// also takes a replica out of its scheme's capacity); its retries are
	// governed by Retries. Active health checks, handle_response and
	// response buffering (sub-responses are held whole already) are not
	// supported.
	Proxy *reverseproxy.Handler `json:"proxy,omitempty"`

	proxy *reverseproxy.Handler
	// skipEjected: the selection policy does not know lbx's outlier
	// ejection, so the upstream source leaves ejected replicas out.
	skipEjected bool
	// hosts holds references on lbx's per-address state (outlier
	// ejection) of every replica address this handler has used.
	hosts   *hoststate.Table
	static  []Entry
	current atomic.Pointer[layout]
	swapMu  sync.Mutex // serializes layout swaps
	watcher *namingWatcher
	// The naming file's and the serf members' entries (under swapMu).
	fileEntries []Entry
	serfEntries []Entry
}

// ejectionAware is a selection policy that leaves upstreams ejected by
// lbx's outlier detection out by itself, as least_time and panic do: they
// must be handed every replica, or their panic mode would not count the
// ejected ones as unavailable. Any other policy is handed the replicas
// that are not ejected.
type ejectionAware interface {
	SkipsEjected() bool
}

// RejectRule rejects a request that matches it (see Handler.Reject).
type RejectRule struct {
	// The matchers, all of which must match the client request for it to
	// be rejected; in the Caddyfile, one CEL expression.
	MatchRaw caddy.ModuleMap `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// The reason given in the 400 answer's body; it may contain
	// placeholders of the client request. Default: the rule's CEL
	// expression, as written, when it is one, else "reject rule <index>".
	Message string `json:"message,omitempty"`

	match caddyhttp.MatcherSet
	// literal: Message is the default, shown as is (an expression's
	// placeholders are not to be replaced).
	literal bool
}

// UpstreamConfig is a static upstream and its partition tag.
type UpstreamConfig struct {
	// The network address to dial, as for reverse_proxy (host:port).
	Dial string `json:"dial,omitempty"`
	// The partition tag "N/M": partition N (from 0) of M.
	Tag string `json:"tag,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (*Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.partition",
		New: func() caddy.Module { return new(Handler) },
	}
}

// UnmarshalJSON decodes the handler strictly, as Caddy decodes modules,
// naming the option whose value does not decode.
func (h *Handler) UnmarshalJSON(b []byte) error {
	type plain Handler
	return jsonfield.Decode(b, (*plain)(h))
}

// Provision sets up the handler: defaults, the merger and skip matchers,
// the internal reverse_proxy, the upstream list and the naming file
// watcher (a goroutine that stops with the config).
func (h *Handler) Provision(ctx caddy.Context) error {
	h.fanOutDefaults(ctx, partitionKind)
	if h.PollInterval == 0 {
		h.PollInterval = caddy.Duration(defaultPollInterval)
	}
	// Caddy validates after provisioning, and what follows starts
	// goroutines (the internal reverse_proxy's policy, the watchers).
	if err := h.validate(); err != nil {
		return err
	}

	if err := h.provisionStatic(); err != nil {
		return err
	}
	if len(h.static) == 0 && h.NamingFile == "" && h.Serf == nil {
		return errors.New("no upstreams: give tagged upstreams (to <address> <N/M>), a naming_file or serf_tag")
	}
	if err := h.provisionFanOut(ctx); err != nil {
		return err
	}
	if err := h.provisionMatchers(ctx); err != nil {
		return err
	}
	if err := h.provisionProxy(ctx); err != nil {
		return err
	}
	aware, ok := h.proxy.LoadBalancing.SelectionPolicy.(ejectionAware)
	h.skipEjected = !ok || !aware.SkipsEjected()
	h.hosts = hoststate.NewTable(hoststate.Config{})

	if err := h.startSources(ctx); err != nil {
		return err
	}
	live.Add(h)
	h.join()
	return nil
}

// provisionStatic checks the upstreams given in the config and keeps
// them, once each.
func (h *Handler) provisionStatic() error {
	seen := make(map[Entry]bool)
	for i, u := range h.Upstreams {
		if _, err := checkDial(u.Dial); err != nil {
			return fmt.Errorf("upstreams[%d]: %v", i, err)
		}
		tag, err := ParseTag(u.Tag)
		if err != nil {
			return fmt.Errorf("upstreams[%d] (%s): %v", i, u.Dial, err)
		}
		e := Entry{Dial: u.Dial, Tag: tag}
		if !seen[e] {
			seen[e] = true
			h.static = append(h.static, e)
		}
	}
	return nil
}

// provisionMatchers loads the reject rules.
func (h *Handler) provisionMatchers(ctx caddy.Context) error {
	for i, rule := range h.Reject {
		if err := rule.provision(ctx, i); err != nil {
			return err
		}
	}
	return nil
}

// startSources installs the initial upstream list, which a naming file
// must be usable for now, and starts following the naming file and the
// serf members.
func (h *Handler) startSources(ctx caddy.Context) error {
	if err := h.install(nil); err != nil {
		return err
	}
	if h.NamingFile != "" {
		if err := registerNamingMetrics(ctx); err != nil {
			return err
		}
		h.watcher = &namingWatcher{
			path:       h.NamingFile,
			every:      time.Duration(h.PollInterval),
			logger:     h.logger,
			maxRemoved: h.maxRemovedPercent(),
			apply:      h.install,
		}
		if err := h.watcher.load(); err != nil {
			return err
		}
		go h.watcher.run(ctx.Done())
	}
	if h.Serf != nil {
		// The cluster app's member starts after every module is
		// provisioned: the list fills in once it runs.
		sw, err := newSerfWatcher(ctx, h.Serf, time.Duration(h.PollInterval), h.logger, h.installSerf)
		if err != nil {
			return err
		}
		go sw.run(ctx.Done())
	}
	return nil
}

// Validate checks the configuration.
func (h *Handler) Validate() error {
	return h.validate()
}

// Cleanup releases the handler's references on lbx's per-address state
// and takes it out of the admin view.
// The internal reverse_proxy is cleaned up by Caddy with the config, and
// the naming file watcher stops when the config's context is cancelled.
func (h *Handler) Cleanup() error {
	live.Remove(h)
	h.leave()
	if h.hosts != nil {
		h.hosts.Release()
	}
	return nil
}

// provision loads the rule's matchers; i is its index in Handler.Reject.
func (rule *RejectRule) provision(ctx caddy.Context, i int) error {
	if rule == nil || len(rule.MatchRaw) == 0 {
		return fmt.Errorf("reject[%d]: no matchers", i)
	}
	if err := jsonfield.CheckExpressionMatcher(rule.MatchRaw); err != nil {
		return fmt.Errorf("reject[%d]: match: %v", i, err)
	}
	mods, err := ctx.LoadModule(rule, "MatchRaw")
	if err != nil {
		return fmt.Errorf("reject[%d]: loading matchers: %v", i, err)
	}
	var sets caddyhttp.MatcherSets
	if err := sets.FromInterface([]map[string]any{mods.(map[string]any)}); err != nil {
		return fmt.Errorf("reject[%d]: %v", i, err)
	}
	rule.match = sets[0]
	if rule.Message == "" {
		rule.literal = true
		rule.Message = "reject rule " + strconv.Itoa(i)
		if len(rule.match) == 1 {
			if m, ok := rule.match[0].(*caddyhttp.MatchExpression); ok {
				rule.Message = m.Expr
			}
		}
	}
	return nil
}

// validate checks the options' bounds, after the defaults are applied.
// The Caddyfile applies the same checks (checkDuration, checkCount,
// checkSize) where the values are written.
func (h *Handler) validate() error {
	checks := append(h.checks(MaxPartitions),
		h.checkNaming(),
		bounds.Duration("poll_interval", time.Duration(h.PollInterval), minPollInterval, maxPollInterval),
	)
	if h.Retries != nil {
		checks = append(checks, bounds.Int("retries", *h.Retries, 0, maxRetries))
	}
	if h.Proxy != nil {
		if lb := h.Proxy.LoadBalancing; lb != nil {
			checks = append(checks, bounds.Int("proxy.load_balancing.retries", lb.Retries, 0, maxRetries))
		}
		if h.Proxy.ResponseBuffers != 0 {
			checks = append(checks, fmt.Errorf("proxy.response_buffers %d: response buffering is not supported inside partition, which holds each sub-response whole already (bounded by max_response_body)", h.Proxy.ResponseBuffers))
		}
	}
	if h.Serf != nil {
		checks = append(checks, h.Serf.validate())
	}
	return errors.Join(checks...)
}

// checkMergedBody checks that one sub-response of the largest size
// accepted fits in the merge's budget.
func checkMergedBody(response, merged int64) error {
	if response > merged {
		return fmt.Errorf("max_response_body %d is above max_merged_body %d (default %d): no sub-response that large could be merged; raise max_merged_body or lower max_response_body", response, merged, int64(defaultMaxMergedBody))
	}
	return nil
}

// checkSize checks that option name's byte size n is in [1, maxBodyLimit].
func checkSize(name string, n int64) error {
	switch {
	case n < 1:
		return fmt.Errorf("%s %d is below the minimum of 1 byte", name, n)
	case n > maxBodyLimit:
		return fmt.Errorf("%s %d is above the maximum %d (1 GiB): bodies are held in memory whole", name, n, int64(maxBodyLimit))
	}
	return nil
}

// provisionProxy loads the internal reverse_proxy handler through Caddy,
// so that its selection policy finds it among the modules being
// provisioned (least_time instruments its transport that way) and Caddy
// cleans it up with the config. Its upstreams come from the partition
// sub-request being served (see source).
func (h *Handler) provisionProxy(ctx caddy.Context) error {
	tmpl := new(reverseproxy.Handler)
	if h.Proxy != nil {
		switch {
		case len(h.Proxy.Upstreams) > 0:
			return errors.New("proxy: upstreams are not allowed here; tag them (to <address> <N/M>) or use naming_file")
		case h.Proxy.DynamicUpstreamsRaw != nil:
			return errors.New("proxy: dynamic upstreams are not supported; use naming_file")
		case len(h.Proxy.HandleResponse) > 0:
			return errors.New("proxy: handle_response is not supported inside partition")
		case h.Proxy.HealthChecks != nil && h.Proxy.HealthChecks.Active != nil:
			return errors.New("proxy: active health checks are not supported inside partition (use passive health checks or lb_policy least_time's outlier ejection)")
		}
		raw, err := json.Marshal(h.Proxy)
		if err != nil {
			return fmt.Errorf("proxy: %v", err)
		}
		if err := json.Unmarshal(raw, tmpl); err != nil {
			return fmt.Errorf("proxy: %v", err)
		}
	}
	if tmpl.LoadBalancing == nil {
		tmpl.LoadBalancing = new(reverseproxy.LoadBalancing)
	}
	if tmpl.LoadBalancing.SelectionPolicyRaw == nil {
		tmpl.LoadBalancing.SelectionPolicyRaw = lbpolicy.DefaultComboPolicy()
	}
	retries, err := resolveRetries(h.Retries, tmpl.LoadBalancing)
	if err != nil {
		return err
	}
	tmpl.LoadBalancing.Retries = retries
	// The body is replayed from memory; buffering it in reverse_proxy too
	// makes a retry after a partial send resend the whole body. One byte
	// over the limit, as a body of exactly the limit would otherwise look
	// partially buffered.
	if h.MaxRequestBody > 0 {
		tmpl.RequestBuffers = h.MaxRequestBody + 1
	}
	raw, err := json.Marshal(tmpl)
	if err != nil {
		return fmt.Errorf("proxy: %v", err)
	}
	mod, err := ctx.LoadModuleByID("http.handlers.reverse_proxy", raw)
	if err != nil {
		return fmt.Errorf("proxy: %v", err)
	}
	h.proxy = mod.(*reverseproxy.Handler)
	h.proxy.DynamicUpstreams = source{}
	return nil
}

// resolveRetries returns the internal reverse_proxy's retry count: the
// handler's Retries when set (0 included), else the proxy's own
// load_balancing.retries when set, else the default — unless the proxy
// retries for a try_duration, whose meaning with 0 retries (no count
// limit) is kept.
func resolveRetries(retries *int, lb *reverseproxy.LoadBalancing) (int, error) {
	switch {
	case retries != nil && lb.Retries != 0:
		return 0, fmt.Errorf("retries given twice: %d, and %d in proxy.load_balancing.retries; give one", *retries, lb.Retries)
	case retries != nil:
		return *retries, nil
	case lb.Retries != 0 || lb.TryDuration != 0:
		return lb.Retries, nil
	}
	return defaultRetries, nil
}

// install makes fileEntries (with the static upstreams and the serf
// members') the current upstream list, or leaves the current one if they
// are not valid.
func (h *Handler) install(fileEntries []Entry) error {
	return h.installPart(&h.fileEntries, fileEntries)
}

// installSerf is install for the serf members' entries.
func (h *Handler) installSerf(serfEntries []Entry) error {
	return h.installPart(&h.serfEntries, serfEntries)
}

// installPart replaces one source's entries (*part) and swaps in the
// layout of all sources, or restores *part if the result is not valid.
func (h *Handler) installPart(part *[]Entry, entries []Entry) error {
	h.swapMu.Lock()
	defer h.swapMu.Unlock()
	prev := *part
	*part = entries
	old := h.current.Load()
	l, err := buildLayout(mergeEntries(mergeEntries(h.static, h.fileEntries), h.serfEntries), old, h.hosts)
	if err != nil {
		*part = prev
		return err
	}
	h.current.Store(l)
	dropGone(old, l, h.hosts)
	if old != nil && old.slots-l.slots >= bigShrink {
		returnMemorySoon()
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner  = (*Handler)(nil)
	_ caddy.Validator    = (*Handler)(nil)
	_ caddy.CleanerUpper = (*Handler)(nil)
)
