package cluster

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"
)

// keyChange is what a reload's new key list changed in the member's
// keyring, by fingerprint, and what it keeps to finish or undo it: a
// reload stages the change when its config starts (installs the new keys,
// uses the new primary), removes the keys its list dropped only once the
// previous config stopped (the reload succeeded), and, when its config is
// the one that stops (a failed reload), undoes only the primary it
// changed. A failed reload never removes a key: an extra key never splits
// a cluster, a missing one does.
type keyChange struct {
	installed []string // keys the keyring did not have
	primary   string   // the new primary; empty when it stayed
	removed   []string // keys the previous list had and the new one drops
	err       error

	// prevPrimary and newPrimary are the primary before and after the
	// change, when it changed it.
	prevPrimary, newPrimary []byte
	// remove are the keys to remove when the change commits: those the
	// previous list had, the new one drops, and the keyring holds.
	remove [][]byte
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

// stageKeys applies the additive part of a changed key list to this
// node's keyring only (memberlist's AddKey, UseKey; serf's cluster-wide
// queries are the admin API's): it installs the keys of next the keyring
// lacks and makes next's first key the primary. The keys prev listed and
// next does not are only recorded, for commit. Keys neither list has
// (installed through the admin API) stay. next is not empty; kr is not
// nil.
func stageKeys(kr *memberlist.Keyring, prev, next [][]byte) keyChange {
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
	if before := kr.GetPrimaryKey(); !bytes.Equal(before, next[0]) {
		if err := kr.UseKey(next[0]); err != nil {
			c.err = errors.Join(c.err, fmt.Errorf("using key %s as the primary: %v", keyID(next[0]), err))
		} else {
			c.primary = keyID(next[0])
			c.prevPrimary, c.newPrimary = before, next[0]
		}
	}
	for _, k := range prev {
		if !hasKey(next, k) && hasKey(kr.GetKeys(), k) {
			c.remove = append(c.remove, k)
		}
	}
	return c
}

// commit removes the keys the change's list dropped: its config replaced
// the previous one. A key that is the primary by then (the admin API
// made it so) stays.
func (c *keyChange) commit(kr *memberlist.Keyring) {
	for _, k := range c.remove {
		if !hasKey(kr.GetKeys(), k) || bytes.Equal(kr.GetPrimaryKey(), k) {
			continue
		}
		if err := removeKey(kr, k); err != nil {
			c.err = errors.Join(c.err, fmt.Errorf("removing key %s: %v", keyID(k), err))
			continue
		}
		c.removed = append(c.removed, keyID(k))
	}
	c.remove = nil
}

// removeKey drops key, not the primary, from kr, removing only a keyring's
// last key at a time. memberlist's RemoveKey (v0.7.0) closes the gap of a
// key in the middle by shifting the later keys within the array that
// GetKeys handed out, while memberlist's packet goroutines iterate over
// it to decrypt (a data race -race reported in CI). Removing the last
// key writes no element, and every change installs a fresh array, so the
// keys after key are removed from the end, then key, then installed again
// in their order; AddKey appends beyond what readers of the array read.
// For that moment a packet under one of those later keys does not decrypt
// (gossip sends it again); none is the primary.
func removeKey(kr *memberlist.Keyring, key []byte) error {
	keys := kr.GetKeys()
	i := slices.IndexFunc(keys, func(k []byte) bool { return bytes.Equal(k, key) })
	if i < 0 {
		return nil
	}
	later := slices.Clone(keys[i+1:])
	var err error
	for j := len(later) - 1; j >= 0 && err == nil; j-- {
		err = kr.RemoveKey(later[j])
	}
	if err == nil {
		err = kr.RemoveKey(key)
	}
	for _, k := range later {
		err = errors.Join(err, kr.AddKey(k))
	}
	return err
}

// undo reverts what a failed reload's change did that another member may
// not follow: the primary, put back when the change set it and it is
// still the primary (no admin API call changed it since) and the previous
// one is still installed. It removes nothing. It returns the fingerprint
// of the primary put back, or "".
func (c *keyChange) undo(kr *memberlist.Keyring) (string, error) {
	c.remove = nil
	if c.newPrimary == nil || !bytes.Equal(kr.GetPrimaryKey(), c.newPrimary) || !hasKey(kr.GetKeys(), c.prevPrimary) {
		return "", nil
	}
	if err := kr.UseKey(c.prevPrimary); err != nil {
		return "", fmt.Errorf("putting key %s back as the primary: %v", keyID(c.prevPrimary), err)
	}
	return keyID(c.prevPrimary), nil
}

// reconcileKeys stages and commits a changed key list at once.
func reconcileKeys(kr *memberlist.Keyring, prev, next [][]byte) keyChange {
	c := stageKeys(kr, prev, next)
	c.commit(kr)
	return c
}

// log reports the change with msg: every reload that changes the key
// list says what it did to the keyring, and what it will remove once the
// previous config stopped.
func (c keyChange) log(logger *zap.Logger, msg string) {
	pending := make([]string, 0, len(c.remove))
	for _, k := range c.remove {
		pending = append(pending, keyID(k))
	}
	fields := []zap.Field{
		zap.Strings("installed", c.installed), zap.String("primary", c.primary), zap.Strings("removed", c.removed),
		zap.Strings("remove_when_the_previous_config_stops", pending),
	}
	if c.err != nil {
		logger.Error("applying the configured gossip keys", append(fields, zap.Error(c.err))...)
		return
	}
	logger.Info(msg, fields...)
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
	// Local is set when the operation changed (or listed) this node's
	// keyring alone (?local=1), with no query.
	Local bool `json:"local,omitempty"`
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
	// Unencrypted (list only) is set when this node's gossip is not
	// encrypted: it has no keyring, so the list is empty and no node was
	// asked.
	Unencrypted bool `json:"unencrypted,omitempty"`
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

// errKeyringRefused marks an operation refused before it changed any
// keyring, with the HTTP status to answer (0: 409 Conflict).
type errKeyringRefused struct {
	error
	status int
}

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
// install, use and remove; with local, on this node's keyring alone (the
// heal of a node left behind: decrypt.go). It refuses, before any query,
// an operation on a member without encryption and the removal of this
// node's primary key. An install, use or remove first takes the key
// lease on every member (lockKeys), and a use or remove first lists the
// keys: a use of a key some node lacks, a removal of a key some node
// uses as its primary, and a removal of a key no node has are refused.
// Every operation is logged and counted.
func (m *member) keyringOp(op keyringOp, key []byte, local bool) (rep keyringReport, err error) {
	rep = keyringReport{Op: op.String(), Node: m.name, Local: local, Errors: []keyringNodeError{}}
	if key != nil {
		rep.Key = keyID(key)
	}
	defer func() {
		if err != nil && rep.Error == "" {
			rep.Error = err.Error()
		}
		m.record(op, rep, err)
	}()
	if m.keyring == nil && op == opList {
		// not an error: the answer to "which keys?" is "none"
		rep.Unencrypted = true
		return rep, nil
	}
	if m.keyring == nil {
		return rep, errKeyringRefused{error: errors.New("gossip is not encrypted: this node's serf member started without encrypt_key, and memberlist cannot turn encryption on while it runs; set encrypt_key on every node and restart them")}
	}
	if op == opRemove && bytes.Equal(m.keyring.GetPrimaryKey(), key) {
		return rep, errKeyringRefused{error: fmt.Errorf("key %s is this node's primary key, which encrypts its gossip: make another key the primary first (POST /lbx/cluster/keys/use), then remove it", rep.Key)}
	}
	if local {
		return m.localKeyOp(op, key, rep)
	}
	opts := &serf.KeyRequestOptions{RelayFactor: keyringRelayFactor}
	km := m.serf.KeyManager()
	if op != opList {
		release, err := m.lockKeys(op.String() + " " + rep.Key)
		if err != nil {
			return rep, err
		}
		defer release()
		if op == opUse || op == opRemove {
			if err := m.checkKeyOp(op, key, &rep); err != nil {
				return rep, err
			}
		}
	}
	b64 := base64.StdEncoding.EncodeToString(key)
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

// checkKeyOp lists the cluster's keys before a use or remove of key, and
// refuses what would leave members unable to read each other: a use of a
// key not every node has, a removal of a key some node uses as its
// primary; and a removal of a key no node has (a mistyped key). A list
// that some node failed or did not answer fails the operation (a 502 to
// repeat), with the list's counts in rep.
func (m *member) checkKeyOp(op keyringOp, key []byte, rep *keyringReport) error {
	resp, err := m.serf.KeyManager().ListKeysWithOptions(&serf.KeyRequestOptions{RelayFactor: keyringRelayFactor})
	if resp != nil {
		rep.Nodes, rep.Responses = resp.NumNodes, resp.NumResp
		for node, msg := range resp.Messages {
			rep.Errors = append(rep.Errors, keyringNodeError{Node: node, Message: msg})
		}
		slices.SortFunc(rep.Errors, func(a, b keyringNodeError) int { return strings.Compare(a.Node, b.Node) })
	}
	if err != nil {
		return fmt.Errorf("%s key %s: listing the keys first, to check the step is safe: %v; nothing changed, try again", op, rep.Key, err)
	}
	b64 := base64.StdEncoding.EncodeToString(key)
	have, primaryOn, nodes := resp.Keys[b64], resp.PrimaryKeys[b64], resp.NumResp-resp.NumErr
	switch {
	case op == opUse && have < nodes:
		return errKeyringRefused{error: fmt.Errorf("key %s is on %d of %d nodes: a node without it could not read the others once they encrypt with it; install it on every node first (POST /lbx/cluster/keys/install)", rep.Key, have, nodes)}
	case op == opRemove && have == 0:
		return errKeyringRefused{error: fmt.Errorf("no node has key %s: nothing to remove (GET /lbx/cluster/keys lists the fingerprints)", rep.Key), status: http.StatusNotFound}
	case op == opRemove && primaryOn > 0:
		return errKeyringRefused{error: fmt.Errorf("key %s is the primary key of %d of %d nodes, which encrypt their gossip with it: make another key the primary everywhere first (POST /lbx/cluster/keys/use), then remove it", rep.Key, primaryOn, nodes)}
	}
	return nil
}

// localKeyOp runs op on this node's keyring alone: list, install, use.
func (m *member) localKeyOp(op keyringOp, key []byte, rep keyringReport) (keyringReport, error) {
	rep.Nodes, rep.Responses = 1, 1
	var err error
	switch op {
	case opRemove:
		return rep, errKeyringRefused{error: errors.New("local=1 applies to list, install and use: remove keys cluster-wide (without local), once every node uses another primary"), status: http.StatusBadRequest}
	case opInstall:
		err = m.keyring.AddKey(key)
	case opUse:
		if !hasKey(m.keyring.GetKeys(), key) {
			return rep, errKeyringRefused{error: fmt.Errorf("key %s is not in this node's keyring: install it first (POST /lbx/cluster/keys/install?local=1)", rep.Key)}
		}
		err = m.keyring.UseKey(key)
	}
	if err != nil {
		err = fmt.Errorf("%s key %s on this node: %v", op, rep.Key, err)
		rep.Errors = append(rep.Errors, keyringNodeError{Node: m.name, Message: err.Error()})
		return rep, err
	}
	primary := m.keyring.GetPrimaryKey()
	for _, k := range m.keyring.GetKeys() {
		kk := keyringKey{Fingerprint: keyID(k), Nodes: 1}
		if bytes.Equal(k, primary) {
			kk.PrimaryOn = 1
			rep.Primary = kk.Fingerprint
		}
		rep.Keys = append(rep.Keys, kk)
	}
	if op == opList {
		return rep, nil
	}
	m.logger.Warn("gossip keyring changed on this node alone (local=1)", zap.String("op", op.String()), zap.String("key", rep.Key),
		zap.String("keys", describeKeys(m.keyring)))
	return rep, nil
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
