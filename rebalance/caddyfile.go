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
	if err := caddyopt.Block(d, what, func(opt string) error { return a.parseOption(d, what, opt) }); err != nil {
		return err
	}
	// The options against each other (the error points at the block's
	// end).
	return caddyopt.Checked(d, what, a.checkRelations())
}

// parseOption reads option opt, the dispenser on its name, and checks it
// with the check validate runs on the JSON.
func (a *App) parseOption(d *caddyfile.Dispenser, what, opt string) error {
	switch opt {
	case "metric":
		return word(d, what, &a.Metric, checkMetric)
	case "cpu":
		// That it goes with metric cpu is checkRelations'.
		return word(d, what, &a.CPU, checkCPU)
	case "interval":
		return positiveDuration(d, what, &a.Interval, checkInterval)
	case "history":
		return positiveDuration(d, what, &a.History, checkHistory)
	case "freshness":
		return positiveDuration(d, what, &a.Freshness, checkFreshness)
	case "idle_close_after":
		return positiveDuration(d, what, &a.IdleCloseAfter, checkIdleCloseAfter)
	case "threshold":
		return percent(d, what, &a.Threshold, checkThreshold)
	case "stop_band":
		return percent(d, what, &a.StopBand, checkStopBand)
	case "shed_rate":
		return percent(d, what, &a.ShedRate, checkShedRate)
	case "boundary_timeout":
		// 0 is allowed: never force.
		dur, err := caddyopt.Duration(d, what)
		if err != nil {
			return err
		}
		a.BoundaryTimeout = caddy.Duration(dur)
		return caddyopt.Checked(d, what, checkBoundaryTimeout(a.BoundaryTimeout))
	case "join_settle":
		val, err := caddyopt.OneArg(d, what)
		if err != nil {
			return err
		}
		if val == "off" {
			a.JoinSettle = -1
			return nil
		}
		dur, err := caddy.ParseDuration(val)
		if err != nil || dur <= 0 {
			return caddyopt.Invalid(d, what, opt, val, "a positive duration such as 5s, or off")
		}
		a.JoinSettle = caddy.Duration(dur)
		return caddyopt.Checked(d, what, checkJoinSettle(a.JoinSettle))
	case "min_connections":
		n, err := caddyopt.Int(d, what)
		if err != nil {
			return err
		}
		a.MinConnections = &n
		return caddyopt.Checked(d, what, checkMinConnections(n))
	}
	if clusterOption(opt) {
		return caddyopt.Errf(d, what, "%s is an option of the cluster global option now: cluster { %s … }", opt, opt)
	}
	return caddyopt.Unknown(d, what, appOptions...)
}

// word reads the one argument of the option the dispenser is on into
// field, and checks it.
func word(d *caddyfile.Dispenser, what string, field *string, check func(string) error) error {
	val, err := caddyopt.OneArg(d, what)
	if err != nil {
		return err
	}
	*field = val
	return caddyopt.Checked(d, what, check(val))
}

// positiveDuration reads the option the dispenser is on as a positive
// duration (0 would mean the default in JSON) into field, and checks it.
func positiveDuration(d *caddyfile.Dispenser, what string, field *caddy.Duration, check func(caddy.Duration) error) error {
	dur, err := caddyopt.PositiveDuration(d, what)
	if err != nil {
		return err
	}
	*field = caddy.Duration(dur)
	return caddyopt.Checked(d, what, check(*field))
}

// percent reads the option the dispenser is on as a percentage, with or
// without the % sign, into field, and checks it. 0 is refused: in JSON it
// would mean the default.
func percent(d *caddyfile.Dispenser, what string, field *float64, check func(float64) error) error {
	opt := d.Val()
	val, err := caddyopt.OneArg(d, what)
	if err != nil {
		return err
	}
	pct, err := strconv.ParseFloat(strings.TrimSuffix(val, "%"), 64)
	if err != nil || pct == 0 {
		return caddyopt.Invalid(d, what, opt, val, "a percentage above 0%")
	}
	*field = pct
	return caddyopt.Checked(d, what, check(pct))
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
	return caddyopt.Block(d, what, func(opt string) error {
		switch opt {
		case "port_tag":
			val, err := caddyopt.OneArg(d, what)
			p.PortTag = val
			return err
		case "port":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			if _, err := cluster.ParsePort(val); err != nil {
				return caddyopt.Errf(d, what, "%v", err)
			}
			p.Port = val
			return nil
		case "refresh":
			dur, err := caddyopt.PositiveDuration(d, what)
			if err != nil {
				return err
			}
			p.Refresh = caddy.Duration(dur)
			if err := p.Validate(); err != nil {
				return d.Err(err.Error())
			}
			return nil
		}
		return caddyopt.Unknown(d, what, "port_tag", "port", "refresh")
	})
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*App)(nil)
	_ caddyfile.Unmarshaler = (*ListenerWrapper)(nil)
)
