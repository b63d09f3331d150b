package healthx

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// ParsePercent reads the argument of a Caddyfile percentage option (the
// current token): "50%", "50" or "off" (0). It must lie in [0, 100]. owner
// names the policy or block in error messages.
func ParsePercent(d *caddyfile.Dispenser, owner string) (float64, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	raw := d.Val()
	if raw == "off" {
		return 0, nil
	}
	v, err := strconv.ParseFloat(strings.TrimSuffix(raw, "%"), 64)
	if err != nil || CheckPercent(v) != nil {
		return 0, d.Errf("%s: invalid %s %q: want a percentage from 0%% to 100%%, or 'off'", owner, opt, raw)
	}
	return v, nil
}

// CheckPercent reports whether v is a percentage in [0, 100].
func CheckPercent(v float64) error {
	if v < 0 || v > 100 || v != v {
		return fmt.Errorf("must be between 0%% and 100%%, got %v%%", v)
	}
	return nil
}
