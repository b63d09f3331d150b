package partition

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("partition", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("partition", httpcaddyfile.Before, "reverse_proxy")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	p := new(Handler)
	if err := p.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return p, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	partition [<matcher>] {
//		to <address> <N/M> [<address> <N/M>...]
//		naming_file <path>
//		naming_max_removed_percent <percent>
//		serf_tag [<member tag>] {
//			port     <port>
//			port_tag <member tag>
//			tag      <key> <value>
//		}
//		poll_interval <duration>
//		fail_limit <n>
//		timeout <duration>
//		max_request_body <size>
//		max_response_body <size>
//		max_merged_body <size>
//		max_merge_memory <size>
//		merge json|concat|ndjson|first
//		merge json {
//			missing_field <name>
//		}
//		split_body <field> [hash|index] {
//			key          <member>
//			max_elements <n>
//		}
//		skip <cel expression>
//		reject <cel expression> [<message>]
//		lb_retries <n>
//
//		# any other reverse_proxy subdirective except upstreams, dynamic,
//		# active health checks, handle_response and response_buffers, e.g.:
//		lb_policy least_time
//		header_up X-Partition {partition.index}/{partition.count}
//		transport http { ... }
//	}
//
// `to`, `skip` and `reject` may be repeated. Every other partition option
// may appear once. Durations, counts and sizes are checked against the
// bounds given in the JSON field docs as they are read. CEL expressions are compiled when the Caddyfile is
// adapted, so a bad one is reported with its line. lb_retries sets the
// handler's retries (0: none; absent: the default, 1). The other
// reverse_proxy subdirectives configure the internal reverse_proxy the
// sub-requests go through.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume the directive name
	p := &blockParse{h: h, f: &h.FanOut, what: directive, maxFail: MaxPartitions, seg: d.NextSegment()}
	sd := caddyfile.NewDispenser(p.seg)
	sd.Next()
	if err := caddyopt.BlockOnly(sd, directive); err != nil {
		return err
	}
	once := caddyopt.NewOnce(directive)
	for sd.NextBlock(0) {
		if err := p.option(sd.NextSegment(), once); err != nil {
			return err
		}
	}
	if err := p.check(d); err != nil {
		return err
	}
	return p.proxy()
}

// directive is the Caddyfile directive, the start of its errors.
const directive = "partition"

// blockParse is the reading of one partition block, or of the fan-out
// options of a parallel block (h nil).
type blockParse struct {
	h *Handler
	// f is the fan-out's options; what starts the errors; maxFail
	// bounds fail_limit.
	f       *FanOut
	what    string
	maxFail int
	seg     caddyfile.Segment // the whole directive
	// passthrough holds the tokens of reverse_proxy's options.
	passthrough []caddyfile.Token
	// sizeAt is the last size option, for errors about two of them.
	sizeAt *caddyfile.Dispenser
}

// optionParser reads option name, at d's first token, into p.
type optionParser func(p *blockParse, d *caddyfile.Dispenser, name string) error

// options are partition's own options, each with its parser; any other
// is reverse_proxy's (see passOn).
var options = map[string]optionParser{
	"to":                         (*blockParse).to,
	"naming_file":                (*blockParse).namingFile,
	"naming_max_removed_percent": (*blockParse).maxRemovedPercent,
	"serf_tag":                   (*blockParse).serfTag,
	"poll_interval":              (*blockParse).duration,
	"timeout":                    (*blockParse).duration,
	"fail_limit":                 (*blockParse).failLimit,
	"max_request_body":           (*blockParse).size,
	"max_response_body":          (*blockParse).size,
	"max_merged_body":            (*blockParse).size,
	"max_merge_memory":           (*blockParse).size,
	"merge":                      (*blockParse).merge,
	"split_body":                 (*blockParse).splitBody,
	"skip":                       (*blockParse).skip,
	"reject":                     (*blockParse).reject,
	"lb_retries":                 (*blockParse).lbRetries,
}

// repeatable are the options that may be given more than once;
// reverse_proxy checks its own.
var repeatable = map[string]bool{"to": true, "skip": true, "reject": true}

// option reads the option segment sub.
func (p *blockParse) option(sub caddyfile.Segment, once *caddyopt.Once) error {
	name := sub[0].Text
	od := caddyfile.NewDispenser(sub)
	od.Next()
	parse, own := options[name]
	if !own {
		return p.passOn(od, name, sub)
	}
	if !repeatable[name] {
		if err := once.Check(od); err != nil {
			return err
		}
	}
	return parse(p, od, name)
}

// to reads `to <address> <N/M>...`.
func (p *blockParse) to(d *caddyfile.Dispenser, _ string) error {
	args, err := caddyopt.Args(d, directive)
	if err != nil {
		return err
	}
	if len(args)%2 != 0 {
		return caddyopt.Errf(d, directive, "to: want pairs of <address> <N/M>, got %d argument(s)", len(args))
	}
	for i := 0; i < len(args); i += 2 {
		if _, err := checkDial(args[i]); err != nil {
			return caddyopt.Errf(d, directive, "to: %v", err)
		}
		if _, err := ParseTag(args[i+1]); err != nil {
			return caddyopt.Errf(d, directive, "to %s: %v", args[i], err)
		}
		p.h.Upstreams = append(p.h.Upstreams, UpstreamConfig{Dial: args[i], Tag: args[i+1]})
	}
	return nil
}

// namingFile reads `naming_file <path>`.
func (p *blockParse) namingFile(d *caddyfile.Dispenser, _ string) error {
	v, err := caddyopt.OneArg(d, directive)
	if err != nil {
		return err
	}
	p.h.NamingFile = v
	return nil
}

// maxRemovedPercent reads `naming_max_removed_percent <percent>`.
func (p *blockParse) maxRemovedPercent(d *caddyfile.Dispenser, name string) error {
	v, err := caddyopt.OneArg(d, directive)
	if err != nil {
		return err
	}
	pct, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
	if err != nil {
		return caddyopt.Invalid(d, directive, name, v, "a percentage such as 50%")
	}
	if err := checkMaxRemovedPercent(pct); err != nil {
		return caddyopt.Errf(d, directive, "%v", err)
	}
	p.h.NamingMaxRemovedPercent = pct
	return nil
}

// serfTag reads the serf_tag block (see parseSerfTag).
func (p *blockParse) serfTag(d *caddyfile.Dispenser, _ string) error {
	sn, err := parseSerfTag(d, directive+": serf_tag")
	if err != nil {
		return err
	}
	p.h.Serf = sn
	return nil
}

// duration reads `timeout <duration>` and `poll_interval <duration>`.
func (p *blockParse) duration(d *caddyfile.Dispenser, name string) error {
	dur, err := caddyopt.Duration(d, p.what)
	if err != nil {
		return err
	}
	if name == "timeout" {
		err = bounds.Duration(name, dur, minTimeout, maxTimeout)
		p.f.Timeout = caddy.Duration(dur)
	} else {
		err = bounds.Duration(name, dur, minPollInterval, maxPollInterval)
		p.h.PollInterval = caddy.Duration(dur)
	}
	if err != nil {
		return caddyopt.Errf(d, p.what, "%v", err)
	}
	return nil
}

// failLimit reads `fail_limit <n>`.
func (p *blockParse) failLimit(d *caddyfile.Dispenser, name string) error {
	n, err := caddyopt.Int(d, p.what)
	if err != nil {
		return err
	}
	if err := bounds.Int(name, n, 1, p.maxFail); err != nil {
		return caddyopt.Errf(d, p.what, "%v", err)
	}
	p.f.FailLimit = n
	return nil
}

// size reads the size options: max_request_body, max_response_body,
// max_merged_body and max_merge_memory. How the sizes fit together is
// checked once the block is read (see check).
func (p *blockParse) size(d *caddyfile.Dispenser, name string) error {
	v, err := caddyopt.OneArg(d, p.what)
	if err != nil {
		return err
	}
	size, err := humanize.ParseBytes(v)
	if err != nil {
		return caddyopt.Invalid(d, p.what, name, v, "a size such as 1MiB or 65536")
	}
	n := int64(min(size, math.MaxInt64))
	p.sizeAt = d
	if name == "max_merge_memory" {
		p.f.MaxMergeMemory = n
		return nil
	}
	if err := checkSize(name, n); err != nil {
		return caddyopt.Errf(d, p.what, "%v", err)
	}
	switch name {
	case "max_request_body":
		p.f.MaxRequestBody = n
	case "max_response_body":
		p.f.MaxResponseBody = n
	default:
		p.f.MaxMergedBody = n
	}
	return nil
}

// merge reads `merge <merger> ...`; the merger's own unmarshaler reads
// the rest of the line.
func (p *blockParse) merge(d *caddyfile.Dispenser, _ string) error {
	if !d.NextArg() {
		return caddyopt.Missing(d, p.what)
	}
	mname := d.Val()
	unm, err := caddyfile.UnmarshalModule(d, "http.partition.mergers."+mname)
	if err != nil {
		return fmt.Errorf("%s: %w", p.what, err)
	}
	p.f.MergeRaw = caddyconfig.JSONModuleObject(unm, "merger", mname, nil)
	return nil
}

// skip reads `skip <cel expression>`.
func (p *blockParse) skip(d *caddyfile.Dispenser, _ string) error {
	args, err := caddyopt.Args(d, p.what)
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return caddyopt.Errf(d, p.what, "skip: want one CEL expression (in backticks), e.g. skip `{%s.index} == 2`; got %d argument(s)", p.what, len(args))
	}
	m, err := expressionMatcher(d, p.what+": skip", args[0])
	if err != nil {
		return err
	}
	p.f.SkipRaw = append(p.f.SkipRaw, m)
	return nil
}

// reject reads `reject <cel expression> [<message>]`.
func (p *blockParse) reject(d *caddyfile.Dispenser, _ string) error {
	args, err := caddyopt.Args(d, directive)
	if err != nil {
		return err
	}
	if len(args) > 2 {
		return caddyopt.Errf(d, directive, "reject: want a CEL expression (in backticks) and an optional message, e.g. reject `{query.limit} > 100` \"limit too large\"; got %d argument(s)", len(args))
	}
	m, err := expressionMatcher(d, directive+": reject", args[0])
	if err != nil {
		return err
	}
	rule := &RejectRule{MatchRaw: m}
	if len(args) == 2 {
		rule.Message = args[1]
	}
	p.h.Reject = append(p.h.Reject, rule)
	return nil
}

// lbRetries reads `lb_retries <n>`, the handler's retries.
func (p *blockParse) lbRetries(d *caddyfile.Dispenser, name string) error {
	n, err := caddyopt.Int(d, directive)
	if err != nil {
		return err
	}
	if err := bounds.Int(name, n, 0, maxRetries); err != nil {
		return caddyopt.Errf(d, directive, "%v", err)
	}
	p.h.Retries = &n
	return nil
}

// passOn keeps the segment sub of an option that is not partition's for
// reverse_proxy (see proxy), or refuses one partition does not support.
func (p *blockParse) passOn(d *caddyfile.Dispenser, name string, sub caddyfile.Segment) error {
	switch name {
	case "dynamic":
		return caddyopt.Errf(d, directive, "dynamic upstreams are not supported; use naming_file or serf_tag")
	case "handle_response", "replace_status":
		return caddyopt.Errf(d, directive, "%s is not supported", name)
	case "response_buffers", "buffer_responses":
		return caddyopt.Errf(d, directive, "%s is not supported: each sub-response is held whole already (see max_response_body)", name)
	}
	if strings.HasPrefix(name, "@") {
		return caddyopt.Errf(d, directive, "response matchers are not supported")
	}
	p.passthrough = append(p.passthrough, sub...)
	return nil
}

// check applies the checks that span options, once the block is read; d
// is the directive's dispenser.
func (p *blockParse) check(d *caddyfile.Dispenser) error {
	h := p.h
	if h.NamingMaxRemovedPercent != 0 && h.NamingFile == "" {
		return caddyopt.Errf(d, directive, "naming_max_removed_percent is set without a naming_file")
	}
	if err := p.checkSizes(); err != nil {
		return err
	}
	if len(h.Upstreams) == 0 && h.NamingFile == "" && h.Serf == nil {
		at := caddyfile.NewDispenser(p.seg[:1])
		at.Next()
		return caddyopt.Errf(at, directive, "no upstreams: give tagged upstreams (to <address> <N/M>), a naming_file or serf_tag")
	}
	return nil
}

// checkSizes checks how the size options fit together, at the last one
// given.
func (p *blockParse) checkSizes() error {
	if p.sizeAt == nil {
		return nil
	}
	resp, merged := cmp.Or(p.f.MaxResponseBody, defaultMaxResponseBody), cmp.Or(p.f.MaxMergedBody, defaultMaxMergedBody)
	if err := checkMergedBody(resp, merged); err != nil {
		return caddyopt.Errf(p.sizeAt, p.what, "%v", err)
	}
	sized := FanOut{MaxMergedBody: merged, MaxMergeMemory: p.f.MaxMergeMemory}
	if err := sized.checkMergeMemory(); err != nil {
		return caddyopt.Errf(p.sizeAt, p.what, "%v", err)
	}
	return nil
}

// proxy hands reverse_proxy's options to reverse_proxy's own unmarshaler,
// as a block of the same directive, for the internal reverse_proxy.
func (p *blockParse) proxy() error {
	if len(p.passthrough) == 0 {
		return nil
	}
	seg := p.seg
	tokens := make([]caddyfile.Token, 0, len(p.passthrough)+3)
	tokens = append(tokens, seg[0], seg[1])
	tokens = append(tokens, p.passthrough...)
	tokens = append(tokens, seg[len(seg)-1])
	rp := new(reverseproxy.Handler)
	if err := rp.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
		return err
	}
	if rp.HealthChecks != nil && rp.HealthChecks.Active != nil {
		at := caddyfile.NewDispenser(p.passthrough)
		for at.Next() {
			if strings.HasPrefix(at.Val(), "health_") {
				break
			}
		}
		return caddyopt.Errf(at, directive, "active health checks (health_*) are not supported; use passive health checks (fail_duration, max_fails, …) or lb_policy least_time { outlier }")
	}
	p.h.Proxy = rp
	return nil
}

// expressionMatcher returns a matcher set of one CEL expression, after
// compiling it (as its Provision will) so that a bad expression is
// reported where it is written; errors start with what.
func expressionMatcher(d *caddyfile.Dispenser, what, expr string) (caddy.ModuleMap, error) {
	if strings.TrimSpace(expr) == "" {
		return nil, caddyopt.Errf(d, what, "empty expression")
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	m := caddyhttp.MatchExpression{Expr: expr}
	if err := m.Provision(ctx); err != nil {
		return nil, caddyopt.Errf(d, what, "invalid expression `%s`: %v", expr, err)
	}
	raw, err := json.Marshal(caddyhttp.MatchExpression{Expr: expr})
	if err != nil {
		return nil, d.WrapErr(err)
	}
	return caddy.ModuleMap{"expression": raw}, nil
}

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)

// parseSerfTag parses the serf_tag option (see SerfNaming):
//
//	serf_tag [<member tag>] {
//		port         <port>
//		port_tag     <member tag>
//		tag          <key> <value>
//		exclude_self
//		allow_networks <cidr|ip>...
//		allow_ports    <port|lo-hi>...
//	}
//
// The member tag defaults to "partition"; `tag` may be repeated.
func parseSerfTag(d *caddyfile.Dispenser, what string) (*SerfNaming, error) {
	sn := new(SerfNaming)
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		sn.PartitionTag = args[0]
	default:
		return nil, caddyopt.Errf(d, what, "at most one argument (the member tag holding the partition tags), got %d", len(args))
	}
	once := caddyopt.NewOnce(what)
	for d.NextBlock(0) {
		ok, err := sn.UnmarshalOption(d, what, once)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, caddyopt.Unknown(d, what, cluster.SelectorOptions...)
		}
	}
	if err := sn.validate(); err != nil {
		return nil, caddyopt.Errf(d, what, "%v", strings.TrimPrefix(err.Error(), "serf: "))
	}
	return sn, nil
}
