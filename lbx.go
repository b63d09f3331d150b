// Package lbx registers every lbx module with Caddy. Build Caddy with it:
//
//	xcaddy build --with github.com/caddy-lbx/lbx
//
// or import it for side effects in your own Caddy main.
package lbx

import (
	_ "github.com/caddy-lbx/lbx/cluster"
	_ "github.com/caddy-lbx/lbx/handoff"
	_ "github.com/caddy-lbx/lbx/lbpolicy"
	_ "github.com/caddy-lbx/lbx/partition"
	_ "github.com/caddy-lbx/lbx/rebalance"
	_ "github.com/caddy-lbx/lbx/selective"
	_ "github.com/caddy-lbx/lbx/status"
)
