package cluster

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"
)

// keyChange is what a reload's new key list changed in the member's
// keyring, by fingerprint.
type keyChange struct {
	installed []string // keys the keyring did not have
	primary   string   // the new primary; empty when it stayed
	removed   []string // keys the previous list had and the new one drops
	err       error
}

// sameKeys reports whether two key lists have the same primary and the
// same keys: the order of the others does not matter to the keyring.
func sameKeys(a, b [][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) == 0 {
		return true
	}
	if !bytes.Equal(a[0], b[0]) {
		return false
	}
	for _, k := range b {
		if !slices.ContainsFunc(a, func(x []byte) bool { return bytes.Equal(x, k) }) {
			return false
		}
	}
	return true
}

// hasKey reports whether keys holds key.
func hasKey(keys [][]byte, key []byte) bool {
	return slices.ContainsFunc(keys, func(k []byte) bool { return bytes.Equal(k, key) })
}

// reconcileKeys applies a changed key list to this node's keyring only
// (memberlist's AddKey, UseKey, RemoveKey; serf's cluster-wide queries
// are the admin API's): it installs the keys of next the keyring lacks,
// makes next's first key the primary, and removes the keys prev listed
// and next does not. Keys neither list has (installed through the admin
// API) stay. next is not empty; kr is not nil.
func reconcileKeys(kr *memberlist.Keyring, prev, next [][]byte) keyChange {
	var c keyChange
	have := kr.GetKeys()
	for _, k := range next {
		if hasKey(have, k) {
			continue
		}
		if err := kr.AddKey(k); err != nil {
			c.err = errors.Join(c.err, fmt.Errorf("installing key %s: %v", keyID(k), err))
			continue
		}
		c.installed = append(c.installed, keyID(k))
	}
	if !bytes.Equal(kr.GetPrimaryKey(), next[0]) {
		if err := kr.UseKey(next[0]); err != nil {
			c.err = errors.Join(c.err, fmt.Errorf("using key %s as the primary: %v", keyID(next[0]), err))
		} else {
			c.primary = keyID(next[0])
		}
	}
	for _, k := range prev {
		if hasKey(next, k) || !hasKey(kr.GetKeys(), k) {
			continue
		}
		if err := kr.RemoveKey(k); err != nil {
			c.err = errors.Join(c.err, fmt.Errorf("removing key %s: %v", keyID(k), err))
			continue
		}
		c.removed = append(c.removed, keyID(k))
	}
	return c
}

// log reports the change: every reload that changes the key list says
// what it did to the keyring.
func (c keyChange) log(logger *zap.Logger) {
	fields := []zap.Field{
		zap.Strings("installed", c.installed), zap.String("primary", c.primary), zap.Strings("removed", c.removed),
	}
	if c.err != nil {
		logger.Error("applying the configured gossip keys", append(fields, zap.Error(c.err))...)
		return
	}
	logger.Info("gossip keyring changed by the config's key list (on this node only)", fields...)
}

// describeKeys says which keys kr has, by fingerprint, for a join error:
// a cluster refuses a node that does not share its keys.
func describeKeys(kr *memberlist.Keyring) string {
	if kr == nil {
		return "this node gossips in clear text (no encrypt_key): an encrypted cluster refuses it"
	}
	keys := kr.GetKeys()
	if len(keys) == 0 {
		return "this node's keyring is empty"
	}
	desc := "this node's gossip keys: primary " + keyID(keys[0])
	if len(keys) > 1 {
		others := make([]string, 0, len(keys)-1)
		for _, k := range keys[1:] {
			others = append(others, keyID(k))
		}
		desc += ", also " + strings.Join(others, ", ")
	}
	return desc + "; a cluster that does not know its primary key refuses it"
}

// keyringOp is an operation of the admin API on the cluster's keyring.
type keyringOp int

// The keyring operations, as serf's KeyManager has them.
const (
	opList keyringOp = iota
	opInstall
	opUse
	opRemove
	keyringOps
)

// keyringOpNames are the operations' names, in the admin paths, the log
// and the metric.
var keyringOpNames = [keyringOps]string{"list", "install", "use", "remove"}

// String returns the operation's name.
func (op keyringOp) String() string { return keyringOpNames[op] }

// keyringResult is how a keyring operation ended, a label of
// caddy_lbx_cluster_keyring_operations_total.
type keyringResult int

// The results: every node answered without error (ok), serf reported a
// node's error or a node did not answer (failed), or the request was
// refused before any query (refused: a bad key, the primary to remove,
// no encryption).
const (
	resultOK keyringResult = iota
	resultFailed
	resultRefused
	keyringResults
)

// keyringResultNames are the results' names.
var keyringResultNames = [keyringResults]string{"ok", "failed", "refused"}

// keyringCounts counts the keyring operations of the process, by
// operation and result.
var keyringCounts [keyringOps][keyringResults]atomic.Uint64

// keyringReport is the body of a keyring operation's answer: what serf's
// query gathered from the cluster. It never holds a key, only
// fingerprints (the first 4 bytes of the key's SHA-256, in hex).
type keyringReport struct {
	// Op is the operation: list, install, use or remove.
	Op string `json:"op"`
	// Key is the fingerprint of the key installed, used or removed.
	Key string `json:"key,omitempty"`
	// Node is the node that asked the cluster.
	Node string `json:"node_name"`
	// Nodes is how many members serf asked (those it sees alive).
	Nodes int `json:"nodes"`
	// Responses is how many answered before the query's timeout.
	Responses int `json:"responses"`
	// Errors are the answers of the nodes that failed, by node.
	Errors []keyringNodeError `json:"errors"`
	// Keys (list only) are the keys the nodes have, the most widespread
	// first.
	Keys []keyringKey `json:"keys,omitempty"`
	// Primary (list only) is the fingerprint of the primary key when
	// every node that answered has the same one.
	Primary string `json:"primary,omitempty"`
	// Error is set when the operation did not succeed on every node:
	// some node failed or did not answer.
	Error string `json:"error,omitempty"`
}

// keyringNodeError is one node's error in a keyringReport.
type keyringNodeError struct {
	// Node is the node's name.
	Node string `json:"node"`
	// Message is its error.
	Message string `json:"message"`
}

// keyringKey is one key of a list's keyringReport.
type keyringKey struct {
	// Fingerprint identifies the key without revealing it.
	Fingerprint string `json:"fingerprint"`
	// Nodes is how many nodes have the key.
	Nodes int `json:"nodes"`
	// PrimaryOn is how many nodes use it as their primary key.
	PrimaryOn int `json:"primary_on"`
}

// errKeyringRefused marks an operation refused before any query.
type errKeyringRefused struct{ error }

// keyringRelayFactor is how many other members relay each member's
// answer to a keyring query, besides its own UDP datagram to the asker
// (serf's relay factor, Consul's -relay-factor): one lost datagram must
// not make a step look failed on a node that took it.
const keyringRelayFactor = 2

// record logs and counts a keyring operation as it ended: refused
// (errKeyringRefused), failed (another error) or ok.
func (m *member) record(op keyringOp, rep keyringReport, err error) {
	res := resultOK
	var refused errKeyringRefused
	switch {
	case errors.As(err, &refused):
		res = resultRefused
	case err != nil:
		res = resultFailed
	}
	keyringCounts[op][res].Add(1)
	fields := []zap.Field{
		zap.String("op", op.String()), zap.String("key", rep.Key), zap.String("result", keyringResultNames[res]),
		zap.Int("nodes", rep.Nodes), zap.Int("responses", rep.Responses), zap.Any("errors", rep.Errors),
	}
	if err != nil {
		m.logger.Warn("gossip keyring operation", append(fields, zap.Error(err))...)
	} else {
		m.logger.Info("gossip keyring operation", fields...)
	}
}

// keyringOp runs op across the cluster through serf's KeyManager (its
// internal queries reach every member, this one included), with key for
// install, use and remove. It refuses, before any query, an operation on
// a member without encryption and the removal of this node's primary
// key. Every operation is logged and counted.
func (m *member) keyringOp(op keyringOp, key []byte) (rep keyringReport, err error) {
	rep = keyringReport{Op: op.String(), Node: m.name, Errors: []keyringNodeError{}}
	if key != nil {
		rep.Key = keyID(key)
	}
	defer func() { m.record(op, rep, err) }()
	if m.keyring == nil {
		return rep, errKeyringRefused{errors.New("gossip is not encrypted: this node's serf member started without encrypt_key, and memberlist cannot turn encryption on while it runs; set encrypt_key on every node and restart them")}
	}
	if op == opRemove && bytes.Equal(m.keyring.GetPrimaryKey(), key) {
		return rep, errKeyringRefused{fmt.Errorf("key %s is this node's primary key, which encrypts its gossip: make another key the primary first (POST /lbx/cluster/keys/use), then remove it", rep.Key)}
	}
	km := m.serf.KeyManager()
	b64 := base64.StdEncoding.EncodeToString(key)
	opts := &serf.KeyRequestOptions{RelayFactor: keyringRelayFactor}
	var resp *serf.KeyResponse
	switch op {
	case opList:
		resp, err = km.ListKeysWithOptions(opts)
	case opInstall:
		resp, err = km.InstallKeyWithOptions(b64, opts)
	case opUse:
		resp, err = km.UseKeyWithOptions(b64, opts)
	case opRemove:
		resp, err = km.RemoveKeyWithOptions(b64, opts)
	}
	if resp != nil {
		rep.fill(resp)
	}
	if err != nil {
		what := "list keys"
		if op != opList {
			what = op.String() + " key " + rep.Key
		}
		err = fmt.Errorf("%s: %v", what, err)
		rep.Error = err.Error()
	}
	return rep, err
}

// fill copies serf's answer into the report, keys as fingerprints.
func (rep *keyringReport) fill(resp *serf.KeyResponse) {
	rep.Nodes, rep.Responses = resp.NumNodes, resp.NumResp
	for node, msg := range resp.Messages {
		rep.Errors = append(rep.Errors, keyringNodeError{Node: node, Message: msg})
	}
	slices.SortFunc(rep.Errors, func(a, b keyringNodeError) int { return strings.Compare(a.Node, b.Node) })
	byID := map[string]*keyringKey{}
	entry := func(b64 string) *keyringKey {
		raw, err := base64.StdEncoding.DecodeString(b64)
		if err != nil || len(raw) == 0 {
			return nil // a node without a keyring answers no key
		}
		id := keyID(raw)
		if byID[id] == nil {
			byID[id] = &keyringKey{Fingerprint: id}
		}
		return byID[id]
	}
	for b64, n := range resp.Keys {
		if k := entry(b64); k != nil {
			k.Nodes += n
		}
	}
	for b64, n := range resp.PrimaryKeys {
		if k := entry(b64); k != nil {
			k.PrimaryOn += n
		}
	}
	for _, k := range byID {
		rep.Keys = append(rep.Keys, *k)
		if k.PrimaryOn > 0 && k.PrimaryOn == resp.NumResp-resp.NumErr {
			rep.Primary = k.Fingerprint
		}
	}
	slices.SortFunc(rep.Keys, func(a, b keyringKey) int {
		if a.Nodes != b.Nodes {
			return b.Nodes - a.Nodes
		}
		return strings.Compare(a.Fingerprint, b.Fingerprint)
	})
}
