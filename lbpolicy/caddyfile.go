package lbpolicy

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
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

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*EWMASelection)(nil)
	_ caddyfile.Unmarshaler = (*PanicSelection)(nil)
)
