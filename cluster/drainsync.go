package cluster

import (
	"bytes"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/drain"
	"github.com/caddy-lbx/lbx/internal/serfnet"
)

// Carrying the operator's drains and reweights (package drain) between
// members: with an ops_key, a change made through this node's admin
// endpoint is sent at once to every alive member, and every drainPushEvery
// the node sends part of its store (drainPushPackets datagrams, from a
// cursor that goes round it) to one random alive member, so that members
// that missed a datagram or joined later converge. Every entry is signed
// with the ops key, which is not the gossip key: a member that holds only
// the gossip key can neither make nor change a drain. A receiver keeps an
// entry only when its signature checks out and it is newer than what it
// holds; the rest are counted (GET /lbx/drains, /lbx/cluster).

// drainKind is the direct-message kind of drain entries (rebalance's
// averaging uses 1 to 4).
const drainKind byte = 16

// drainPushEvery is how often a node pushes its store to a random member.
const drainPushEvery = time.Second

// drainPushPackets bounds what one push sends: 4 datagrams of at most
// serfnet.MaxPacket, about 80 entries of short addresses.
const drainPushPackets = 4

// checkOpsKey checks ops_key as far as can be without the server's
// environment (a placeholder is checked once replaced, in Provision):
// base64 of 32 bytes, not all zero, and none of the gossip keys.
func (a *App) checkOpsKey() error {
	_, err := a.decodeOpsKey(false)
	return err
}

// decodeOpsKey decodes ops_key; nil when it is not set (or, with replace
// false, is a placeholder).
func (a *App) decodeOpsKey(replace bool) ([]byte, error) {
	value := a.OpsKey
	if value == "" {
		return nil, nil
	}
	if strings.Contains(value, "{") {
		if !replace {
			return nil, nil
		}
		value = caddy.NewReplacer().ReplaceAll(value, "")
		if value == "" {
			return nil, fmt.Errorf("ops_key %q is empty once placeholders are replaced (is the environment variable set?)", a.OpsKey)
		}
	}
	key, err := base64.StdEncoding.DecodeString(value)
	if err != nil {
		return nil, fmt.Errorf("ops_key: not valid base64: %v", err)
	}
	if len(key) != drain.KeySize {
		return nil, fmt.Errorf("ops_key: decodes to %d bytes; want %d (make one with `head -c32 /dev/urandom | base64`)", len(key), drain.KeySize)
	}
	if !bytes.ContainsFunc(key, func(r rune) bool { return r != 0 }) {
		return nil, errors.New("ops_key: decodes to 32 zero bytes, which is no secret; make one with `head -c32 /dev/urandom | base64`")
	}
	gossip, err := a.decodeKeys(replace)
	if err != nil {
		return nil, nil // the gossip keys' own check reports it
	}
	for _, g := range gossip {
		if subtle.ConstantTimeCompare(g, key) == 1 {
			return nil, fmt.Errorf("ops_key: the same key as a gossip key (fingerprint %s); the ops key must be another secret, so that a member holding the gossip key cannot drain", keyID(key))
		}
	}
	return key, nil
}

// drainSync carries one config's drains: started by the app's Start when
// it has an ops_key, stopped by its Stop.
type drainSync struct {
	app    *App
	key    []byte
	store  *drain.Store
	logger *zap.Logger

	mu      sync.Mutex
	pending []drain.Entry // local changes to send to every member
	cursor  int           // where the next push starts in the store

	kick   chan struct{}
	stop   chan struct{}
	done   chan struct{}
	cancel []func()
}

// startDrainSync registers the handler, subscribes to the store and
// starts the loop. The member must be running.
func startDrainSync(a *App, key []byte, store *drain.Store) (*drainSync, error) {
	s := &drainSync{
		app: a, key: key, store: store, logger: a.logger,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
	}
	cancel, err := a.HandleDirect(drainKind, s.receive)
	if err != nil {
		return nil, err
	}
	s.cancel = append(s.cancel, cancel, store.Subscribe(s.changed), store.Attach(a.member.name))
	go s.loop()
	return s, nil
}

// close stops the loop and undoes what start did; it may be called more
// than once.
func (s *drainSync) close() {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
	for _, c := range s.cancel {
		c()
	}
}

// changed is the store's hook: a local change is queued for every member.
func (s *drainSync) changed(c drain.Change) {
	if !c.Local {
		return
	}
	s.mu.Lock()
	if len(s.pending) < drain.MaxEntries {
		s.pending = append(s.pending, c.Entry)
	}
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// receive takes a peer's entries: each is merged when its signature
// checks out and it is newer; what is refused is counted.
func (s *drainSync) receive(from string, payload []byte) {
	entries, bad, err := drain.Decode(payload, s.key)
	if err != nil {
		s.store.CountDropped(1)
		if ce := s.logger.Check(zap.DebugLevel, "drain message refused"); ce != nil {
			ce.Write(zap.String("from", shownName(from)), zap.Error(err))
		}
		return
	}
	dropped := bad
	for _, e := range entries {
		if _, err := s.store.Merge(e); err != nil {
			dropped++
		}
	}
	if dropped > 0 {
		s.store.CountDropped(dropped)
		if ce := s.logger.Check(zap.DebugLevel, "drain entries refused: bad signature (another ops_key?) or out of bounds"); ce != nil {
			ce.Write(zap.String("from", shownName(from)), zap.Int("refused", dropped))
		}
	}
}

func (s *drainSync) loop() {
	defer close(s.done)
	defer func() {
		if r := recover(); r != nil {
			s.logger.Error("drain propagation stopped by a panic", zap.Any("panic", r))
		}
	}()
	t := time.NewTicker(drainPushEvery)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-s.kick:
			s.sendPending()
		case <-t.C:
			s.push()
		}
	}
}

// payloadLimit is the most payload bytes a direct message of this node
// carries.
func (s *drainSync) payloadLimit() int {
	return serfnet.MaxPacket - 2 - 1 - len(s.app.NodeName) - 1 - serfnet.SealOverhead
}

// alivePeers returns the names of the other alive members.
func (s *drainSync) alivePeers() []string {
	ms, err := s.app.Members()
	if err != nil {
		return nil
	}
	var names []string
	for _, m := range ms {
		if m.Status == StatusAlive && !m.Self {
			names = append(names, m.Name)
		}
	}
	return names
}

// sendPending sends the queued local changes to every alive member.
func (s *drainSync) sendPending() {
	s.mu.Lock()
	pending := s.pending
	s.pending = nil
	s.mu.Unlock()
	if len(pending) == 0 {
		return
	}
	peers := s.alivePeers()
	for len(pending) > 0 {
		msg, n := drain.Encode(pending, s.key, s.payloadLimit())
		if n == 0 {
			return // cannot happen: an entry is at most 430 bytes
		}
		pending = pending[n:]
		for _, p := range peers {
			s.send(p, msg)
		}
	}
}

// push sends part of the store to one random alive member.
func (s *drainSync) push() {
	all := s.store.Entries()
	if len(all) == 0 {
		return
	}
	peers := s.alivePeers()
	if len(peers) == 0 {
		return
	}
	to := peers[rand.IntN(len(peers))]
	s.mu.Lock()
	start := s.cursor % len(all)
	s.mu.Unlock()
	sent := 0
	for range drainPushPackets {
		if sent == len(all) {
			break
		}
		rest := make([]drain.Entry, 0, len(all)-sent)
		for k := sent; k < len(all); k++ {
			rest = append(rest, all[(start+k)%len(all)])
		}
		msg, n := drain.Encode(rest, s.key, s.payloadLimit())
		if n == 0 {
			break
		}
		s.send(to, msg)
		sent += n
	}
	s.mu.Lock()
	s.cursor = start + sent
	s.mu.Unlock()
}

func (s *drainSync) send(to string, msg []byte) {
	if err := s.app.SendDirect(to, drainKind, msg); err != nil {
		if ce := s.logger.Check(zap.DebugLevel, "drain message not sent"); ce != nil {
			ce.Write(zap.String("to", shownName(to)), zap.Error(err))
		}
	}
}
