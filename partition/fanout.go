package partition

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/bodysplit"
	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/liveset"
)

// FanOut is the fan-out engine that partition and parallel share: the
// options they have in common, and what runs a fan-out with them (read
// the body, make one sub-request per part, stop at fail_limit, the
// deadline or the client's departure, merge, report). A part is a
// partition of partition's chosen scheme, or a branch of parallel. Both
// handlers embed it, so its options are theirs in JSON.
type FanOut struct {
	// How many failed parts (partitions, branches) fail the whole
	// request. Default (or 0): the number of parts, i.e. the request
	// fails only when every part has; parts that did answer are merged
	// otherwise. Skipped parts never count.
	FailLimit int `json:"fail_limit,omitempty"`

	// Overall deadline of the call, from the moment the handler starts:
	// reading the request body and all sub-requests, retries included. A
	// request body not received by then is answered 408 Request Timeout
	// (no part has seen the request). Parts that have not answered by
	// then count as failed ("timeout") and are cancelled. Inside a
	// selective group or a parallel branch, the enclosing handler's
	// deadline replaces it, and it is carried to the selective,
	// partition and parallel handlers nested in the parts (brpc's rule:
	// the outer channel's timeout overrides its sub-channels'). From 1ms
	// to 24h. Default: 30s.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// The largest request body accepted, in bytes; it is read once and
	// replayed to every part. A larger body is answered with 413.
	// At most 1 GiB. Default: 1 MiB.
	MaxRequestBody int64 `json:"max_request_body,omitempty"`

	// The largest sub-response body read from a part, in bytes; a
	// larger one counts as a failed part. At most 1 GiB.
	// Default: 8 MiB.
	MaxResponseBody int64 `json:"max_response_body,omitempty"`

	// The most bytes one request may hold for its merge, in bytes: the
	// sub-response bodies received for it together, and the merged body.
	// Going over fails the request at once with 502 (and a warning in the
	// log), whatever fail_limit says, and cancels the sub-requests still
	// running. A request's memory is thus bounded by about twice this,
	// plus a copy of the request body per part (which reverse_proxy
	// buffers for retries), whatever the part count.
	// At least max_response_body, at most 1 GiB. Default: 64 MiB, eight
	// parts' worth of default-sized sub-responses.
	MaxMergedBody int64 `json:"max_merged_body,omitempty"`

	// The most bytes all fan-outs of the process (partition and parallel
	// alike) may hold for merging together, a bound shared by every such
	// handler: each fan-out reserves its worst case before its first
	// sub-request — twice the least of max_merged_body and its part
	// count times max_response_body (the sub-responses, then the merged
	// body), plus a copy of the request body per part — and releases it
	// when it has answered. A fan-out that does not fit waits, in order
	// of arrival, until its deadline, and is then answered 503 naming
	// this option; the fan-outs in flight never fail for it. The largest
	// value among the running handlers applies, a handler without it
	// counting as the default. At least 2 × max_merged_body, from 1 MiB
	// to 1 TiB. Default: 1 GiB (16 fan-outs of 4 parts at once with the
	// default sizes).
	MaxMergeMemory int64 `json:"max_merge_memory,omitempty"`

	// How sub-responses are merged: a module in the namespace
	// http.partition.mergers (json, concat, ndjson, first).
	// Default: json.
	MergeRaw json.RawMessage `json:"merge,omitempty" caddy:"namespace=http.partition.mergers inline_key=merger"`

	// Matcher sets evaluated once per part against that part's
	// sub-request, with the part's placeholders (see each handler); a
	// part is skipped when any set matches. When every part is skipped,
	// the answer is 400.
	SkipRaw caddyhttp.RawMatcherSets `json:"skip,omitempty" caddy:"namespace=http.matchers"`

	// Splits the JSON request body among the parts: each part is sent
	// the body with the array named by field holding only its own
	// elements, by FNV-1a-64 of each element's key modulo the number of
	// parts (by "hash", the default) or element i to part i (by
	// "index"); every other byte is sent as written, and a part with no
	// element is skipped. The parts are the partitions of the scheme
	// chosen, or parallel's branches. A body that cannot be split (not a
	// JSON object, no such array, an element without a usable key, more
	// than max_elements, or by "index" with another length than the
	// number of parts) is answered 400 before any sub-request. Default:
	// none, every part gets the whole body.
	SplitBody *bodysplit.Config `json:"split_body,omitempty"`

	kind   *fanKind
	merger Merger
	enough Sufficer // merger as a Sufficer, or nil
	skip   caddyhttp.MatcherSets
	logger *zap.Logger
	// splitter splits request bodies (split_body), or is nil.
	splitter *bodysplit.Splitter
}

// fanKind is how a fan-out handler names itself and its parts in answers,
// its status header, placeholders and logs.
type fanKind struct {
	name   string // the handler: "partition", "parallel"
	noun   string // one part: "partition", "branch"
	nouns  string // parts: "partitions", "branches"
	header string // the status header
	// missing is the header that lists the parts missing from a merged
	// answer.
	missing string
	ns      string // the placeholders' namespace, e.g. "http.partition"
}

var (
	partitionKind = &fanKind{name: "partition", noun: "partition", nouns: "partitions", header: StatusHeader, missing: MissingHeader, ns: "http.partition"}
	parallelKind  = &fanKind{name: "parallel", noun: "branch", nouns: "branches", header: ParallelStatusHeader, missing: ParallelMissingHeader, ns: "http.parallel"}
)

// round is one fan-out: how many parts it has, what they are called, and
// how each one's sub-request is made.
type round struct {
	count int
	// names are the parts' names in the status header and placeholders;
	// nil: partitions, "p<index>" in the header and the index in
	// placeholders.
	names []string
	// bodies are the parts' own request bodies (partition's split_body),
	// a nil entry for a part left without one; nil: the request body, to
	// every part.
	bodies  [][]byte
	newCall func(ctx context.Context, p subParent, i int) *subCall
}

// label is part i's name in the status header and error answers.
func (rd round) label(i int) string {
	if rd.names == nil {
		return "p" + strconv.Itoa(i)
	}
	return rd.names[i]
}

// key is part i's name in the placeholders {<ns>.<key>.status}, ….
func (rd round) key(i int) string {
	if rd.names == nil {
		return strconv.Itoa(i)
	}
	return rd.names[i]
}

// fanOuts holds the provisioned fan-outs of both handlers, for the
// process-wide merge memory bound (see updateMergeMemory).
var fanOuts liveset.Set[*FanOut]

// fanOutDefaults writes the defaults into the options, before they are
// checked.
func (h *FanOut) fanOutDefaults(ctx caddy.Context, kind *fanKind) {
	h.kind = kind
	h.logger = ctx.Logger()
	if h.Timeout == 0 {
		h.Timeout = caddy.Duration(defaultTimeout)
	}
	if h.MaxRequestBody == 0 {
		h.MaxRequestBody = defaultMaxRequestBody
	}
	if h.MaxResponseBody == 0 {
		h.MaxResponseBody = defaultMaxResponseBody
	}
	if h.MaxMergedBody == 0 {
		h.MaxMergedBody = defaultMaxMergedBody
	}
}

// provisionFanOut loads the merger and the skip matchers, once the
// options are checked.
func (h *FanOut) provisionFanOut(ctx caddy.Context) error {
	if h.MergeRaw != nil {
		mod, err := ctx.LoadModule(h, "MergeRaw")
		if err != nil {
			return fmt.Errorf("loading merger: %v", err)
		}
		h.merger = mod.(Merger)
	} else {
		h.merger = JSONMerger{}
	}
	h.enough, _ = h.merger.(Sufficer)

	if h.SkipRaw != nil {
		sets, err := ctx.LoadModule(h, "SkipRaw")
		if err != nil {
			return fmt.Errorf("loading skip matchers: %v", err)
		}
		if err := h.skip.FromInterface(sets); err != nil {
			return fmt.Errorf("skip matchers: %v", err)
		}
	}
	return h.provisionSplit()
}

// checks checks the options' bounds, after the defaults are applied;
// maxFail is the largest fail_limit the handler takes. The Caddyfile
// applies the same checks where the values are written.
func (h *FanOut) checks(maxFail int) []error {
	return []error{
		bounds.Duration("timeout", time.Duration(h.Timeout), minTimeout, maxTimeout),
		bounds.Int("fail_limit", h.FailLimit, 0, maxFail),
		checkSize("max_request_body", h.MaxRequestBody),
		checkSize("max_response_body", h.MaxResponseBody),
		checkSize("max_merged_body", h.MaxMergedBody),
		checkMergedBody(h.MaxResponseBody, h.MaxMergedBody),
		h.checkMergeMemory(),
		h.checkSplitBody(),
		checkSkip(h.SkipRaw),
	}
}

// checkSkip checks the skip matcher sets' expressions before Caddy
// decodes them (see jsonfield.CheckExpressionMatcher).
func checkSkip(sets caddyhttp.RawMatcherSets) error {
	for i, set := range sets {
		if err := jsonfield.CheckExpressionMatcher(set); err != nil {
			return fmt.Errorf("skip[%d]: %v", i, err)
		}
	}
	return nil
}

// join makes the fan-out count toward the process-wide merge memory
// bound; leave undoes it (Cleanup).
func (h *FanOut) join() {
	fanOuts.Add(h)
	updateMergeMemory()
}

func (h *FanOut) leave() {
	fanOuts.Remove(h)
	updateMergeMemory()
}
