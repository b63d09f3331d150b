// Command caddy is a drop-in Caddy with every standard module and every lbx
// module. It behaves as stock Caddy for any config that does not use lbx.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-lbx/lbx"
)

func main() {
	caddycmd.Main()
}
