package lbpolicy

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

func init() {
	caddy.RegisterModule(new(EWMASelection))
}

// EWMASelection is the least_time policy under its earlier name, ewma,
// kept so that configs written with it work as they always did: the same
// options, the same choices, and ewma as the policy's name in logs,
// events, errors, metrics and admin views. New configs should use
// least_time: the estimate is a median, not an exponentially weighted
// moving average, which the name promised.
type EWMASelection struct {
	LeastTimeSelection
}

// CaddyModule returns the Caddy module information.
func (*EWMASelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies." + ewmaName,
		New: func() caddy.Module { return newEWMA() },
	}
}

// newEWMA returns the policy named ewma. The name is set here rather than
// in Provision because the Caddyfile and JSON decoding, which start from
// New, name the policy in their errors.
func newEWMA() *EWMASelection {
	return &EWMASelection{LeastTimeSelection{name: ewmaName}}
}

// Interface guards
var (
	_ reverseproxy.Selector = (*EWMASelection)(nil)
	_ caddyfile.Unmarshaler = (*EWMASelection)(nil)
	_ caddy.Provisioner     = (*EWMASelection)(nil)
	_ caddy.Validator       = (*EWMASelection)(nil)
	_ caddy.CleanerUpper    = (*EWMASelection)(nil)
	_ caddy.Module          = (*EWMASelection)(nil)
	_ leastTimer            = (*EWMASelection)(nil)
)
