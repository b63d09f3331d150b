// Command caddy is a drop-in Caddy with every standard module and every lbx
// module. It behaves as stock Caddy for any config that does not use lbx.
package main

import (
	// as in stock Caddy's main: time zones work on hosts without zoneinfo
	// (minimal containers)
	_ "time/tzdata"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-lbx/lbx"
)

func main() {
	caddycmd.Main()
}
