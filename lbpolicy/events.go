package lbpolicy

// Events lbx emits through Caddy's events app, for other modules to
// subscribe to. Their data uses reverse_proxy's shape where it fits
// ("host": the dial address).
const (
	// eventUpstreamEjected: outlier detection ejected an upstream. Data:
	// host, reason, for_ms, ejections_in_a_row.
	eventUpstreamEjected = "upstream_ejected"
	// eventUpstreamRestored: an ejected upstream's time ran out; announced
	// with the first attempt made to it afterwards. Data: host.
	eventUpstreamRestored = "upstream_restored"
	// eventPanicEntered: a pool entered panic mode. Data: policy,
	// available, upstreams, threshold_percent.
	eventPanicEntered = "panic_entered"
	// eventPanicLeft: a pool left panic mode. Same data.
	eventPanicLeft = "panic_left"
)
