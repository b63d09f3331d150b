package partition

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/calldeadline"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/lbpolicy"
)

func init() {
	caddy.RegisterModule(new(Parallel))
}

// ParallelStatusHeader is the response header that reports each branch's
// outcome, e.g. "users=200;12ms, recs=502;3ms;failed, ads=skipped".
const ParallelStatusHeader = "X-Parallel-Status"

// ParallelMissingHeader is the response header of a merged answer that
// lists the branches missing from it (failed within fail_limit), e.g.
// "recs, ads"; absent when none is.
const ParallelMissingHeader = "X-Parallel-Missing"

// Bounds of a parallel handler's branches.
const (
	maxBranches    = 64
	maxBranchName  = 64
	branchNameKind = "branch"
)

// Parallel sends the request to every one of its branches at once and
// writes one merged response (brpc's ParallelChannel). Each branch is a
// list of routes, as a selective group is: a reverse_proxy, a selective,
// a partition, another parallel, or any handlers that write a response;
// the same routes may be given in several branches, to ask the same
// service several times.
//
// It runs on partition's fan-out engine (FanOut): the request body is
// read once (413 beyond max_request_body) and replayed to every branch;
// each branch's sub-request is a clone of the client request with its
// own replacer and variables, and the placeholders {parallel.index},
// {parallel.count} and {parallel.branch} (also spelled
// {http.parallel.index}, {http.parallel.count} and
// {http.parallel.branch}). A branch fails when its routes answer with a
// non-2xx status, return an error, write no response, time out, write a
// body over max_response_body, or the merger rejects its body. When
// fail_limit branches have failed, the answer is 502 (504 when the
// deadline passed) naming them, and the branches still running are
// cancelled down to their backends; a client that goes away cancels them
// all. The outcome of each branch is in the X-Parallel-Status header and
// the placeholders {http.parallel.<branch>.status}, ….
//
// One deadline (timeout, or the enclosing selective's or parallel's)
// bounds the whole call and every handler nested in the branches: a
// selective, partition or parallel in a branch takes it instead of its
// own timeout.
type Parallel struct {
	// The branches, at least one and at most 64, each with at least one
	// handler in its routes. Their outcomes are reported in this order.
	Branches []*Branch `json:"branches,omitempty"`

	// The fan-out's options: fail_limit (at most the number of
	// branches), timeout, max_request_body, max_response_body,
	// max_merged_body, max_merge_memory, merge and skip (whose matchers
	// see each branch's sub-request, with {parallel.index},
	// {parallel.count} and {parallel.branch}).
	FanOut

	subs  []*caddyhttp.Subroute
	round round
}

// Branch is one branch of Parallel.
type Branch struct {
	// The branch's name, in the X-Parallel-Status header, the
	// placeholders and error answers: letters, digits, '.', '-' and '_',
	// at most 64 bytes, unique among the branches. Default: the branch's
	// index, from 0.
	Name string `json:"name,omitempty"`

	// The routes that serve the branch's sub-request, as in a subroute.
	// A reverse_proxy here (or in a subroute here) that names no
	// selection policy gets least_time (written `ewma`, its earlier
	// name) at provisioning, as in a selective group.
	Routes caddyhttp.RouteList `json:"routes,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (*Parallel) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.parallel",
		New: func() caddy.Module { return new(Parallel) },
	}
}

// UnmarshalJSON decodes the handler strictly, as Caddy decodes modules,
// naming the option whose value does not decode.
func (p *Parallel) UnmarshalJSON(b []byte) error {
	type plain Parallel
	return jsonfield.Decode(b, (*plain)(p))
}

// Provision sets up the handler: defaults (the branches' names among
// them), the merger and skip matchers, and each branch's routes.
func (p *Parallel) Provision(ctx caddy.Context) error {
	p.fanOutDefaults(ctx, parallelKind)
	for i, b := range p.Branches {
		if b != nil {
			b.Name = branchName(b.Name, i)
		}
	}
	if err := p.validate(); err != nil {
		return err
	}
	if err := p.provisionFanOut(ctx); err != nil {
		return err
	}
	names := make([]string, len(p.Branches))
	for i, b := range p.Branches {
		// A reverse_proxy here that names no policy gets least_time, as
		// in a selective group: a retry goes to another replica, and a
		// slow or failing one is judged by its answers.
		if err := lbpolicy.DefaultRoutesPolicy(b.Routes); err != nil {
			return fmt.Errorf("branch %s: %v", b.Name, err)
		}
		sub := &caddyhttp.Subroute{Routes: b.Routes}
		if err := sub.Provision(ctx); err != nil {
			return fmt.Errorf("branch %s: %v", b.Name, err)
		}
		p.subs = append(p.subs, sub)
		names[i] = b.Name
	}
	p.round = round{count: len(p.Branches), names: names, newCall: p.newBranchCall}
	p.join()
	return nil
}

// Validate checks the configuration.
func (p *Parallel) Validate() error {
	return p.validate()
}

// validate checks the branches and the options' bounds, after the
// defaults are applied.
func (p *Parallel) validate() error {
	if len(p.Branches) == 0 {
		return errors.New("no branches; give at least one")
	}
	if len(p.Branches) > maxBranches {
		return fmt.Errorf("%d branches; at most %d", len(p.Branches), maxBranches)
	}
	checks := p.checks(len(p.Branches))
	seen := make(map[string]bool, len(p.Branches))
	for i, b := range p.Branches {
		if b == nil {
			checks = append(checks, fmt.Errorf("branches[%d] is null", i))
			continue
		}
		if err := bounds.Name(branchNameKind, b.Name, maxBranchName); err != nil {
			checks = append(checks, fmt.Errorf("branches[%d]: %v", i, err))
			continue
		}
		if seen[b.Name] {
			checks = append(checks, fmt.Errorf("branch %s given twice; names must be unique", b.Name))
		}
		seen[b.Name] = true
		// (Validate runs again after Provision, which loaded the raw
		// handlers and dropped them.)
		if !slices.ContainsFunc(b.Routes, func(r caddyhttp.Route) bool { return len(r.HandlersRaw) > 0 || len(r.Handlers) > 0 }) {
			checks = append(checks, fmt.Errorf("branch %s has no handler in its routes; give it one such as reverse_proxy", b.Name))
		}
	}
	return errors.Join(checks...)
}

// Cleanup takes the handler out of the merge memory bound. The branches'
// handlers are cleaned up by Caddy with the config.
func (p *Parallel) Cleanup() error {
	p.leave()
	return nil
}

// ServeHTTP fans the request out to every branch and writes the merged
// response. The call's deadline starts here: reading the request body
// counts against timeout as much as the branches do.
func (p *Parallel) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	end, _ := calldeadline.Start(r.Context(), time.Duration(p.Timeout))
	body, ok := p.requestBody(w, r, end)
	if !ok {
		return nil
	}
	rd := p.round
	if rd.bodies, ok = p.splitBodies(w, r, rd.count, body); !ok {
		return nil
	}
	p.fanOut(w, r, rd, body, end)
	return nil
}

// newBranchCall makes branch i's sub-request (newCall), served by the
// branch's routes, with the branch placeholders.
func (p *Parallel) newBranchCall(ctx context.Context, parent subParent, i int) *subCall {
	c, repl := p.newCall(ctx, parent, i, p.subs[i])
	for _, ns := range []string{"parallel.", "http.parallel."} {
		repl.Set(ns+"index", i)
		repl.Set(ns+"count", len(p.subs))
		repl.Set(ns+"branch", p.round.names[i])
	}
	return c
}

// branchName is the name of branch i, given name: name, or the index
// when it has none.
func branchName(name string, i int) string {
	if name == "" {
		return strconv.Itoa(i)
	}
	return name
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Parallel)(nil)
	_ caddy.Validator             = (*Parallel)(nil)
	_ caddy.CleanerUpper          = (*Parallel)(nil)
	_ caddyhttp.MiddlewareHandler = (*Parallel)(nil)
)
