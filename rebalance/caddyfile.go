package rebalance

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("rebalance", parseGlobalOption)
}

// parseGlobalOption turns the `rebalance` global option into the
// rebalance app.
func parseGlobalOption(d *caddyfile.Dispenser, existing any) (any, error) {
	if existing != nil {
		d.Next() // the option's name, so that the error has its line
		return nil, d.Err("rebalance: the global option is already set; use one rebalance block")
	}
	app := new(App)
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "rebalance", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from the `rebalance` global option.
// Syntax:
//
//	rebalance {
//		metric          connections|throughput|cpu
//		interval        <duration>
//		history         <duration>
//		freshness       <duration>
//		threshold       <percent>
//		stop_band       <percent>
//		shed_rate       <percent>
//		min_connections <n>
//		boundary_timeout <duration>
//	}
//
// Every option is optional and may appear once; percentages may be
// written with or without the % sign (20% or 20). boundary_timeout may be
// 0 (the default: never forced). Each value is checked against the bounds
// of its JSON field as it is read, so errors name their line.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const what = "rebalance"
	if err := caddyopt.BlockOnly(d, what); err != nil {
		return err
	}
	once := caddyopt.NewOnce(what)
	for d.NextBlock(0) {
		opt := d.Val()
		if err := once.Check(d); err != nil {
			return err
		}
		switch opt {
		case "metric":
			val, err := oneArg(d, "rebalance")
			if err != nil {
				return err
			}
			a.Metric = val
		case "interval", "history", "freshness":
			val, err := oneArg(d, "rebalance")
			if err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(val)
			if err != nil || dur <= 0 {
				return d.Errf("rebalance: %s %q: want a positive duration such as 1s", opt, val)
			}
			switch opt {
			case "interval":
				a.Interval = caddy.Duration(dur)
			case "history":
				a.History = caddy.Duration(dur)
			case "freshness":
				a.Freshness = caddy.Duration(dur)
			}
		case "threshold", "stop_band", "shed_rate":
			val, err := oneArg(d, "rebalance")
			if err != nil {
				return err
			}
			// 0 would mean the default; the bounds are checkOption's.
			pct, err := strconv.ParseFloat(strings.TrimSuffix(val, "%"), 64)
			if err != nil || pct == 0 {
				return d.Errf("rebalance: %s %q: want a percentage above 0%%", opt, val)
			}
			switch opt {
			case "threshold":
				a.Threshold = pct
			case "stop_band":
				a.StopBand = pct
			case "shed_rate":
				a.ShedRate = pct
			}
		case "boundary_timeout":
			val, err := oneArg(d, "rebalance")
			if err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(val)
			if err != nil || dur < 0 {
				return d.Errf("rebalance: boundary_timeout %q: want a duration such as 30s, or 0 to never force", val)
			}
			a.BoundaryTimeout = caddy.Duration(dur)
		case "min_connections":
			val, err := oneArg(d, "rebalance")
			if err != nil {
				return err
			}
			n, err := strconv.Atoi(val)
			if err != nil {
				return d.Errf("rebalance: min_connections %q: want a whole number", val)
			}
			a.MinConnections = &n
		default:
			if clusterOption(opt) {
				return d.Errf("rebalance: %s is an option of the cluster global option now: cluster { %s … }", opt, opt)
			}
			return caddyopt.Unknown(d, what, appOptions...)
		}
		if err := a.checkOption(opt); err != nil {
			return d.Errf("rebalance: %v", err)
		}
	}
	// The options against each other (the error points at the block's
	// end).
	a.resolve()
	if err := a.checkRelations(); err != nil {
		return d.Errf("rebalance: %v", err)
	}
	return nil
}

// clusterOption reports whether opt belongs to the cluster global option,
// so that a rebalance block written with it says where it goes.
func clusterOption(opt string) bool {
	switch opt {
	case "node_name", "bind", "advertise", "join", "encrypt_key", "tags":
		return true
	}
	return false
}

// UnmarshalCaddyfile sets up the listener wrapper, which has no options,
// from its line in the servers global option's listener_wrappers block.
// Syntax (before tls):
//
//	{
//		servers {
//			listener_wrappers {
//				rebalance
//				tls
//			}
//		}
//	}
func (w *ListenerWrapper) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return noOptions(d, "rebalance listener wrapper")
}

// noOptions consumes the name of a directive or module that takes no
// argument and no block, and rejects either; errors start with what.
func noOptions(d *caddyfile.Dispenser, what string) error {
	d.Next() // the name
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; it takes none", what, d.Val())
	}
	if d.NextBlock(0) {
		return d.Errf("%s: unexpected block; it takes no options", what)
	}
	return nil
}

// UnmarshalCaddyfile sets up the selection policy from Caddyfile tokens.
// Syntax:
//
//	lb_policy cluster_load {
//		port_tag <tag key>
//		port     <port>
//		refresh  <duration>
//	}
//
// Every option is optional and may appear once; with neither port nor
// port_tag, upstreams are matched to members by IP alone.
func (p *ClusterLoadSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the policy's name
	if d.NextArg() {
		return d.Errf("lb_policy cluster_load: unexpected argument %q; options go in a block", d.Val())
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("lb_policy cluster_load: %s set twice", opt)
		}
		seen[opt] = true
		switch opt {
		case "port_tag":
			val, err := oneArg(d, "lb_policy cluster_load")
			if err != nil {
				return err
			}
			p.PortTag = val
		case "port":
			val, err := oneArg(d, "lb_policy cluster_load")
			if err != nil {
				return err
			}
			if _, err := cluster.ParsePort(val); err != nil {
				return d.Errf("lb_policy cluster_load: %v", err)
			}
			p.Port = val
		case "refresh":
			val, err := oneArg(d, "lb_policy cluster_load")
			if err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(val)
			if err != nil || dur <= 0 {
				return d.Errf("lb_policy cluster_load: refresh %q: want a positive duration such as 1s", val)
			}
			p.Refresh = caddy.Duration(dur)
			if err := p.Validate(); err != nil {
				return d.Err(err.Error())
			}
		default:
			return d.Errf("lb_policy cluster_load: unknown option %q; want port_tag, port or refresh", opt)
		}
	}
	return nil
}

// oneArg reads exactly one argument for the current option; errors start
// with prefix (the directive or option they are in).
func oneArg(d *caddyfile.Dispenser, prefix string) (string, error) {
	opt := d.Val()
	if !d.NextArg() {
		return "", d.Errf("%s: %s: missing value", prefix, opt)
	}
	val := d.Val()
	if d.NextArg() {
		return "", d.Errf("%s: %s: one value expected, got another: %q", prefix, opt, d.Val())
	}
	return val, nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*App)(nil)
	_ caddyfile.Unmarshaler = (*ListenerWrapper)(nil)
)
