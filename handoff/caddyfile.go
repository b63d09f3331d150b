package handoff

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

// UnmarshalCaddyfile sets up the wrapper from Caddyfile tokens. It takes
// no arguments and no block:
//
//	lbx_handoff
func (w *Wrapper) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the wrapper's name
	return caddyopt.NoOptions(d, "lbx_handoff listener wrapper")
}

// Interface guards
var _ caddyfile.Unmarshaler = (*Wrapper)(nil)
