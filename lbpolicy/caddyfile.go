package lbpolicy

import (
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

// UnmarshalCaddyfile sets up the least_time policy (or ewma, its earlier
// name) from Caddyfile tokens. Syntax:
//
//	lb_policy least_time {
//		choices         <n>|all|auto
//		decay           <duration>
//		weights         <w1> <w2> ...
//		panic_threshold <percent>|off
//		retry_budget [<percent>] [{
//			min_concurrent <n>
//		}]
//		load_reports {
//			max_age        <duration>
//			forward_header
//			probe <path> [{
//				per_request <ratio>
//				max_rate    <n>[/s]
//				timeout     <duration>
//			}]
//		}
//		slow_start <window> [{
//			min_weight <percent>
//			aggression <number>
//		}]
//		outlier {
//			consecutive_failures            <n>
//			failure_status                  <code...>
//			base_ejection_time              <duration>
//			max_ejection_time               <duration>
//			max_ejection_percent            <percent>
//			interval                        <duration>
//			success_rate                    on|off
//			success_rate_min_hosts          <n>
//			success_rate_min_requests       <n>
//			success_rate_stdev_factor       <factor>
//			failure_percentage_threshold    <percent>|off
//			failure_percentage_min_hosts    <n>
//			failure_percentage_min_requests <n>
//			health_check_restore            on|off
//		}
//	}
func (s *LeastTimeSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the policy's name
	// errors name the policy as written: least_time, or ewma
	what := "lb_policy " + d.Val()
	return caddyopt.Options(d, what, func(opt string) error {
		switch opt {
		case "choices":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			c, err := parseChoices(val)
			if err != nil {
				return caddyopt.Errf(d, what, "choices %q: %v", val, err)
			}
			s.Choices = c
		case "decay":
			dur, err := caddyopt.Duration(d, what)
			if err != nil {
				return err
			}
			if err := checkDecay(dur); err != nil {
				return caddyopt.Errf(d, what, "%v", err)
			}
			s.Decay = caddy.Duration(dur)
		case "weights":
			w, err := parseWeights(d, what)
			if err != nil {
				return err
			}
			s.Weights = w
		case "panic_threshold":
			p, err := parsePercent(d, what)
			if err != nil {
				return err
			}
			s.PanicThreshold = &p
		case "outlier", "slow_start":
			return readTrafficHealth(d, what, opt, &s.Outlier, &s.SlowStart)
		case "retry_budget":
			s.RetryBudget = new(RetryBudget)
			if err := s.RetryBudget.unmarshalCaddyfile(d, what); err != nil {
				return err
			}
		case "load_reports":
			s.LoadReports = new(LoadReports)
			if err := s.LoadReports.unmarshalCaddyfile(d, what); err != nil {
				return err
			}
		default:
			return caddyopt.Unknown(d, what, "choices", "decay", "weights", "panic_threshold", "retry_budget", "slow_start", "outlier", "load_reports")
		}
		return nil
	})
}

// UnmarshalCaddyfile sets up the consistent_hash policy from Caddyfile
// tokens. Syntax:
//
//	lb_policy consistent_hash [<key>] {
//		balance_factor  <factor>
//		weights         <w1> <w2> ...
//		panic_threshold <percent>|off
//		outlier { <as in least_time> }
//		slow_start <window> [{
//			min_weight <percent>
//			aggression <number>
//		}]
//	}
func (s *ConsistentHashSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the policy's name
	const what = "lb_policy consistent_hash"
	if d.NextArg() {
		s.Key = d.Val()
	}
	return caddyopt.Options(d, what, func(opt string) error {
		switch opt {
		case "balance_factor":
			c, err := parseFloat(d, what)
			if err != nil {
				return err
			}
			if err := checkBalanceFactor(c); err != nil {
				return caddyopt.Errf(d, what, "%v", err)
			}
			s.BalanceFactor = c
		case "weights":
			w, err := parseWeights(d, what)
			if err != nil {
				return err
			}
			s.Weights = w
		case "panic_threshold":
			p, err := parsePercent(d, what)
			if err != nil {
				return err
			}
			s.PanicThreshold = &p
		case "outlier", "slow_start":
			return readTrafficHealth(d, what, opt, &s.Outlier, &s.SlowStart)
		default:
			return caddyopt.Unknown(d, what, "balance_factor", "weights", "panic_threshold", "outlier", "slow_start")
		}
		return nil
	})
}

// UnmarshalCaddyfile sets up the panic wrapper from Caddyfile tokens.
// Syntax:
//
//	lb_policy panic {
//		threshold <percent>|off
//		outlier { <as in least_time> }
//		load_reports { <as in least_time> }
//		slow_start <window> [{
//			min_weight <percent>
//			aggression <number>
//		}]
//		policy    <name> [<args...>] [{
//			<policy options>
//		}]
//	}
func (p *PanicSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const what = "lb_policy panic"
	err := caddyopt.Block(d, what, func(opt string) error {
		switch opt {
		case "threshold":
			v, err := parsePercent(d, what)
			if err != nil {
				return err
			}
			p.Threshold = &v
		case "outlier", "slow_start":
			if err := readTrafficHealth(d, what, opt, &p.Outlier, &p.SlowStart); err != nil {
				return err
			}
		case "load_reports":
			p.LoadReports = new(LoadReports)
			if err := p.LoadReports.unmarshalCaddyfile(d, what); err != nil {
				return err
			}
		case "policy":
			// The policy's own unmarshaler reads the rest of the line.
			if !d.NextArg() {
				return caddyopt.Missing(d, what)
			}
			name := d.Val()
			if name == "panic" {
				return caddyopt.Errf(d, what, "cannot wrap the panic policy in itself")
			}
			modID := "http.reverse_proxy.selection_policies." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			sel, ok := unm.(reverseproxy.Selector)
			if !ok {
				return caddyopt.Errf(d, what, "module %s (%T) is not a selection policy", modID, unm)
			}
			p.PolicyRaw = caddyconfig.JSONModuleObject(sel, "policy", name, nil)
			p.inner = sel // for the checks below; Provision loads it again
		default:
			return caddyopt.Unknown(d, what, "threshold", "outlier", "load_reports", "slow_start", "policy")
		}
		if err := p.misplaced(false); err != nil {
			return d.Err(err.Error())
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := p.misplaced(true); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// unmarshalCaddyfile reads an outlier block, the dispenser on its name;
// errors start with what (the block's path, "lb_policy least_time: outlier"):
//
//	outlier {
//		consecutive_failures            <n>
//		failure_status                  <code...>
//		base_ejection_time              <duration>
//		max_ejection_time               <duration>
//		max_ejection_percent            <percent>
//		interval                        <duration>
//		success_rate                    on|off
//		success_rate_min_hosts          <n>
//		success_rate_min_requests       <n>
//		success_rate_stdev_factor       <factor>
//		failure_percentage_threshold    <percent>|off
//		failure_percentage_min_hosts    <n>
//		failure_percentage_min_requests <n>
//		health_check_restore            on|off
//	}
func (o *Outlier) unmarshalCaddyfile(d *caddyfile.Dispenser, what string) error {
	counts := map[string]*int{
		"consecutive_failures":            &o.Consecutive,
		"success_rate_min_hosts":          &o.SuccessRateMinHosts,
		"success_rate_min_requests":       &o.SuccessRateMinRequests,
		"failure_percentage_min_hosts":    &o.FailurePercentageMinHosts,
		"failure_percentage_min_requests": &o.FailurePercentageMinRequests,
	}
	durations := map[string]*caddy.Duration{
		"base_ejection_time": &o.BaseEjectionTime,
		"max_ejection_time":  &o.MaxEjectionTime,
		"interval":           &o.Interval,
	}
	return caddyopt.Options(d, what, func(opt string) error {
		switch opt {
		case "consecutive_failures", "success_rate_min_hosts", "success_rate_min_requests",
			"failure_percentage_min_hosts", "failure_percentage_min_requests":
			n, err := caddyopt.Int(d, what)
			if err != nil {
				return err
			}
			*counts[opt] = n
		case "failure_status":
			args, err := caddyopt.Args(d, what)
			if err != nil {
				return err
			}
			o.FailureStatus = []int{}
			for _, a := range args {
				c, err := strconv.Atoi(a)
				if err != nil {
					return caddyopt.Invalid(d, what, opt, a, "HTTP status codes")
				}
				o.FailureStatus = append(o.FailureStatus, c)
			}
		case "base_ejection_time", "max_ejection_time", "interval":
			dur, err := caddyopt.Duration(d, what)
			if err != nil {
				return err
			}
			*durations[opt] = caddy.Duration(dur)
		case "success_rate", "health_check_restore":
			on, err := parseOnOff(d, what)
			if err != nil {
				return err
			}
			if opt == "success_rate" {
				o.DisableSuccessRate = !on
			} else {
				o.KeepEjectedOnHealthCheck = !on
			}
		case "success_rate_stdev_factor":
			f, err := parseFloat(d, what)
			if err != nil {
				return err
			}
			o.SuccessRateStdevFactor = f
		case "failure_percentage_threshold":
			p, err := parsePercent(d, what)
			if err != nil {
				return err
			}
			if d.Val() == "off" {
				o.FailurePercentageThreshold = nil
			} else {
				o.FailurePercentageThreshold = &p
			}
		case "max_ejection_percent":
			p, err := parsePercent(d, what)
			if err != nil {
				return err
			}
			o.MaxEjectionPercent = &p
		default:
			return caddyopt.Unknown(d, what, slices.Concat(outlierOptions, []string{"success_rate", "health_check_restore"})...)
		}
		if err := o.check(opt); err != nil {
			return caddyopt.Errf(d, what, "%v", err)
		}
		return nil
	})
}

// unmarshalCaddyfile reads a slow_start option, the dispenser on its name;
// errors start with what (the policy's block, "lb_policy least_time"):
//
//	slow_start <window> [{
//		min_weight <percent>
//		aggression <number>
//	}]
func (s *SlowStart) unmarshalCaddyfile(d *caddyfile.Dispenser, what string) error {
	raw, err := caddyopt.Arg(d, what)
	if err != nil {
		return err
	}
	w, err := caddyopt.DurationValue(d, what, "slow_start", raw)
	if err != nil {
		return err
	}
	what += ": slow_start"
	s.Window = caddy.Duration(w)
	if err := s.check("window"); err != nil {
		return caddyopt.Errf(d, what, "%v", err)
	}
	once := caddyopt.NewOnce(what)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if err := once.Check(d); err != nil {
			return err
		}
		switch opt {
		case "min_weight":
			p, err := parsePercent(d, what)
			if err != nil {
				return err
			}
			s.MinWeightPercent = &p
		case "aggression":
			a, err := parseFloat(d, what)
			if err != nil {
				return err
			}
			s.Aggression = a
		default:
			return caddyopt.Unknown(d, what, "min_weight", "aggression")
		}
		if err := s.check(opt); err != nil {
			return caddyopt.Errf(d, what, "%v", err)
		}
	}
	return nil
}

// unmarshalCaddyfile reads a retry_budget option, the dispenser on its
// name; errors start with what (the policy's block, "lb_policy least_time"):
//
//	retry_budget [<percent>] [{
//		min_concurrent <n>
//	}]
func (b *RetryBudget) unmarshalCaddyfile(d *caddyfile.Dispenser, what string) error {
	if d.NextArg() {
		d.Prev()
		raw, err := caddyopt.Arg(d, what)
		if err != nil {
			return err
		}
		p, err := percentValue(d, what, "retry_budget", raw)
		if err != nil {
			return err
		}
		b.Percent = &p
	}
	what += ": retry_budget"
	once := caddyopt.NewOnce(what)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := once.Check(d); err != nil {
			return err
		}
		if d.Val() != "min_concurrent" {
			return caddyopt.Unknown(d, what, "min_concurrent")
		}
		n, err := caddyopt.Int(d, what)
		if err != nil {
			return err
		}
		b.MinConcurrent = &n
		if err := b.checkFloor(); err != nil {
			return caddyopt.Errf(d, what, "%v", err)
		}
	}
	return nil
}

// parsePercent reads the one argument of a percentage option, the
// dispenser on its name (see percentValue).
func parsePercent(d *caddyfile.Dispenser, what string) (float64, error) {
	opt := d.Val()
	raw, err := caddyopt.OneArg(d, what)
	if err != nil {
		return 0, err
	}
	return percentValue(d, what, opt, raw)
}

// percentValue parses raw, the value of percentage option opt: "50%",
// "50" or "off" (0). It must lie in [0, 100].
func percentValue(d *caddyfile.Dispenser, what, opt, raw string) (float64, error) {
	if raw == "off" {
		return 0, nil
	}
	v, err := strconv.ParseFloat(strings.TrimSuffix(raw, "%"), 64)
	if err != nil || bounds.Percent(opt, v) != nil {
		return 0, caddyopt.Invalid(d, what, opt, raw, "a percentage from 0% to 100%, or 'off'")
	}
	return v, nil
}

// parseWeights reads the one or more weights of a weights option, the
// dispenser on its name.
func parseWeights(d *caddyfile.Dispenser, what string) ([]int, error) {
	args, err := caddyopt.Args(d, what)
	if err != nil {
		return nil, err
	}
	weights := make([]int, 0, len(args))
	for _, a := range args {
		w, err := strconv.Atoi(a)
		if err != nil {
			return nil, caddyopt.Invalid(d, what, "weight", a, "a whole number of at least 1")
		}
		if err := checkWeight(w); err != nil {
			return nil, caddyopt.Errf(d, what, "%v", err)
		}
		weights = append(weights, w)
	}
	return weights, nil
}

// parseOnOff reads the one argument of an on/off option, the dispenser on
// its name.
func parseOnOff(d *caddyfile.Dispenser, what string) (bool, error) {
	opt := d.Val()
	raw, err := caddyopt.OneArg(d, what)
	if err != nil {
		return false, err
	}
	switch raw {
	case "on":
		return true, nil
	case "off":
		return false, nil
	}
	return false, caddyopt.Invalid(d, what, opt, raw, "'on' or 'off'")
}

// parseFloat reads the one argument of a number option, the dispenser on
// its name; its range is the caller's to check.
func parseFloat(d *caddyfile.Dispenser, what string) (float64, error) {
	opt := d.Val()
	raw, err := caddyopt.OneArg(d, what)
	if err != nil {
		return 0, err
	}
	f, err := strconv.ParseFloat(raw, 64)
	if err != nil {
		return 0, caddyopt.Invalid(d, what, opt, raw, "a number")
	}
	return f, nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*LeastTimeSelection)(nil)
	_ caddyfile.Unmarshaler = (*PanicSelection)(nil)
	_ caddyfile.Unmarshaler = (*ConsistentHashSelection)(nil)
)

// readTrafficHealth reads opt, outlier or slow_start: the health from live
// traffic that least_time, consistent_hash and panic take alike, each into
// its own fields.
func readTrafficHealth(d *caddyfile.Dispenser, what, opt string, outlier **Outlier, slowStart **SlowStart) error {
	if opt == "outlier" {
		*outlier = new(Outlier)
		return (*outlier).unmarshalCaddyfile(d, what+": outlier")
	}
	*slowStart = new(SlowStart)
	return (*slowStart).unmarshalCaddyfile(d, what)
}
