// Package caddyfile registers lbx's Caddyfile directives and global
// options, and holds the golden adapt tests for every lbx option.
//
// The selection policies (`lb_policy ewma`, `lb_policy panic`) need no
// registration here: reverse_proxy parses `lb_policy <name>` by loading the
// module http.reverse_proxy.selection_policies.<name>, whose
// UnmarshalCaddyfile lives with the module in lbpolicy. Importing lbpolicy
// here keeps this package's tests self-contained.
package caddyfile

import (
	_ "github.com/caddy-lbx/lbx/lbpolicy"
)
