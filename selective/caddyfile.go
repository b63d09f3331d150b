package selective

import (
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("selective", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("selective", httpcaddyfile.Before, "reverse_proxy")
}

// defaultStatusHeader is the header status_header names when given no name.
const defaultStatusHeader = "X-Selective"

// parseCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	selective [<matcher>] {
//		group <name> [weight <n>] {
//			# directives, as in a route: usually one reverse_proxy
//			reverse_proxy <upstreams...> {
//				lb_policy round_robin
//			}
//		}
//		policy latency|weighted|hash <key>|failover [<threshold percent>]
//		max_retry <n>
//		retry_on dial|timeout|error|<status>...
//		retry_any_method
//		backup_request <duration> | auto [quantile <percent>] [min <duration>] [max <duration>]
//		backup_match <matcher>
//		backup_budget <percent>
//		timeout <duration>
//		max_replay_body <size>
//		status_header [<name>]
//	}
//
// group and backup_match may be repeated (backup_match sets are ORed);
// every other option may appear once. Values are checked against the
// bounds given in the JSON field docs as they are read.
func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	const what = "selective"
	s := new(Handler)
	h.Next() // the directive's name
	if err := caddyopt.BlockOnly(h.Dispenser, what); err != nil {
		return nil, err
	}
	once := caddyopt.NewOnce(what)
	for nesting := h.Nesting(); h.NextBlock(nesting); {
		d := h.Dispenser
		name := d.Val()
		if name != "group" && name != "backup_match" {
			if err := once.Check(d); err != nil {
				return nil, err
			}
		}
		var err error
		switch name {
		case "group":
			err = s.parseGroup(h, what)
		case "policy":
			s.Policy, err = parsePolicy(d, what)
		case "max_retry":
			var n int
			if n, err = caddyopt.Int(d, what); err == nil {
				err = bounded(d, what, checkMaxRetry(n))
				s.MaxRetry = &n
			}
		case "retry_on":
			var args []string
			if args, err = caddyopt.Args(d, what); err == nil {
				_, perr := parseRetryOn(args)
				err = bounded(d, what, perr)
				s.RetryOn = args
			}
		case "retry_any_method":
			err = caddyopt.NoArgs(d, what)
			s.RetryAnyMethod = true
		case "backup_request":
			var args []string
			if args, err = caddyopt.Args(d, what); err == nil {
				if args[0] == "auto" {
					s.BackupRequestAuto, err = parseBackupAuto(d, what, args[1:])
				} else if len(args) > 1 {
					err = caddyopt.Errf(d, what, "backup_request: one duration or auto expected, got another: %q", args[1])
				} else {
					var v time.Duration
					if v, err = caddyopt.DurationValue(d, what, name, args[0]); err == nil {
						err = bounded(d, what, checkBackupRequest(v))
						s.BackupRequest = caddy.Duration(v)
					}
				}
			}
		case "backup_match":
			var set caddy.ModuleMap
			if set, err = caddyhttp.ParseCaddyfileNestedMatcherSet(d); err != nil {
				return nil, caddyopt.Errf(d, what, "backup_match: %v", err)
			}
			s.BackupMatchRaw = append(s.BackupMatchRaw, set)
		case "backup_budget":
			var v string
			if v, err = caddyopt.OneArg(d, what); err == nil {
				pct, perr := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
				if perr != nil {
					err = caddyopt.Invalid(d, what, name, v, "a percentage such as 10%")
				} else {
					err = bounded(d, what, checkBackupBudget(pct))
					s.BackupBudget = &pct
				}
			}
		case "timeout":
			s.Timeout, err = durationOption(d, what, checkTimeout)
		case "max_replay_body":
			var v string
			if v, err = caddyopt.OneArg(d, what); err == nil {
				n, perr := humanize.ParseBytes(v)
				if perr != nil || n > maxReplayLimit {
					err = caddyopt.Invalid(d, what, name, v, "a size from 1B to 1GiB, such as 1MiB")
				} else {
					err = bounded(d, what, checkMaxReplayBody(int64(n)))
					s.MaxReplayBody = int64(n)
				}
			}
		case "status_header":
			s.StatusHeader = defaultStatusHeader
			if d.NextArg() {
				s.StatusHeader = d.Val()
				if d.NextArg() {
					return nil, caddyopt.Errf(d, what, "status_header: one value expected, got another: %q", d.Val())
				}
			}
			if !validHeaderName(s.StatusHeader) {
				err = caddyopt.Errf(d, what, "status_header %q is not a valid header name", s.StatusHeader)
			}
		default:
			return nil, caddyopt.Unknown(d, what, "group", "policy", "max_retry", "retry_on", "retry_any_method",
				"backup_request", "backup_match", "backup_budget", "timeout", "max_replay_body", "status_header")
		}
		if err != nil {
			return nil, err
		}
	}
	if len(s.Groups) == 0 {
		return nil, h.Errf("%s: no group given; add at least one: group <name> { reverse_proxy ... }", what)
	}
	return s, nil
}

// bounded returns the error of a bounds check, if any, at the
// dispenser's line.
func bounded(d *caddyfile.Dispenser, what string, err error) error {
	if err == nil {
		return nil
	}
	return caddyopt.Errf(d, what, "%v", err)
}

// durationOption reads the option the dispenser is on as a duration and
// checks it with check.
func durationOption(d *caddyfile.Dispenser, what string, check func(d time.Duration) error) (caddy.Duration, error) {
	v, err := caddyopt.Duration(d, what)
	if err != nil {
		return 0, err
	}
	return caddy.Duration(v), bounded(d, what, check(v))
}

// parseBackupAuto reads what follows `backup_request auto`: pairs of
// quantile <percent>, min <duration> and max <duration>, each at most once.
func parseBackupAuto(d *caddyfile.Dispenser, what string, args []string) (*BackupAuto, error) {
	a := new(BackupAuto)
	seen := map[string]bool{}
	for i := 0; i < len(args); i += 2 {
		key := args[i]
		if key != "quantile" && key != "min" && key != "max" {
			return nil, caddyopt.Errf(d, what, "backup_request auto: unknown option %q; want quantile, min or max", key)
		}
		if seen[key] {
			return nil, caddyopt.Errf(d, what, "backup_request auto: %s given twice", key)
		}
		seen[key] = true
		if i+1 >= len(args) {
			return nil, caddyopt.Errf(d, what, "backup_request auto: %s needs a value", key)
		}
		val := args[i+1]
		opt := "backup_request auto " + key
		switch key {
		case "quantile":
			q, err := strconv.ParseFloat(strings.TrimSuffix(val, "%"), 64)
			if err != nil || q == 0 {
				return nil, caddyopt.Invalid(d, what, opt, val, "a percentage from 50 to 99.9, such as 95")
			}
			a.Quantile = q
		default:
			v, err := caddyopt.DurationValue(d, what, opt, val)
			if err != nil {
				return nil, err
			}
			if v == 0 {
				return nil, caddyopt.Invalid(d, what, opt, val, "a duration from 1ms to 1h")
			}
			if key == "min" {
				a.Min = caddy.Duration(v)
			} else {
				a.Max = caddy.Duration(v)
			}
		}
	}
	if err := a.validate(); err != nil {
		return nil, caddyopt.Errf(d, what, "%v", err)
	}
	return a, nil
}

// parsePolicy reads `policy <name> [<key or threshold>]`.
func parsePolicy(d *caddyfile.Dispenser, what string) (*Policy, error) {
	args, err := caddyopt.Args(d, what)
	if err != nil {
		return nil, err
	}
	p := &Policy{Name: args[0]}
	switch {
	case p.Name == policyHash && len(args) == 2:
		p.Key = args[1]
	case p.Name == policyHash:
		return nil, caddyopt.Errf(d, what, "policy hash: want one key, such as {http.request.header.X-User}, got %d value(s)", len(args)-1)
	case p.Name == policyFailover && len(args) == 2:
		pct, err := strconv.ParseFloat(strings.TrimSuffix(args[1], "%"), 64)
		if err != nil {
			return nil, caddyopt.Invalid(d, what, "policy failover", args[1], "a threshold percentage such as 70%")
		}
		if err := bounded(d, what, checkThreshold(pct)); err != nil {
			return nil, err
		}
		p.Threshold = pct
	case len(args) > 1:
		return nil, caddyopt.Errf(d, what, "policy %s: unexpected argument %q", p.Name, args[1])
	}
	if err := p.validate(); err != nil {
		return nil, caddyopt.Errf(d, what, "%v", err)
	}
	return p, nil
}

// parseGroup reads `group <name> [weight <n>] { <directives> }`: the
// directives become the group's routes, as in a subroute.
func (s *Handler) parseGroup(h httpcaddyfile.Helper, what string) error {
	d := h.Dispenser
	seg := d.NextSegment()
	gd := caddyfile.NewDispenser(seg)
	gd.Next()
	g := new(Group)
	if !gd.NextArg() || gd.Val() == "{" {
		return caddyopt.Errf(gd, what, "group: missing name")
	}
	g.Name = gd.Val()
	if err := checkGroupName(g.Name); err != nil {
		return caddyopt.Errf(gd, what, "%v", err)
	}
	gw := what + ": group " + g.Name
	for gd.NextArg() {
		if gd.Val() != "weight" {
			return caddyopt.Errf(gd, gw, "unexpected argument %q (want weight <n>, then a block)", gd.Val())
		}
		if g.Weight != 0 {
			return caddyopt.Errf(gd, gw, "weight specified more than once")
		}
		if !gd.NextArg() {
			return caddyopt.Errf(gd, gw, "weight: missing value")
		}
		n, err := strconv.Atoi(gd.Val())
		if err != nil {
			return caddyopt.Invalid(gd, gw, "weight", gd.Val(), "a whole number")
		}
		if err := bounded(gd, gw, checkWeight(n)); err != nil {
			return err
		}
		g.Weight = n
	}
	for _, o := range s.Groups {
		if o.Name == g.Name {
			return caddyopt.Errf(gd, what, "group %s specified more than once", g.Name)
		}
	}
	routes, err := caddyopt.Routes(h, seg, gw, "group")
	if err != nil {
		return err
	}
	g.Routes = routes
	s.Groups = append(s.Groups, g)
	return nil
}
