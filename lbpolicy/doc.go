// Package lbpolicy provides reverse_proxy selection policies: `least_time`
// (earlier named `ewma`, still accepted), which picks the upstream with the
// lowest expected latency — (in-flight + 1) × expected latency / weight,
// see LeastTimeSelection — and `panic`, which gives
// any selection policy Envoy-style panic mode: when too few upstreams are
// healthy, the health checks are the likelier culprits, so all upstreams
// are used.
//
// What the policies select on is observed here too: a policy wraps its
// reverse_proxy handler's transport so that every attempt feeds the shared
// per-upstream state (internal/hoststate), and adds what it is configured
// with — outlier ejection, slow start, a retry budget. The package also
// shows that state on Caddy's admin API (GET /lbx/upstreams), as Prometheus
// metrics and as Caddy events.
package lbpolicy
