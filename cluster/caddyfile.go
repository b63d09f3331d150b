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
	d.Next() // the option's name
	if err := caddyopt.BlockOnly(d, what); err != nil {
		return err
	}
	once := caddyopt.NewOnce(what)
	for d.NextBlock(0) {
		opt := d.Val()
		if err := once.Check(d); err != nil {
			return err
		}
		switch opt {
		case "node_name", "bind", "advertise":
			val, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			switch opt {
			case "node_name":
				a.NodeName = val
			case "bind":
				a.Bind = val
			case "advertise":
				a.Advertise = val
			}
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
		case "insecure_plaintext_gossip":
			if err := caddyopt.NoArgs(d, what); err != nil {
				return err
			}
			a.InsecurePlaintextGossip = true
		case "join":
			join, err := caddyopt.Args(d, what)
			if err != nil {
				return err
			}
			a.Join = join
		case "tags":
			const inTags = what + ": tags"
			if err := caddyopt.BlockOnly(d, inTags); err != nil {
				return err
			}
			a.Tags = make(map[string]string)
			keys := caddyopt.NewOnce(inTags)
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				key := d.Val()
				if err := keys.Check(d); err != nil {
					return err
				}
				val, err := caddyopt.OneArg(d, inTags)
				if err != nil {
					return err
				}
				a.Tags[key] = val
			}
		default:
			return caddyopt.Unknown(d, what, "node_name", "bind", "advertise", "join", "encrypt_key", "tags", "insecure_plaintext_gossip")
		}
		if err := a.checkOption(opt); err != nil {
			return caddyopt.Errf(d, what, "%v", err)
		}
	}
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*App)(nil)
