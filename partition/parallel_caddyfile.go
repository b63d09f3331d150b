package partition

import (
	"maps"
	"slices"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

// parallel's Caddyfile parser is a function of the Helper, as selective's
// is, rather than an UnmarshalCaddyfile method: a branch's routes are
// parsed as a subroute, which needs the Helper. It lives in a file of its
// own so that partition's caddyfile.go stays about partition.

func init() {
	httpcaddyfile.RegisterHandlerDirective("parallel", parseParallel)
	httpcaddyfile.RegisterDirectiveOrder("parallel", httpcaddyfile.Before, "reverse_proxy")
}

// parallelDirective is the Caddyfile directive, the start of its errors.
const parallelDirective = "parallel"

// parallelOptions are parallel's options besides branch: the fan-out's,
// read by partition's parsers.
var parallelOptions = map[string]optionParser{
	"fail_limit":        (*blockParse).failLimit,
	"timeout":           (*blockParse).duration,
	"max_request_body":  (*blockParse).size,
	"max_response_body": (*blockParse).size,
	"max_merged_body":   (*blockParse).size,
	"max_merge_memory":  (*blockParse).size,
	"merge":             (*blockParse).merge,
	"skip":              (*blockParse).skip,
	"split_body":        (*blockParse).splitBody,
}

// parseParallel sets up the handler from Caddyfile tokens. Syntax:
//
//	parallel [<matcher>] {
//		branch [<name>] {
//			# directives, as in a route: a reverse_proxy, a selective,
//			# a partition, another parallel, …
//			reverse_proxy <upstreams...>
//		}
//		fail_limit <n>
//		timeout <duration>
//		merge json|concat|ndjson|first
//		max_request_body <size>
//		max_response_body <size>
//		max_merged_body <size>
//		max_merge_memory <size>
//		skip <cel expression>
//		split_body <field> [hash|index] [{
//			key          <member>
//			max_elements <n>
//		}]
//	}
//
// branch and skip may be repeated; every other option may appear once. A
// branch without a name is named by its index. Values are checked against
// the bounds given in the JSON field docs as they are read, fail_limit
// against the number of branches once the block is read.
func parseParallel(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	const what = parallelDirective
	par := new(Parallel)
	h.Next() // the directive's name
	if err := caddyopt.BlockOnly(h.Dispenser, what); err != nil {
		return nil, err
	}
	p := &blockParse{f: &par.FanOut, what: what, maxFail: maxBranches}
	once := caddyopt.NewOnce(what)
	var failAt *caddyfile.Dispenser
	var branchAt []*caddyfile.Dispenser
	for nesting := h.Nesting(); h.NextBlock(nesting); {
		name := h.Val()
		seg := h.NextSegment()
		od := caddyfile.NewDispenser(seg)
		od.Next()
		if name == "branch" {
			b, err := parseBranch(h, seg, od)
			if err != nil {
				return nil, err
			}
			par.Branches = append(par.Branches, b)
			branchAt = append(branchAt, od)
			continue
		}
		parse, ok := parallelOptions[name]
		if !ok {
			return nil, caddyopt.Unknown(od, what, append([]string{"branch"}, slices.Sorted(maps.Keys(parallelOptions))...)...)
		}
		if name != "skip" {
			if err := once.Check(od); err != nil {
				return nil, err
			}
		}
		if name == "fail_limit" {
			failAt = od
		}
		if err := parse(p, od, name); err != nil {
			return nil, err
		}
	}
	if len(par.Branches) == 0 {
		return nil, h.Errf("%s: no branch given; add at least one: branch [<name>] { reverse_proxy ... }", what)
	}
	if len(par.Branches) > maxBranches {
		return nil, caddyopt.Errf(branchAt[maxBranches], what, "%d branches; at most %d", len(par.Branches), maxBranches)
	}
	seen := make(map[string]bool, len(par.Branches))
	for i, b := range par.Branches {
		name := branchName(b.Name, i)
		if seen[name] {
			return nil, caddyopt.Errf(branchAt[i], what, "branch %s specified more than once (an unnamed branch is named by its index)", name)
		}
		seen[name] = true
	}
	if failAt != nil && par.FailLimit > len(par.Branches) {
		return nil, caddyopt.Errf(failAt, what, "fail_limit %d is above the number of branches, %d", par.FailLimit, len(par.Branches))
	}
	if err := p.checkSizes(); err != nil {
		return nil, err
	}
	return par, nil
}

// parseBranch reads `branch [<name>] { <directives> }`, the segment seg
// (od reads it, on the option's name): the directives become the
// branch's routes, as in a subroute.
func parseBranch(h httpcaddyfile.Helper, seg caddyfile.Segment, od *caddyfile.Dispenser) (*Branch, error) {
	b := new(Branch)
	bw := parallelDirective + ": branch"
	if od.NextArg() && od.Val() != "{" {
		b.Name = od.Val()
		if err := bounds.Name(branchNameKind, b.Name, maxBranchName); err != nil {
			return nil, caddyopt.Errf(od, parallelDirective, "%v", err)
		}
		bw += " " + b.Name
		if od.NextArg() && od.Val() != "{" {
			return nil, caddyopt.Errf(od, bw, "unexpected argument %q (want a name, then a block)", od.Val())
		}
	}
	routes, err := caddyopt.Routes(h, seg, bw, branchNameKind)
	if err != nil {
		return nil, err
	}
	b.Routes = routes
	return b, nil
}
