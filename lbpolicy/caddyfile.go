package lbpolicy

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/bounds"
)

// UnmarshalCaddyfile sets up the ewma policy from Caddyfile tokens. Syntax:
//
//	lb_policy ewma {
//		choices         <n>|all|auto
//		decay           <duration>
//		weights         <w1> <w2> ...
//		panic_threshold <percent>|off
//		retry_budget [<percent>] [{
//			min_concurrent <n>
//		}]
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
func (s *EWMASelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume policy name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("ewma: %s specified more than once", opt)
		}
		seen[opt] = true
		switch opt {
		case "choices":
			if !d.NextArg() {
				return d.ArgErr()
			}
			c, err := parseChoices(d.Val())
			if err != nil {
				return d.Errf("ewma: invalid choices %q: %v", d.Val(), err)
			}
			s.Choices = c
		case "decay":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil {
				return d.Errf("ewma: invalid decay duration %q: %v", d.Val(), err)
			}
			if err := checkDecay(dur); err != nil {
				return d.Errf("ewma: %v", err)
			}
			s.Decay = caddy.Duration(dur)
		case "weights":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			for _, a := range args {
				w, err := strconv.Atoi(a)
				if err != nil {
					return d.Errf("ewma: invalid weight %q: weights are whole numbers of at least 1", a)
				}
				if err := checkWeight(w); err != nil {
					return d.Errf("ewma: %v", err)
				}
				s.Weights = append(s.Weights, w)
			}
		case "panic_threshold":
			p, err := parsePercent(d, "ewma")
			if err != nil {
				return err
			}
			s.PanicThreshold = &p
		case "outlier":
			s.Outlier = new(Outlier)
			if err := s.Outlier.unmarshalCaddyfile(d); err != nil {
				return err
			}
		case "slow_start":
			s.SlowStart = new(SlowStart)
			if err := s.SlowStart.unmarshalCaddyfile(d); err != nil {
				return err
			}
		case "retry_budget":
			s.RetryBudget = new(RetryBudget)
			if err := s.RetryBudget.unmarshalCaddyfile(d); err != nil {
				return err
			}
		default:
			return d.Errf("ewma: unrecognized option %q", opt)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the panic wrapper from Caddyfile tokens.
// Syntax:
//
//	lb_policy panic {
//		threshold <percent>|off
//		outlier { <as in ewma> }
//		policy    <name> [<args...>] [{
//			<policy options>
//		}]
//	}
func (p *PanicSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume policy name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "threshold":
			if p.Threshold != nil {
				return d.Err("panic: threshold specified more than once")
			}
			v, err := parsePercent(d, "panic")
			if err != nil {
				return err
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			p.Threshold = &v
		case "outlier":
			if p.Outlier != nil {
				return d.Err("panic: outlier specified more than once")
			}
			p.Outlier = new(Outlier)
			if err := p.Outlier.unmarshalCaddyfile(d); err != nil {
				return err
			}
		case "policy":
			if p.PolicyRaw != nil {
				return d.Err("panic: policy specified more than once")
			}
			if !d.NextArg() {
				return d.ArgErr()
			}
			name := d.Val()
			if name == "panic" {
				return d.Err("panic: cannot wrap the panic policy in itself")
			}
			modID := "http.reverse_proxy.selection_policies." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			sel, ok := unm.(reverseproxy.Selector)
			if !ok {
				return d.Errf("panic: module %s (%T) is not a selection policy", modID, unm)
			}
			p.PolicyRaw = caddyconfig.JSONModuleObject(sel, "policy", name, nil)
			p.inner = sel // for the checks below; Provision loads it again
		default:
			return d.Errf("panic: unrecognized option %q", d.Val())
		}
		if _, ewma := p.inner.(*EWMASelection); ewma && p.Outlier != nil {
			return d.Err(errOutlierAroundEWMA.Error())
		}
	}
	return nil
}

// unmarshalCaddyfile reads an outlier block, the dispenser on its name:
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
func (o *Outlier) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
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
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("outlier: %s specified more than once", opt)
		}
		seen[opt] = true
		switch opt {
		case "consecutive_failures", "success_rate_min_hosts", "success_rate_min_requests",
			"failure_percentage_min_hosts", "failure_percentage_min_requests":
			if !d.NextArg() {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(d.Val())
			if err != nil {
				return d.Errf("outlier: invalid %s %q: want a whole number", opt, d.Val())
			}
			*counts[opt] = n
		case "failure_status":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			o.FailureStatus = []int{}
			for _, a := range args {
				c, err := strconv.Atoi(a)
				if err != nil {
					return d.Errf("outlier: invalid failure_status %q: want HTTP status codes", a)
				}
				o.FailureStatus = append(o.FailureStatus, c)
			}
		case "base_ejection_time", "max_ejection_time", "interval":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil {
				return d.Errf("outlier: invalid %s %q: want a duration", opt, d.Val())
			}
			*durations[opt] = caddy.Duration(dur)
		case "success_rate", "health_check_restore":
			on, err := parseOnOff(d)
			if err != nil {
				return err
			}
			if opt == "success_rate" {
				o.DisableSuccessRate = !on
			} else {
				o.KeepEjectedOnHealthCheck = !on
			}
		case "success_rate_stdev_factor":
			if !d.NextArg() {
				return d.ArgErr()
			}
			f, err := strconv.ParseFloat(d.Val(), 64)
			if err != nil {
				return d.Errf("outlier: invalid success_rate_stdev_factor %q: want a positive number", d.Val())
			}
			o.SuccessRateStdevFactor = f
		case "failure_percentage_threshold":
			p, err := parsePercent(d, "outlier")
			if err != nil {
				return err
			}
			if d.Val() == "off" {
				o.FailurePercentageThreshold = nil
			} else {
				o.FailurePercentageThreshold = &p
			}
		case "max_ejection_percent":
			p, err := parsePercent(d, "outlier")
			if err != nil {
				return err
			}
			o.MaxEjectionPercent = &p
		default:
			return d.Errf("outlier: unrecognized option %q", opt)
		}
		if err := o.check(opt); err != nil {
			return d.Errf("outlier: %v", err)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

// parseOnOff reads the argument of an on/off option, the dispenser on the
// option's name.
func parseOnOff(d *caddyfile.Dispenser) (bool, error) {
	opt := d.Val()
	if !d.NextArg() {
		return false, d.ArgErr()
	}
	switch d.Val() {
	case "on":
		return true, nil
	case "off":
		return false, nil
	}
	return false, d.Errf("outlier: invalid %s %q: want 'on' or 'off'", opt, d.Val())
}

// unmarshalCaddyfile reads a slow_start option, the dispenser on its name:
//
//	slow_start <window> [{
//		min_weight <percent>
//		aggression <number>
//	}]
func (s *SlowStart) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	w, err := caddy.ParseDuration(d.Val())
	if err != nil {
		return d.Errf("slow_start: invalid window %q: want a positive duration", d.Val())
	}
	s.Window = caddy.Duration(w)
	if err := s.check("window"); err != nil {
		return d.Errf("slow_start: %v", err)
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("slow_start: %s specified more than once", opt)
		}
		seen[opt] = true
		switch opt {
		case "min_weight":
			p, err := parsePercent(d, "slow_start")
			if err != nil {
				return err
			}
			s.MinWeightPercent = &p
		case "aggression":
			if !d.NextArg() {
				return d.ArgErr()
			}
			a, err := strconv.ParseFloat(d.Val(), 64)
			if err != nil {
				return d.Errf("slow_start: invalid aggression %q: want a positive number", d.Val())
			}
			s.Aggression = a
		default:
			return d.Errf("slow_start: unrecognized option %q", opt)
		}
		if err := s.check(opt); err != nil {
			return d.Errf("slow_start: %v", err)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

// unmarshalCaddyfile reads a retry_budget option, the dispenser on its
// name:
//
//	retry_budget [<percent>] [{
//		min_concurrent <n>
//	}]
func (b *RetryBudget) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		d.Prev()
		p, err := parsePercent(d, "retry_budget")
		if err != nil {
			return err
		}
		b.Percent = &p
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	seen := false
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() != "min_concurrent" {
			return d.Errf("retry_budget: unrecognized option %q", d.Val())
		}
		if seen {
			return d.Err("retry_budget: min_concurrent specified more than once")
		}
		seen = true
		if !d.NextArg() {
			return d.ArgErr()
		}
		n, err := strconv.Atoi(d.Val())
		if err != nil {
			return d.Errf("retry_budget: invalid min_concurrent %q: want a whole number, 0 or more", d.Val())
		}
		b.MinConcurrent = &n
		if err := b.checkFloor(); err != nil {
			return d.Errf("retry_budget: %v", err)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

// parsePercent reads the argument of a Caddyfile percentage option (the
// current token): "50%", "50" or "off" (0). It must lie in [0, 100]. owner
// names the policy or block in error messages.
func parsePercent(d *caddyfile.Dispenser, owner string) (float64, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	raw := d.Val()
	if raw == "off" {
		return 0, nil
	}
	v, err := strconv.ParseFloat(strings.TrimSuffix(raw, "%"), 64)
	if err != nil || bounds.Percent(opt, v) != nil {
		return 0, d.Errf("%s: invalid %s %q: want a percentage from 0%% to 100%%, or 'off'", owner, opt, raw)
	}
	return v, nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*EWMASelection)(nil)
	_ caddyfile.Unmarshaler = (*PanicSelection)(nil)
)
