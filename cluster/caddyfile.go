package cluster

import (
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("cluster", parseGlobalOption)
}

// parseGlobalOption turns the `cluster` global option into the cluster
// app.
func parseGlobalOption(d *caddyfile.Dispenser, existing any) (any, error) {
	if existing != nil {
		d.Next() // the option's name, so that the error has its line
		return nil, d.Err("cluster: the global option is already set; use one cluster block")
	}
	app := new(App)
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "cluster", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from the `cluster` global option.
// Syntax:
//
//	cluster {
//		node_name   <name>
//		bind        <host:port>
//		advertise   <host:port>
//		join        <host:port>...
//		encrypt_key <base64 key>
//		tags {
//			<key> <value>
//		}
//	}
//
// Every option is optional and may appear once. Each value is checked
// against the bounds of its JSON field as it is read, so errors name
// their line.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	const what = "cluster"
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
		case "node_name", "bind", "advertise", "encrypt_key":
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
			case "encrypt_key":
				a.EncryptKey = val
			}
		case "join":
			a.Join = d.RemainingArgs()
			if len(a.Join) == 0 {
				return d.Errf("%s: join: missing value", what)
			}
		case "tags":
			if d.NextArg() {
				return d.Errf("%s: tags: unexpected argument %q; tags go in a block", what, d.Val())
			}
			a.Tags = make(map[string]string)
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				key := d.Val()
				val, err := caddyopt.OneArg(d, what)
				if err != nil {
					return err
				}
				if _, dup := a.Tags[key]; dup {
					return d.Errf("%s: tag %q specified more than once", what, key)
				}
				a.Tags[key] = val
			}
		default:
			return caddyopt.Unknown(d, what, "node_name", "bind", "advertise", "join", "encrypt_key", "tags")
		}
		if err := a.checkOption(opt); err != nil {
			return d.Errf("%s: %v", what, err)
		}
	}
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*App)(nil)
