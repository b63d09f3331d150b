package rebalance

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("rebalance", caddyopt.GlobalApp[App]("rebalance"))
}

// UnmarshalCaddyfile sets up the app from the `rebalance` global option.
// Syntax:
//
//	rebalance {
//		metric          connections|throughput|cpu
//		cpu             node|process
//		interval        <duration>
//		history         <duration>
//		freshness       <duration>
//		threshold       <percent>
//		stop_band       <percent>
//		shed_rate       <percent>
//		min_connections <n>
//		boundary_timeout <duration>
//		join_settle     <duration>|off
//		idle_close_after <duration>
//	}
//
// Every option is optional and may appear once; percentages may be
// written with or without the % sign (20% or 20). cpu goes with metric
// cpu only. boundary_timeout may be 0 (the default: never forced);
// join_settle off turns that wait off.
// Each value is checked against the bounds of its JSON field as it is
// read, so errors name their line.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const what = "rebalance"
	d.Next() // the option's name
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
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			a.Metric = val
		case "cpu":
			// Its values are checkOption's, and that it goes with metric
			// cpu checkRelations'.
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			a.CPU = val
		case "interval", "history", "freshness", "idle_close_after":
			dur, err := caddyopt.PositiveDuration(d, what)
			if err != nil {
				return err
			}
			switch opt {
			case "interval":
				a.Interval = caddy.Duration(dur)
			case "history":
				a.History = caddy.Duration(dur)
			case "freshness":
				a.Freshness = caddy.Duration(dur)
			case "idle_close_after":
				a.IdleCloseAfter = caddy.Duration(dur)
			}
		case "threshold", "stop_band", "shed_rate":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			// 0 would mean the default; the bounds are checkOption's.
			pct, err := strconv.ParseFloat(strings.TrimSuffix(val, "%"), 64)
			if err != nil || pct == 0 {
				return caddyopt.Invalid(d, what, opt, val, "a percentage above 0%")
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
			// 0 is allowed (never force); the bounds are checkOption's.
			dur, err := caddyopt.Duration(d, what)
			if err != nil {
				return err
			}
			a.BoundaryTimeout = caddy.Duration(dur)
		case "join_settle":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			if val == "off" {
				a.JoinSettle = -1
				break
			}
			dur, err := caddy.ParseDuration(val)
			if err != nil || dur <= 0 {
				return caddyopt.Invalid(d, what, opt, val, "a positive duration such as 5s, or off")
			}
			a.JoinSettle = caddy.Duration(dur)
		case "min_connections":
			n, err := caddyopt.Int(d, what)
			if err != nil {
				return err
			}
			a.MinConnections = &n
		default:
			if clusterOption(opt) {
				return caddyopt.Errf(d, what, "%s is an option of the cluster global option now: cluster { %s … }", opt, opt)
			}
			return caddyopt.Unknown(d, what, appOptions...)
		}
		if err := a.checkOption(opt); err != nil {
			return caddyopt.Errf(d, what, "%v", err)
		}
	}
	// The options against each other (the error points at the block's
	// end).
	a.resolve()
	if err := a.checkRelations(); err != nil {
		return caddyopt.Errf(d, what, "%v", err)
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
// argument and no block, and checks that it has none (see
// caddyopt.NoOptions).
func noOptions(d *caddyfile.Dispenser, what string) error {
	d.Next() // the name
	return caddyopt.NoOptions(d, what)
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
	const what = "lb_policy cluster_load"
	d.Next() // the policy's name
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
		case "port_tag":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			p.PortTag = val
		case "port":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			if _, err := cluster.ParsePort(val); err != nil {
				return caddyopt.Errf(d, what, "%v", err)
			}
			p.Port = val
		case "refresh":
			dur, err := caddyopt.PositiveDuration(d, what)
			if err != nil {
				return err
			}
			p.Refresh = caddy.Duration(dur)
			if err := p.Validate(); err != nil {
				return d.Err(err.Error())
			}
		default:
			return caddyopt.Unknown(d, what, "port_tag", "port", "refresh")
		}
	}
	return nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*App)(nil)
	_ caddyfile.Unmarshaler = (*ListenerWrapper)(nil)
)
