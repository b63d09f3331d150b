package cluster

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("cluster", caddyopt.GlobalApp[App]("cluster"))
}

// UnmarshalCaddyfile sets up the app from the `cluster` global option.
// Syntax:
//
//	cluster {
//		node_name   <name>
//		bind        <host:port>
//		advertise   <host:port>
//		join        <host:port>...
//		encrypt_key <base64 key>...
//		tags {
//			<key> <value>
//		}
//		insecure_plaintext_gossip
//		ops_key     <base64 key>
//	}
//
// encrypt_key takes one key (JSON encrypt_key) or several, primary
// first (JSON encrypt_keys).
//
// Every option is optional and may appear once. Each value is checked
// against the bounds of its JSON field as it is read, so errors name
// their line.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const what = "cluster"
	return caddyopt.Block(d, what, func(opt string) error {
		switch opt {
		case "node_name":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			a.NodeName = val
			return caddyopt.Checked(d, what, checkNodeName(val))
		case "bind", "advertise":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			if opt == "bind" {
				a.Bind = val
			} else {
				a.Advertise = val
			}
			return caddyopt.Checked(d, what, checkAddr(opt, val))
		case "encrypt_key":
			keys, err := caddyopt.Args(d, what)
			if err != nil {
				return err
			}
			a.EncryptKey, a.EncryptKeys = "", nil
			if len(keys) == 1 {
				a.EncryptKey = keys[0]
			} else {
				a.EncryptKeys = keys
			}
			return caddyopt.Checked(d, what, a.checkKeys())
		case "insecure_plaintext_gossip":
			// What it allows is checked against bind in Provision, where
			// the default bind is known.
			a.InsecurePlaintextGossip = true
			return caddyopt.NoArgs(d, what)
		case "join":
			join, err := caddyopt.Args(d, what)
			if err != nil {
				return err
			}
			a.Join = join
			return caddyopt.Checked(d, what, checkJoin(join))
		case "ops_key":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			a.OpsKey = val
			return caddyopt.Checked(d, what, a.checkOpsKey())
		case "tags":
			if err := a.parseTags(d, what+": tags"); err != nil {
				return err
			}
			return caddyopt.Checked(d, what, a.checkTags())
		}
		return caddyopt.Unknown(d, what, "node_name", "bind", "advertise", "join", "encrypt_key", "tags", "insecure_plaintext_gossip", "ops_key")
	})
}

// parseTags reads the tags block: one `<key> <value>` a line, each key
// once.
func (a *App) parseTags(d *caddyfile.Dispenser, what string) error {
	if err := caddyopt.BlockOnly(d, what); err != nil {
		return err
	}
	a.Tags = make(map[string]string)
	keys := caddyopt.NewOnce(what)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		key := d.Val()
		if err := keys.Check(d); err != nil {
			return err
		}
		val, err := caddyopt.OneArg(d, what)
		if err != nil {
			return err
		}
		a.Tags[key] = val
	}
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*App)(nil)
