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
//		max_merge_memory <size>
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
	const what = "partition"
	d.Next() // consume the directive name
	seg := d.NextSegment()
	sd := caddyfile.NewDispenser(seg)
	sd.Next()
	if err := caddyopt.BlockOnly(sd, what); err != nil {
		return err
	}

	var passthrough []caddyfile.Token
	var sizeAt *caddyfile.Dispenser // the last size option, for errors about both
	once := caddyopt.NewOnce(what)
	for sd.NextBlock(0) {
		sub := sd.NextSegment()
		name := sub[0].Text
		od := caddyfile.NewDispenser(sub)
		od.Next()
		switch name { // to, skip and reject repeat; reverse_proxy checks its own options
		case "naming_file", "naming_max_removed_percent", "serf_tag", "poll_interval", "timeout", "fail_limit",
			"max_request_body", "max_response_body", "max_merged_body", "max_merge_memory", "merge", "lb_retries":
			if err := once.Check(od); err != nil {
				return err
			}
		}
		switch name {
		case "to":
			args, err := caddyopt.Args(od, what)
			if err != nil {
				return err
			}
			if len(args)%2 != 0 {
				return caddyopt.Errf(od, what, "to: want pairs of <address> <N/M>, got %d argument(s)", len(args))
			}
			for i := 0; i < len(args); i += 2 {
				if _, err := checkDial(args[i]); err != nil {
					return caddyopt.Errf(od, what, "to: %v", err)
				}
				if _, err := ParseTag(args[i+1]); err != nil {
					return caddyopt.Errf(od, what, "to %s: %v", args[i], err)
				}
				h.Upstreams = append(h.Upstreams, UpstreamConfig{Dial: args[i], Tag: args[i+1]})
			}

		case "naming_file":
			v, err := caddyopt.OneArg(od, what)
			if err != nil {
				return err
			}
			h.NamingFile = v

		case "naming_max_removed_percent":
			v, err := caddyopt.OneArg(od, what)
			if err != nil {
				return err
			}
			pct, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
			if err != nil {
				return caddyopt.Invalid(od, what, name, v, "a percentage such as 50%")
			}
			if err := checkMaxRemovedPercent(pct); err != nil {
				return caddyopt.Errf(od, what, "%v", err)
			}
			h.NamingMaxRemovedPercent = pct

		case "serf_tag":
			sn, err := parseSerfTag(od, what+": serf_tag")
			if err != nil {
				return err
			}
			h.Serf = sn

		case "poll_interval", "timeout":
			dur, err := caddyopt.Duration(od, what)
			if err != nil {
				return err
			}
			if name == "timeout" {
				err = bounds.Duration(name, dur, minTimeout, maxTimeout)
				h.Timeout = caddy.Duration(dur)
			} else {
				err = bounds.Duration(name, dur, minPollInterval, maxPollInterval)
				h.PollInterval = caddy.Duration(dur)
			}
			if err != nil {
				return caddyopt.Errf(od, what, "%v", err)
			}

		case "fail_limit":
			n, err := caddyopt.Int(od, what)
			if err != nil {
				return err
			}
			if err := bounds.Int(name, n, 1, MaxPartitions); err != nil {
				return caddyopt.Errf(od, what, "%v", err)
			}
			h.FailLimit = n

		case "max_request_body", "max_response_body", "max_merged_body", "max_merge_memory":
			v, err := caddyopt.OneArg(od, what)
			if err != nil {
				return err
			}
			size, err := humanize.ParseBytes(v)
			if err != nil {
				return caddyopt.Invalid(od, what, name, v, "a size such as 1MiB or 65536")
			}
			n := int64(min(size, math.MaxInt64))
			sizeAt = od
			if name == "max_merge_memory" {
				h.MaxMergeMemory = n
				break
			}
			if err := checkSize(name, n); err != nil {
				return caddyopt.Errf(od, what, "%v", err)
			}
			switch name {
			case "max_request_body":
				h.MaxRequestBody = n
			case "max_response_body":
				h.MaxResponseBody = n
			default:
				h.MaxMergedBody = n
			}

		case "merge":
			// The merger's own unmarshaler reads the rest of the line.
			if !od.NextArg() {
				return caddyopt.Missing(od, what)
			}
			mname := od.Val()
			unm, err := caddyfile.UnmarshalModule(od, "http.partition.mergers."+mname)
			if err != nil {
				return err
			}
			h.MergeRaw = caddyconfig.JSONModuleObject(unm, "merger", mname, nil)

		case "skip":
			args, err := caddyopt.Args(od, what)
			if err != nil {
				return err
			}
			if len(args) != 1 {
				return caddyopt.Errf(od, what, "skip: want one CEL expression (in backticks), e.g. skip `{partition.index} == 2`; got %d argument(s)", len(args))
			}
			m, err := expressionMatcher(od, what+": skip", args[0])
			if err != nil {
				return err
			}
			h.SkipRaw = append(h.SkipRaw, m)

		case "reject":
			args, err := caddyopt.Args(od, what)
			if err != nil {
				return err
			}
			if len(args) > 2 {
				return caddyopt.Errf(od, what, "reject: want a CEL expression (in backticks) and an optional message, e.g. reject `{query.limit} > 100` \"limit too large\"; got %d argument(s)", len(args))
			}
			m, err := expressionMatcher(od, what+": reject", args[0])
			if err != nil {
				return err
			}
			rule := &RejectRule{MatchRaw: m}
			if len(args) == 2 {
				rule.Message = args[1]
			}
			h.Reject = append(h.Reject, rule)

		case "lb_retries":
			n, err := caddyopt.Int(od, what)
			if err != nil {
				return err
			}
			if err := bounds.Int(name, n, 0, maxRetries); err != nil {
				return caddyopt.Errf(od, what, "%v", err)
			}
			h.Retries = &n

		case "dynamic":
			return caddyopt.Errf(od, what, "dynamic upstreams are not supported; use naming_file or serf_tag")
		case "handle_response", "replace_status":
			return caddyopt.Errf(od, what, "%s is not supported", name)
		case "response_buffers", "buffer_responses":
			return caddyopt.Errf(od, what, "%s is not supported: each sub-response is held whole already (see max_response_body)", name)
		default:
			if strings.HasPrefix(name, "@") {
				return caddyopt.Errf(od, what, "response matchers are not supported")
			}
			passthrough = append(passthrough, sub...)
		}
	}

	if h.NamingMaxRemovedPercent != 0 && h.NamingFile == "" {
		return caddyopt.Errf(d, what, "naming_max_removed_percent is set without a naming_file")
	}
	if sizeAt != nil {
		resp, merged := cmp.Or(h.MaxResponseBody, defaultMaxResponseBody), cmp.Or(h.MaxMergedBody, defaultMaxMergedBody)
		if err := checkMergedBody(resp, merged); err != nil {
			return caddyopt.Errf(sizeAt, what, "%v", err)
		}
		sized := Handler{MaxMergedBody: merged, MaxMergeMemory: h.MaxMergeMemory}
		if err := sized.checkMergeMemory(); err != nil {
			return caddyopt.Errf(sizeAt, what, "%v", err)
		}
	}
	if len(h.Upstreams) == 0 && h.NamingFile == "" && h.Serf == nil {
		at := caddyfile.NewDispenser(seg[:1])
		at.Next()
		return caddyopt.Errf(at, what, "no upstreams: give tagged upstreams (to <address> <N/M>), a naming_file or serf_tag")
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
		return caddyopt.Errf(at, what, "active health checks (health_*) are not supported; use passive health checks (fail_duration, max_fails, …) or lb_policy ewma { outlier }")
	}
	h.Proxy = rp
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
