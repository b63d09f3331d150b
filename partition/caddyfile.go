package partition

import (
	"cmp"
	"context"
	"encoding/json"
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
//		merge json|concat|ndjson|first
//		skip <cel expression>
//		reject <cel expression> [<message>]
//		lb_retries <n>
//
//		# any other reverse_proxy subdirective except upstreams, dynamic,
//		# active health checks, handle_response and response_buffers, e.g.:
//		lb_policy ewma
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
	seg := d.NextSegment()
	sd := caddyfile.NewDispenser(seg)
	sd.Next()
	if sd.NextArg() {
		return sd.Errf("partition takes no arguments on its line; give upstreams in its block: to <address> <N/M>")
	}

	var passthrough []caddyfile.Token
	var sizeAt *caddyfile.Dispenser // the last size option, for errors about both
	seen := make(map[string]bool)
	once := func(d *caddyfile.Dispenser) error {
		if seen[d.Val()] {
			return d.Errf("%s specified more than once", d.Val())
		}
		seen[d.Val()] = true
		return nil
	}
	for sd.NextBlock(0) {
		sub := sd.NextSegment()
		name := sub[0].Text
		od := caddyfile.NewDispenser(sub)
		od.Next()
		switch name {
		case "to":
			args := od.RemainingArgs()
			if len(args) == 0 || len(args)%2 != 0 {
				return od.Errf("to: want pairs of <address> <N/M>, got %d argument(s)", len(args))
			}
			for i := 0; i < len(args); i += 2 {
				if _, err := checkDial(args[i]); err != nil {
					return od.Errf("to: %v", err)
				}
				if _, err := ParseTag(args[i+1]); err != nil {
					return od.Errf("to %s: %v", args[i], err)
				}
				h.Upstreams = append(h.Upstreams, UpstreamConfig{Dial: args[i], Tag: args[i+1]})
			}
			if od.NextBlock(0) {
				return od.Err("to takes no block")
			}

		case "naming_file":
			if err := once(od); err != nil {
				return err
			}
			v, err := oneArg(od)
			if err != nil {
				return err
			}
			h.NamingFile = v

		case "naming_max_removed_percent":
			if err := once(od); err != nil {
				return err
			}
			v, err := oneArg(od)
			if err != nil {
				return err
			}
			pct, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
			if err != nil {
				return od.Errf("%s: invalid percentage %q; want e.g. 50%%", name, v)
			}
			if err := checkMaxRemovedPercent(pct); err != nil {
				return od.Errf("%v", err)
			}
			h.NamingMaxRemovedPercent = pct

		case "serf_tag":
			if err := once(od); err != nil {
				return err
			}
			sn, err := parseSerfTag(od)
			if err != nil {
				return err
			}
			h.Serf = sn

		case "poll_interval", "timeout":
			if err := once(od); err != nil {
				return err
			}
			v, err := oneArg(od)
			if err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil {
				return od.Errf("%s: invalid duration %q: %v", name, v, err)
			}
			if name == "timeout" {
				err = bounds.Duration(name, dur, minTimeout, maxTimeout)
				h.Timeout = caddy.Duration(dur)
			} else {
				err = bounds.Duration(name, dur, minPollInterval, maxPollInterval)
				h.PollInterval = caddy.Duration(dur)
			}
			if err != nil {
				return od.Errf("%v", err)
			}

		case "fail_limit":
			if err := once(od); err != nil {
				return err
			}
			v, err := oneArg(od)
			if err != nil {
				return err
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return od.Errf("fail_limit: want a whole number of partitions, at least 1; got %q", v)
			}
			if err := bounds.Int(name, n, 1, MaxPartitions); err != nil {
				return od.Errf("%v", err)
			}
			h.FailLimit = n

		case "max_request_body", "max_response_body", "max_merged_body":
			if err := once(od); err != nil {
				return err
			}
			v, err := oneArg(od)
			if err != nil {
				return err
			}
			size, err := humanize.ParseBytes(v)
			if err != nil {
				return od.Errf("%s: invalid size %q; want e.g. 1MiB or 65536", name, v)
			}
			n := int64(min(size, math.MaxInt64))
			if err := checkSize(name, n); err != nil {
				return od.Errf("%v", err)
			}
			sizeAt = od
			switch name {
			case "max_request_body":
				h.MaxRequestBody = n
			case "max_response_body":
				h.MaxResponseBody = n
			default:
				h.MaxMergedBody = n
			}

		case "merge":
			if err := once(od); err != nil {
				return err
			}
			if !od.NextArg() {
				return od.ArgErr()
			}
			mname := od.Val()
			unm, err := caddyfile.UnmarshalModule(od, "http.partition.mergers."+mname)
			if err != nil {
				return err
			}
			h.MergeRaw = caddyconfig.JSONModuleObject(unm, "merger", mname, nil)

		case "skip":
			args := od.RemainingArgs()
			if len(args) != 1 {
				return od.Errf("skip: want one CEL expression (in backticks), e.g. skip `{partition.index} == 2`; got %d argument(s)", len(args))
			}
			m, err := expressionMatcher(od, name, args[0])
			if err != nil {
				return err
			}
			h.SkipRaw = append(h.SkipRaw, m)

		case "reject":
			args := od.RemainingArgs()
			if len(args) != 1 && len(args) != 2 {
				return od.Errf("reject: want a CEL expression (in backticks) and an optional message, e.g. reject `{query.limit} > 100` \"limit too large\"; got %d argument(s)", len(args))
			}
			m, err := expressionMatcher(od, name, args[0])
			if err != nil {
				return err
			}
			rule := &RejectRule{MatchRaw: m}
			if len(args) == 2 {
				rule.Message = args[1]
			}
			h.Reject = append(h.Reject, rule)

		case "lb_retries":
			if err := once(od); err != nil {
				return err
			}
			v, err := oneArg(od)
			if err != nil {
				return err
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return od.Errf("lb_retries: want a whole number of retries, 0 or more; got %q", v)
			}
			if err := bounds.Int(name, n, 0, maxRetries); err != nil {
				return od.Errf("%v", err)
			}
			h.Retries = &n

		case "dynamic":
			return od.Err("dynamic upstreams are not supported in partition; use naming_file")
		case "handle_response", "replace_status":
			return od.Errf("%s is not supported in partition", name)
		case "response_buffers", "buffer_responses":
			return od.Errf("%s is not supported in partition, which holds each sub-response whole already (see max_response_body)", name)
		default:
			if strings.HasPrefix(name, "@") {
				return od.Err("response matchers are not supported in partition")
			}
			passthrough = append(passthrough, sub...)
		}
	}

	if h.NamingMaxRemovedPercent != 0 && h.NamingFile == "" {
		return d.Errf("naming_max_removed_percent is set without a naming_file")
	}
	if sizeAt != nil {
		resp, merged := cmp.Or(h.MaxResponseBody, defaultMaxResponseBody), cmp.Or(h.MaxMergedBody, defaultMaxMergedBody)
		if err := checkMergedBody(resp, merged); err != nil {
			return sizeAt.Errf("%v", err)
		}
	}
	if len(h.Upstreams) == 0 && h.NamingFile == "" && h.Serf == nil {
		at := caddyfile.NewDispenser(seg[:1])
		at.Next()
		return at.Errf("partition has no upstreams: give tagged upstreams (to <address> <N/M>), a naming_file or serf_tag")
	}
	if len(passthrough) == 0 {
		return nil
	}
	// The rest is reverse_proxy's: hand it to reverse_proxy's own
	// unmarshaler as a block of the same directive.
	tokens := make([]caddyfile.Token, 0, len(passthrough)+3)
	tokens = append(tokens, seg[0], seg[1])
	tokens = append(tokens, passthrough...)
	tokens = append(tokens, seg[len(seg)-1])
	rp := new(reverseproxy.Handler)
	if err := rp.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
		return err
	}
	if rp.HealthChecks != nil && rp.HealthChecks.Active != nil {
		at := caddyfile.NewDispenser(passthrough)
		for at.Next() {
			if strings.HasPrefix(at.Val(), "health_") {
				break
			}
		}
		return at.Err("active health checks (health_*) are not supported in partition; use passive health checks (fail_duration, max_fails, …) or lb_policy ewma { outlier }")
	}
	h.Proxy = rp
	return nil
}

// expressionMatcher returns a matcher set of one CEL expression, after
// compiling it (as its Provision will) so that a bad expression is
// reported where it is written.
func expressionMatcher(d *caddyfile.Dispenser, name, expr string) (caddy.ModuleMap, error) {
	if strings.TrimSpace(expr) == "" {
		return nil, d.Errf("%s: empty expression", name)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	m := caddyhttp.MatchExpression{Expr: expr}
	if err := m.Provision(ctx); err != nil {
		return nil, d.Errf("%s: invalid expression `%s`: %v", name, expr, err)
	}
	raw, err := json.Marshal(caddyhttp.MatchExpression{Expr: expr})
	if err != nil {
		return nil, d.WrapErr(err)
	}
	return caddy.ModuleMap{"expression": raw}, nil
}

func oneArg(d *caddyfile.Dispenser) (string, error) {
	name := d.Val()
	if !d.NextArg() {
		return "", d.Errf("%s: missing value", name)
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.Errf("%s: want one value, got more", name)
	}
	if d.NextBlock(0) {
		return "", d.Errf("%s takes no block", name)
	}
	return v, nil
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
//	}
//
// The member tag defaults to "partition"; `tag` may be repeated.
func parseSerfTag(d *caddyfile.Dispenser) (*SerfNaming, error) {
	sn := new(SerfNaming)
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		sn.PartitionTag = args[0]
	default:
		return nil, d.Errf("serf_tag: at most one argument (the member tag holding the partition tags), got %d", len(args))
	}
	const what = "serf_tag"
	once := caddyopt.NewOnce(what)
	for d.NextBlock(0) {
		if d.Val() != "tag" {
			if err := once.Check(d); err != nil {
				return nil, err
			}
		}
		ok, err := sn.UnmarshalOption(d, what)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, caddyopt.Unknown(d, what, cluster.SelectorOptions...)
		}
	}
	if err := sn.validate(); err != nil {
		return nil, d.Errf("serf_tag: %v", strings.TrimPrefix(err.Error(), "serf: "))
	}
	return sn, nil
}
