package cluster

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"
)

// A key operation of the admin API changes every member's keyring through
// serf's key queries, which nothing orders: two operations asked on two
// nodes at once (use K on one, remove K on another) can leave members
// with keyrings that cannot read each other. So each install, use and
// remove first takes a lease on every member: the asking node takes its
// own, then asks every member with a serf query (keyLockQuery); each
// grants it when it holds no other node's unexpired lease, else answers
// busy with the holder. The operation runs only when every alive member
// granted; then (and on a refusal) the asking node releases the lease
// (keyUnlockQuery), and keyLeaseTTL frees a lease whose release is lost.

// The serf query names of the key lease.
const (
	keyLockQuery   = "lbx-keylock"
	keyUnlockQuery = "lbx-keyunlock"
)

// keyLeaseTTL is how long a member holds a granted lease without a
// release: longer than an operation takes (a list and a key query, each
// bounded by serf's query timeout of a few seconds).
const keyLeaseTTL = 30 * time.Second

// keyLease is one member's lease on key operations.
type keyLease struct {
	mu      sync.Mutex
	holder  string // node name; "" when free
	id      string // the operation's id
	op      string // what it is, for the busy answer ("use 1a2b3c4d")
	expires time.Time
}

// keyLockRequest is the payload of keyLockQuery and keyUnlockQuery.
type keyLockRequest struct {
	Holder string `json:"holder"`
	ID     string `json:"id"`
	Op     string `json:"op,omitempty"`
}

// keyLockAnswer is a member's answer to keyLockQuery.
type keyLockAnswer struct {
	Granted bool   `json:"granted"`
	Holder  string `json:"holder,omitempty"` // who holds it, when busy
	Op      string `json:"op,omitempty"`
}

// takeLocal takes the lease for an operation asked on this node: free or
// expired only (another operation asked here holds it otherwise).
func (l *keyLease) takeLocal(req keyLockRequest, now time.Time) keyLockAnswer {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holder != "" && now.Before(l.expires) && l.id != req.ID {
		return keyLockAnswer{Holder: l.holder, Op: l.op}
	}
	l.holder, l.id, l.op, l.expires = req.Holder, req.ID, req.Op, now.Add(keyLeaseTTL)
	return keyLockAnswer{Granted: true}
}

// grant answers another member's (or this one's own) lock query: granted
// when the lease is free, expired or already the asker's (its own local
// lease orders the asker's operations), else busy with the holder.
func (l *keyLease) grant(req keyLockRequest, now time.Time) keyLockAnswer {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holder != "" && now.Before(l.expires) && l.holder != req.Holder {
		return keyLockAnswer{Holder: l.holder, Op: l.op}
	}
	l.holder, l.id, l.op, l.expires = req.Holder, req.ID, req.Op, now.Add(keyLeaseTTL)
	return keyLockAnswer{Granted: true}
}

// release frees the lease if req's operation holds it.
func (l *keyLease) release(req keyLockRequest) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holder == req.Holder && l.id == req.ID {
		l.holder, l.id, l.op = "", "", ""
	}
}

// errKeyOpBusy is the refusal of a key operation while another holds the
// lease.
func errKeyOpBusy(holder, op string) error {
	what := "another key operation"
	if op != "" {
		what += " (" + op + ")"
	}
	return fmt.Errorf("%s is in progress (held by node %s); wait for it to end (at most %v) and try again", what, holder, keyLeaseTTL)
}

// newOpID returns a random operation id.
func newOpID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// lockKeys takes the key lease on every alive member for op ("use
// 1a2b3c4d"), and returns the release. It is refused (errKeyringRefused)
// when a member holds another node's lease, or when an alive member does
// not answer (twice): an operation that some member did not agree to
// could split the cluster.
func (m *member) lockKeys(op string) (release func(), err error) {
	req := keyLockRequest{Holder: m.name, ID: newOpID(), Op: op}
	if a := m.lease.takeLocal(req, time.Now()); !a.Granted {
		return nil, errKeyringRefused{error: errKeyOpBusy(a.Holder, a.Op)}
	}
	payload, _ := json.Marshal(req)
	release = func() {
		m.lease.release(req)
		// Wait for the members' answers (up to serf's query timeout), so
		// that an operation asked next on another node finds the lease
		// free; keyLeaseTTL frees a member whose answer is lost.
		_, _ = m.queryAll(keyUnlockQuery, payload, nil)
	}
	var missing []string
	for try := 0; try < 2; try++ {
		var busy *keyLockAnswer
		missing, busy, err = m.askLock(payload)
		if err == nil && busy != nil {
			err = errKeyringRefused{error: errKeyOpBusy(busy.Holder, busy.Op)}
		}
		if err != nil {
			release()
			return nil, err
		}
		if len(missing) == 0 {
			return release, nil
		}
	}
	release()
	return nil, errKeyringRefused{error: fmt.Errorf("could not take the key operation lease: no answer from %s (alive members must all agree before a key operation, lest it split the cluster); check those nodes and try again", strings.Join(missing, ", "))}
}

// askLock sends one lock query and returns the alive members that did not
// answer, or the first busy answer.
func (m *member) askLock(payload []byte) (missing []string, busy *keyLockAnswer, err error) {
	missing, err = m.queryAll(keyLockQuery, payload, func(from string, p []byte) bool {
		var a keyLockAnswer
		if json.Unmarshal(p, &a) != nil {
			return false
		}
		if !a.Granted {
			if a.Holder == "" {
				a.Holder = from
			}
			// Those that granted are freed by the release.
			busy = &a
			return true
		}
		return false
	})
	if err != nil {
		return nil, nil, fmt.Errorf("asking the members for the key operation lease: %v", err)
	}
	return missing, busy, nil
}

// queryAll sends a serf query to every member and reads the answers until
// every member alive when it was sent answered, the query times out, or
// stop (when not nil) returns true for an answer. It returns the alive
// members that did not answer.
func (m *member) queryAll(name string, payload []byte, stop func(from string, payload []byte) bool) ([]string, error) {
	want := map[string]bool{}
	for _, sm := range m.serf.Members() {
		if sm.Status == serf.StatusAlive {
			want[sm.Name] = true
		}
	}
	resp, err := m.serf.Query(name, payload, &serf.QueryParam{RelayFactor: keyringRelayFactor})
	if err != nil {
		return nil, err
	}
	defer resp.Close()
	for r := range resp.ResponseCh() {
		if stop != nil && stop(r.From, r.Payload) {
			return nil, nil
		}
		delete(want, r.From)
		if len(want) == 0 {
			return nil, nil
		}
	}
	missing := make([]string, 0, len(want))
	for name := range want {
		missing = append(missing, name)
	}
	slices.Sort(missing)
	return missing, nil
}

// keyEventBuffer is the capacity of the member's serf event channel:
// serf blocks on a full one, and member updates come in bursts.
const keyEventBuffer = 256

// eventLoop reads serf's events until serf shuts down (serf must never
// block on its event channel): it answers the key lease queries and
// drops the rest (the member list is read from serf itself).
func (m *member) eventLoop(ch <-chan serf.Event, shutdown <-chan struct{}) {
	defer m.events.Done()
	for {
		select {
		case <-shutdown:
			return
		case e := <-ch:
			if q, ok := e.(*serf.Query); ok {
				m.answerQuery(q)
			}
		}
	}
}

// answerQuery answers a key lease query; other queries are not lbx's.
func (m *member) answerQuery(q *serf.Query) {
	defer func() {
		if r := recover(); r != nil {
			m.logger.Error("panic answering a serf query", zap.String("query", q.Name), zap.Any("panic", r))
		}
	}()
	if q.Name != keyLockQuery && q.Name != keyUnlockQuery {
		return
	}
	var req keyLockRequest
	if err := json.Unmarshal(q.Payload, &req); err != nil || req.Holder == "" || req.ID == "" || len(req.Holder) > 1024 {
		return
	}
	var a keyLockAnswer
	if q.Name == keyUnlockQuery {
		m.lease.release(req)
		a.Granted = true // released
	} else {
		a = m.lease.grant(req, time.Now())
	}
	if !a.Granted && q.Name == keyLockQuery {
		m.logger.Info("refused a key operation lease: another one holds it",
			zap.String("asker", req.Holder), zap.String("asked", req.Op), zap.String("holder", a.Holder), zap.String("held_for", a.Op))
	}
	out, _ := json.Marshal(a)
	if err := q.Respond(out); err != nil {
		if c := m.logger.Check(zap.DebugLevel, "answering a key lease query"); c != nil {
			c.Write(zap.Error(err))
		}
	}
}
