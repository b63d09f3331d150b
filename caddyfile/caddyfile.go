// Package caddyfile gathers lbx's Caddyfile syntax and holds the golden
// adapt tests for lbx's options.
//
// The selection policies (`lb_policy ewma`, `lb_policy panic`,
// `lb_policy cluster_load`) need no registration: reverse_proxy parses
// `lb_policy <name>` by loading the module
// http.reverse_proxy.selection_policies.<name>, whose UnmarshalCaddyfile
// lives with the module (in lbpolicy; cluster_load in rebalance). The `partition`
// directive and the `rebalance` global option are registered by their own
// packages rather than here: those packages' end-to-end tests adapt
// Caddyfiles, and could not import this package without an import cycle.
// Importing every lbx package here keeps this package's tests
// self-contained.
package caddyfile

import (
	_ "github.com/caddy-lbx/lbx/lbpolicy"
	_ "github.com/caddy-lbx/lbx/partition"
	_ "github.com/caddy-lbx/lbx/rebalance"
)
