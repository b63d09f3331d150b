// Package metricsreg adds lbx's collectors to the metrics registry of a
// Caddy config, the one Caddy's /metrics endpoints serve.
package metricsreg

import (
	"errors"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// Register adds c to the config's registry. Every module that reads a
// collector registers it in its Provision, so the same collector is
// registered again by other modules and by every reload: that is not an
// error.
func Register(ctx caddy.Context, c prometheus.Collector) error {
	err := ctx.GetMetricsRegistry().Register(c)
	var are prometheus.AlreadyRegisteredError
	if err != nil && !errors.As(err, &are) {
		return err
	}
	return nil
}
