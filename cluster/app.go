// Package cluster joins this Caddy node to a serf cluster of Caddy nodes:
// membership and discovery only. It is the `cluster` app (global option
// `cluster`), which shares one serf member across config reloads, and the
// member sources built on it: `dynamic serf` upstreams for reverse_proxy
// and the member lists partition's `serf_tag` reads. Shedding
// (package rebalance) publishes its load through it; nothing here sheds.
package cluster

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/drain"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/serfnet"
)

func init() {
	caddy.RegisterModule(App{})
}

// defaultBind is the address serf listens on by default.
const defaultBind = "0.0.0.0:7946"

// reservedTagPrefix starts the member tags lbx publishes itself (the
// load tag of package rebalance); configured tags may not use it.
const reservedTagPrefix = "lbx_"

// App is this node's membership in a serf cluster of Caddy nodes. Other
// lbx modules read the members (discovery) and publish tags through it.
//
// The serf member survives config reloads: it is shared between configs
// by bind address, so a reload neither leaves nor rejoins the cluster. It
// leaves gracefully when Caddy stops or a config without it is loaded.
type App struct {
	// This node's unique name in the cluster, at most 128
	// bytes. A node that joins with a name the cluster already has loses
	// serf's vote and stops gossiping (reported in the admin view, the
	// log and the caddy_lbx_cluster_name_conflict metric). It cannot change
	// while the member runs. Default: the host name.
	NodeName string `json:"node_name,omitempty"`

	// The address (host:port) serf listens on, TCP and UDP.
	// Default: 0.0.0.0:7946.
	Bind string `json:"bind,omitempty"`

	// The address (host:port) other members use to reach
	// this one, when it differs from `bind` (NAT, containers). Default: the
	// bind address, or a private IP of this host when binding 0.0.0.0.
	Advertise string `json:"advertise,omitempty"`

	// Addresses (host:port) of cluster members to join. The
	// node retries with backoff while it sees no other alive member.
	// Default: none (a cluster of one until others join it).
	Join []string `json:"join,omitempty"`

	// The base64 gossip encryption key (16, 24 or 32 bytes
	// decoded; e.g. `head -c32 /dev/urandom | base64`), the same on every
	// node; placeholders such as {env.LBX_GOSSIP_KEY} are replaced. A node
	// with another key cannot join. For several keys (a rotation), see
	// `encrypt_keys`. Default: none, gossip in clear text (a warning is
	// logged).
	EncryptKey string `json:"encrypt_key,omitempty"`

	// Allow a cluster without a key (neither
	// encrypt_key nor encrypt_keys) on a bind address that is not
	// loopback. Without a key anyone who reaches the gossip port joins the
	// cluster, reads its gossip and advertises the addresses this node
	// dials; a config that binds beyond loopback without a key is refused
	// unless this is true. A loopback bind needs no key: only local
	// processes reach it, and they can reach Caddy's admin endpoint
	// anyway. Default: false.
	InsecurePlaintextGossip bool `json:"insecure_plaintext_gossip,omitempty"`

	// Several gossip keys, primary first, instead of
	// `encrypt_key` (setting both is an error): the primary encrypts what
	// this node sends, and every key decrypts what it receives, so that a
	// key can be rotated with no restart by rolling configs ([old, new]
	// on every node, then [new, old], then [new]). Each is checked as
	// `encrypt_key` is; at most 16, no duplicates. When a reload keeps the
	// running member and changes this list, the new keys are installed on
	// this node, the new primary used, and the keys the list dropped
	// removed once the previous config stopped; a reload that keeps the
	// list leaves the keyring as it is (keys installed through the admin
	// API stay). A reload that fails to start puts back the primary it
	// changed and removes no key, not even one it installed: other members
	// may already use it. Turning encryption on or off still needs a
	// restart. Default: none.
	EncryptKeys []string `json:"encrypt_keys,omitempty"`

	// Serf tags this node publishes for discovery (e.g. role,
	// zone, the port it serves on). Keys starting with "lbx_" are
	// reserved. Serf allows a member 512 bytes of tags, encoded, including
	// the ones lbx publishes: a config whose tags do not fit is refused.
	Tags map[string]string `json:"tags,omitempty"`

	// The base64 operator key (32 bytes decoded; e.g. `head -c32
	// /dev/urandom | base64`), the same on every node and not a gossip
	// key; placeholders such as {env.LBX_OPS_KEY} are replaced. With it,
	// a drain, undrain or reweight made through this node's admin
	// endpoint (POST /lbx/drain, /lbx/undrain, /lbx/weight) is sent to
	// every member at once, and every second to one random member, signed
	// with this key (HMAC-SHA256); members take only entries signed with
	// their own ops_key, so a member holding only the gossip key cannot
	// drain anything. Default: none, drains stay on the node they were
	// made on.
	OpsKey string `json:"ops_key,omitempty"`

	opsKey []byte     // decoded ops_key; nil: none
	drains *drainSync // set by Start with an ops_key, cleared by Stop
	// drainStore is the store drains are carried from and into: nil for
	// the process's (drain.Shared); the package's tests give each node
	// of a cluster in one process its own.
	drainStore *drain.Store
	keys       [][]byte // the decoded gossip keys, primary first; nil: none
	bindHost   string
	bindPort   int
	poolKey    string
	logger     *zap.Logger
	member     *member // set by Start, cleared by Stop

	// What modules of the config need of each other through this app
	// (Require, Provide), checked at Start.
	required map[string]string // what → by whom
	provided map[string]bool
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "cluster",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision sets defaults, checks every option and decodes the key. It
// does not touch the network (it also runs for `caddy validate`).
func (a *App) Provision(ctx caddy.Context) error {
	a.logger = ctx.Logger()
	if err := registerMetrics(ctx); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	if a.NodeName == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			return fmt.Errorf("node_name: not set, and the host name is unavailable: %v", err)
		}
		a.NodeName = host
	}
	if a.Bind == "" {
		a.Bind = defaultBind
	}
	if err := a.Validate(); err != nil {
		return err
	}
	keys, err := a.decodeKeys(true)
	if err != nil {
		return err
	}
	a.keys = keys
	if a.opsKey, err = a.decodeOpsKey(true); err != nil {
		return err
	}
	a.bindHost, a.bindPort, _ = splitHostPort(a.Bind, "bind")
	a.poolKey = net.JoinHostPort(a.bindHost, strconv.Itoa(a.bindPort))
	if a.bindPort == 0 {
		// A port chosen by the kernel (tests): every node name its own.
		a.poolKey += "#" + a.NodeName
	}
	return nil
}

// maxKeys is the most gossip keys a config may carry: a rotation needs
// two or three, and every received packet may be tried with each.
const maxKeys = 16

// configuredKeys returns the configured keys, primary first, and the
// option that carries them.
func (a *App) configuredKeys() ([]string, string) {
	if a.EncryptKey != "" {
		return []string{a.EncryptKey}, "encrypt_key"
	}
	return a.EncryptKeys, "encrypt_keys"
}

// decodeKeys decodes the configured keys, primary first, and checks
// their count and that none is there twice. With replace false (the
// Caddyfile, adapted where the server's environment may not be), a key
// with a placeholder is left unchecked and out of the result; Provision
// decodes with replace true.
func (a *App) decodeKeys(replace bool) ([][]byte, error) {
	if a.EncryptKey != "" && len(a.EncryptKeys) > 0 {
		return nil, errors.New("encrypt_key and encrypt_keys are both set; use encrypt_keys alone for several keys, primary first")
	}
	raw, opt := a.configuredKeys()
	if len(raw) > maxKeys {
		return nil, fmt.Errorf("%s: %d keys; at most %d", opt, len(raw), maxKeys)
	}
	var keys [][]byte
	seen := make(map[string]int, len(raw))
	for i, configured := range raw {
		name := opt
		if opt == "encrypt_keys" {
			name = fmt.Sprintf("encrypt_keys[%d]", i)
		}
		value := configured
		if strings.Contains(configured, "{") {
			if !replace {
				continue
			}
			value = caddy.NewReplacer().ReplaceAll(configured, "")
		}
		if configured == "" {
			return nil, fmt.Errorf("%s is empty; want a base64 key", name)
		}
		if value == "" {
			return nil, fmt.Errorf("%s %q is empty once placeholders are replaced (is the environment variable set?)", name, configured)
		}
		key, err := parseKey(value)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", name, err)
		}
		if j, dup := seen[string(key)]; dup {
			return nil, fmt.Errorf("%s: the same key as encrypt_keys[%d] (fingerprint %s); list each key once", name, j, keyID(key))
		}
		seen[string(key)] = i
		keys = append(keys, key)
	}
	return keys, nil
}

// parseKey decodes a base64 gossip key and checks its length. Its errors
// never quote the key.
func parseKey(b64 string) ([]byte, error) {
	key, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return nil, fmt.Errorf("not valid base64: %v", err)
	}
	if err := memberlist.ValidateKey(key); err != nil {
		return nil, fmt.Errorf("decodes to %d bytes; want 16, 24 or 32 (AES-128, -192 or -256)", len(key))
	}
	if !slices.ContainsFunc(key, func(b byte) bool { return b != 0 }) {
		return nil, fmt.Errorf("decodes to %d zero bytes, which is no secret; generate a key with `head -c32 /dev/urandom | base64`", len(key))
	}
	return key, nil
}

// keyID is a gossip key's fingerprint, which logs, errors and the admin
// API show instead of the key: the first 4 bytes of its SHA-256, in hex.
func keyID(key []byte) string {
	sum := sha256.Sum256(key)
	return hex.EncodeToString(sum[:4])
}

// UnmarshalJSON decodes the app's JSON as Caddy does, naming the field
// of a value that does not decode.
func (a *App) UnmarshalJSON(b []byte) error {
	type appJSON App
	return jsonfield.Decode(b, (*appJSON)(a))
}

// maxNodeName is the longest node_name, in bytes.
const maxNodeName = serfnet.MaxNodeName

// Validate checks every option, each with the check the Caddyfile runs
// as it reads the option, then the options against each other. Provision
// runs it before anything sized by the options exists.
func (a *App) Validate() error {
	if err := checkNodeName(a.NodeName); err != nil {
		return err
	}
	if a.Bind != "" {
		if err := checkAddr("bind", a.Bind); err != nil {
			return err
		}
	}
	if a.Advertise != "" {
		if err := checkAddr("advertise", a.Advertise); err != nil {
			return err
		}
	}
	if err := checkJoin(a.Join); err != nil {
		return err
	}
	if err := a.checkKeys(); err != nil {
		return err
	}
	if err := a.checkTags(); err != nil {
		return err
	}
	if err := a.checkOpsKey(); err != nil {
		return err
	}
	return a.checkPlaintext()
}

// The rules for each option, shared by Validate and the Caddyfile: the
// error names the option, the value and why.

func checkNodeName(name string) error {
	if len(name) > maxNodeName {
		return fmt.Errorf("node_name %.32q… is %d bytes; at most %d", name, len(name), maxNodeName)
	}
	return nil
}

// checkAddr checks the host:port of option opt (bind or advertise).
func checkAddr(opt, addr string) error {
	_, _, err := splitHostPort(addr, opt)
	return err
}

func checkJoin(join []string) error {
	for _, j := range join {
		_, port, err := splitHostPort(j, "join")
		if err != nil {
			return err
		}
		if port == 0 {
			return fmt.Errorf("join %q: port 0 cannot be joined; want 1 to 65535", j)
		}
	}
	return nil
}

// checkKeys checks encrypt_key and encrypt_keys as far as can be without
// the server's environment: keys with placeholders are checked when
// Provision decodes them.
func (a *App) checkKeys() error {
	_, err := a.decodeKeys(false)
	return err
}

// checkTags checks the tags' keys and values, and that they fit serf's
// limit.
func (a *App) checkTags() error {
	for k, v := range a.Tags {
		if strings.HasPrefix(k, reservedTagPrefix) {
			return fmt.Errorf("tag %q: keys starting with %s are reserved", k, reservedTagPrefix)
		}
		if k == "" || v == "" {
			return fmt.Errorf("tag %q=%q: key and value must not be empty", k, v)
		}
	}
	return a.CheckTagsFit(nil)
}

// checkPlaintext refuses gossip without a key on a bind address beyond
// loopback, unless insecure_plaintext_gossip says it is meant.
func (a *App) checkPlaintext() error {
	if raw, _ := a.configuredKeys(); len(raw) > 0 || a.InsecurePlaintextGossip {
		return nil
	}
	bind := a.Bind
	if bind == "" {
		bind = defaultBind
	}
	host, _, err := splitHostPort(bind, "bind")
	if err != nil || isLoopbackHost(host) {
		return nil // bind's own check reports a bad address
	}
	return fmt.Errorf("no encrypt_key and bind %s is not loopback: anyone who reaches that port joins the cluster in clear text and chooses addresses this node dials; set encrypt_key (make one with `head -c32 /dev/urandom | base64`), bind to loopback, or set insecure_plaintext_gossip if that is what you mean", bind)
}

// tagMagicByte starts serf's encoding of a member's tags.
const tagMagicByte = 255

// CheckTagsFit checks that the configured tags, with extra (the longest
// values of the tags another module will publish), fit in the 512 bytes
// serf allows a member's tags (memberlist.MetaMaxSize), encoded as serf
// encodes them. Serf refuses larger tags at start and on every update,
// which on a reload would stop the node gossiping.
func (a *App) CheckTagsFit(extra map[string]string) error {
	all := maps.Clone(a.Tags)
	if all == nil {
		all = make(map[string]string, len(extra))
	}
	maps.Copy(all, extra)
	buf := bytes.NewBuffer([]byte{tagMagicByte})
	if err := codec.NewEncoder(buf, &codec.MsgpackHandle{}).Encode(all); err != nil {
		return fmt.Errorf("tags: %v", err)
	}
	if buf.Len() > memberlist.MetaMaxSize {
		what := "tags"
		if len(extra) > 0 {
			what = "tags, with the ones lbx publishes,"
		}
		return fmt.Errorf("%s take %d bytes encoded, above serf's limit of %d; use fewer or shorter tags",
			what, buf.Len(), memberlist.MetaMaxSize)
	}
	return nil
}

// Require records, while the config is provisioned, that module by
// needs what, which another module of the config provides (Provide):
// Start refuses to run the config without it. It lets a module depend on
// another that it must not provision itself.
func (a *App) Require(what, by string) {
	if a.required == nil {
		a.required = make(map[string]string)
	}
	a.required[what] = by
}

// Provide records, while the config is provisioned, that a module of the
// config provides what.
func (a *App) Provide(what string) {
	if a.provided == nil {
		a.provided = make(map[string]bool)
	}
	a.provided[what] = true
}

// Start joins the cluster, or takes over the member of the config this one
// replaces (same bind address): no second bind, no leave and rejoin.
func (a *App) Start() error {
	for what, by := range a.required {
		if !a.provided[what] {
			return fmt.Errorf("%s needs %s in the same config", by, what)
		}
	}
	s := a.settings()
	val, loaded, err := members.LoadOrNew(a.poolKey, func() (caddy.Destructor, error) {
		return newMember(a.poolKey, s, a.bindHost, a.bindPort)
	})
	if err != nil {
		return fmt.Errorf("cluster: %v", err)
	}
	m := val.(*member)
	if loaded {
		m.attach(s)
		if conflict := m.status().Conflict; conflict != "" {
			// The new config cannot revive it: say so at every reload.
			a.logger.Error("cluster member stopped: name conflict", zap.String("error", conflict))
		}
	}
	a.member = m
	if m.keyring == nil {
		// The member's state, not this config's: a reload cannot turn
		// encryption on (attach warns).
		a.logger.Warn("gossip is not encrypted: anyone who can reach the bind address can join the cluster and read its traffic; set encrypt_key",
			zap.String("bind", a.Bind))
	}
	if a.opsKey != nil {
		store := a.drainStore
		if store == nil {
			store = drain.Shared()
		}
		ds, err := startDrainSync(a, a.opsKey, store)
		if err != nil {
			// a member stopped by a name conflict: reported above
			a.logger.Error("drains are not propagated", zap.Error(err))
		}
		a.drains = ds
	}
	a.logger.Info("cluster member started",
		zap.String("node_name", m.name), zap.String("bind", a.Bind), zap.Bool("reused_member", loaded),
		zap.Strings("join", a.Join))
	return nil
}

// settings returns what this config asks of the member.
func (a *App) settings() *settings {
	return &settings{
		owner: a, tags: maps.Clone(a.Tags), join: a.Join, logger: a.logger,
		name: a.NodeName, keys: a.keys, advertise: a.Advertise,
	}
}

// Stop hands the member back: to the config that replaces this one, or,
// when none does, the member leaves the cluster and shuts down.
func (a *App) Stop() error {
	if a.drains != nil {
		a.drains.close()
		a.drains = nil
	}
	m := a.member
	a.member = nil
	if m == nil {
		return nil
	}
	m.detach(a)
	_, err := members.Delete(a.poolKey)
	return err
}

// Cleanup releases the member if Stop did not (it is idempotent).
func (a *App) Cleanup() error { return a.Stop() }

// ErrNotRunning is returned by App.Members and App.Publish before the
// app's serf member has started (Caddy provisions every app before it
// starts any), after it stopped, or once serf shut it down.
var ErrNotRunning = errors.New("the cluster app's serf member is not running")

// Lookup returns the config's cluster app for the module that needs it
// (what names it in the error: "dynamic serf", "rebalance", …).
func Lookup(ctx caddy.Context, what string) (*App, error) {
	app, err := ctx.AppIfConfigured("cluster")
	if err != nil {
		if errors.Is(err, caddy.ErrNotConfigured) {
			return nil, fmt.Errorf("%s: no cluster app in this config; it works on the members of this node's serf cluster, so add the `cluster` global option (or the \"cluster\" app in JSON)", what)
		}
		return nil, fmt.Errorf("%s: %v", what, err)
	}
	return app.(*App), nil
}

// Key identifies the app's serf member in the process: the same for
// every config that shares the member.
func (a *App) Key() string { return a.poolKey }

// splitHostPort parses "host:port" for option opt; an empty host is
// 0.0.0.0.
func splitHostPort(addr, opt string) (string, int, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("%s %q: want host:port: %v", opt, addr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("%s %q: invalid port %q", opt, addr, portStr)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	return host, port, nil
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.Validator    = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
	_ json.Unmarshaler   = (*App)(nil)
)
