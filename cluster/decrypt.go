package cluster

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// memberlist logs every gossip packet or stream it cannot decrypt with
// any key of the keyring ("[ERR] memberlist: Decrypt packet failed: no
// installed keys could decrypt the message from=10.0.0.2:7946", or
// "Failed to receive …" / "Failed to read remote state …" for a stream):
// the sender encrypts with a key this node lacks, or this node with one
// the sender lacks. Serf then sees that member fail, which on its own
// says nothing about keys. decryptFailures turns those lines into a count
// per remote address, shown in the admin view, counted in
// caddy_lbx_cluster_decrypt_failures_total, and logged (rate-limited)
// with the commands that heal it.

// decryptFailureText is in every line memberlist logs for a message no
// key of the keyring decrypts (memberlist's security.go).
const decryptFailureText = "no installed keys could decrypt the message"

// Bounds of the decrypt failure record: remote addresses kept (the
// oldest is dropped beyond it), and the period of its log line.
const (
	maxDecryptSources  = 32
	decryptLogInterval = 30 * time.Second
)

// decryptFailures is a member's record of the gossip it could not
// decrypt.
type decryptFailures struct {
	total atomic.Uint64

	mu      sync.Mutex
	sources map[string]*decryptSource // by remote address
	logged  time.Time                 // of the last log line
	since   int                       // failures since that line
}

// decryptSource is one remote address's failures.
type decryptSource struct {
	Addr  string    `json:"addr"`
	Count uint64    `json:"count"`
	Last  time.Time `json:"last"`
}

// decryptView is the admin view's decrypt_failures.
type decryptView struct {
	// Total counts every message this node could not decrypt since it
	// started.
	Total uint64 `json:"total"`
	// Sources are the remote addresses they came from, the latest first
	// (at most 32).
	Sources []decryptSource `json:"sources"`
	// Heal says how to make the keyrings agree again.
	Heal string `json:"heal"`
}

// decryptAddr returns the remote address of a memberlist line about a
// message no key decrypts, and whether the line is one.
func decryptAddr(line string) (string, bool) {
	if !strings.Contains(line, decryptFailureText) {
		return "", false
	}
	_, rest, ok := strings.Cut(line, "from=")
	if !ok {
		return "unknown", true
	}
	addr, _, _ := strings.Cut(rest, " ")
	return addr, true
}

// record counts one failure from addr at now, and reports whether the
// log line is due (and how many failures it covers).
func (d *decryptFailures) record(addr string, now time.Time) (logNow bool, n int) {
	d.total.Add(1)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sources == nil {
		d.sources = make(map[string]*decryptSource)
	}
	s := d.sources[addr]
	if s == nil {
		if len(d.sources) >= maxDecryptSources {
			var oldest *decryptSource
			for _, o := range d.sources {
				if oldest == nil || o.Last.Before(oldest.Last) {
					oldest = o
				}
			}
			delete(d.sources, oldest.Addr)
		}
		s = &decryptSource{Addr: addr}
		d.sources[addr] = s
	}
	s.Count++
	s.Last = now
	d.since++
	if !d.logged.IsZero() && now.Sub(d.logged) < decryptLogInterval {
		return false, 0
	}
	d.logged, n, d.since = now, d.since, 0
	return true, n
}

// view returns the record, or nil when nothing failed.
func (d *decryptFailures) view(heal string) *decryptView {
	total := d.total.Load()
	if total == 0 {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	v := &decryptView{Total: total, Sources: make([]decryptSource, 0, len(d.sources)), Heal: heal}
	for _, s := range d.sources {
		v.Sources = append(v.Sources, *s)
	}
	slices.SortFunc(v.Sources, func(a, b decryptSource) int { return b.Last.Compare(a.Last) })
	return v
}

// decryptHeal is what heals a decrypt failure, for the log and the view.
const decryptHeal = "the keyrings disagree: compare `curl localhost:2019/lbx/cluster/keys` on a healthy node with this node's keys; " +
	"on the node that lacks the cluster's primary key, install it and use it there alone: " +
	`curl -X POST 'localhost:2019/lbx/cluster/keys/install?local=1' -H 'Content-Type: application/json' -d '{"key":"<the cluster's primary key, base64>"}' ` +
	"and then the same on /lbx/cluster/keys/use?local=1 (localhost:2019 stands for that node's admin address); " +
	"put the key first in that node's encrypt_keys too, so that a restart keeps it"

// decryptFailed records a message from addr that no key decrypted, and
// logs it at most every decryptLogInterval.
func (m *member) decryptFailed(addr string) {
	logNow, n := m.decrypt.record(addr, time.Now())
	if !logNow {
		return
	}
	m.logger.Error("cannot decrypt gossip from a member: it encrypts with a key this node does not have (or the reverse, seen there), and serf will see it fail",
		zap.String("from", addr), zap.Int("failures_since_last_line", n), zap.String("this_node_keys", describeKeys(m.keyring)),
		zap.String("heal", decryptHeal))
}
