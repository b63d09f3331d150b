package lbpolicy

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/bounds"
)

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
