package cluster

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"
)

// Direct messages are datagrams from this node to one named member, sent
// on the member's gossip socket: no port of their own, and one packet per
// message where a serf user event or query would reach every member.
//
// On the wire a direct message is
//
//	[directMagic] [directVersion] [body]
//
// and its plaintext is
//
//	[length of the sender's name: 1 byte] [sender's name] [kind: 1 byte] [payload]
//
// The body is the plaintext when the cluster has no encrypt_key. With one,
// it is the plaintext sealed with AES-GCM under the keyring's primary key:
// a random 12-byte nonce, the ciphertext and the 16-byte tag, with the two
// header bytes as additional data.
const (
	// directMagic starts every direct message. memberlist never starts a
	// packet with it: its first byte is a message type (0 to 13 in
	// memberlist 0.7, which adds them one at a time), an encryption version
	// (0 or 1) when gossip is encrypted, or its label marker (244).
	directMagic byte = 'D'

	// directVersion is the version of the format above.
	directVersion byte = 1

	// directSealOverhead is what AES-GCM adds: the nonce and the tag.
	directSealOverhead = 12 + 16

	// directQueueLen bounds the direct messages waiting for their handler,
	// per member: about 1.4 MB at most.
	directQueueLen = 1024
)

// MaxDirectPacket is the largest direct message on the wire, in bytes:
// memberlist's own UDP packet size, safe from IP fragmentation on common
// networks. The payload may take what the header (2 bytes), the sender's
// node name and its length byte, the kind byte and, with an encrypt_key,
// the 28 bytes of encryption leave of it.
const MaxDirectPacket = 1400

// directResult is what became of a direct message sent or received; its
// name is the metric's result label.
type directResult uint8

const (
	directOK directResult = iota
	directSendError
	directUndecryptable
	directTruncated
	directTooLarge
	directBadVersion
	directBadName
	directUnknownKind
	directUnknownSender
	directWrongSource
	directQueueFull
	directHandlerPanic
	directResults // the number of results
)

// directResultNames are the result labels of the metric.
var directResultNames = [directResults]string{
	directOK:            "ok",
	directSendError:     "send_error",
	directUndecryptable: "dropped_undecryptable",
	directTruncated:     "dropped_truncated",
	directTooLarge:      "dropped_too_large",
	directBadVersion:    "dropped_bad_version",
	directBadName:       "dropped_bad_name",
	directUnknownKind:   "dropped_unknown_kind",
	directUnknownSender: "dropped_unknown_sender",
	directWrongSource:   "dropped_wrong_source",
	directQueueFull:     "dropped_queue_full",
	directHandlerPanic:  "handler_panic",
}

// String returns the result's metric label.
func (r directResult) String() string { return directResultNames[r] }

// SendDirect sends payload to the alive member named to as one direct
// message of kind: a single UDP datagram on the gossip port, encrypted
// with the gossip key when the cluster has an encrypt_key. Delivery is
// best effort, as for any datagram: there is no acknowledgement or retry.
// The receiver drops a message whose kind it has no handler for (see
// HandleDirect), whose sender it does not know as alive, or that did not
// come from that member's gossip address (see DirectTransport).
//
// It returns an error when to is this node or no alive member of that
// name, when the message would exceed MaxDirectPacket, or when the write
// fails; it never waits on the network beyond that one write. It returns
// ErrNotRunning, or the name conflict, when the member does not run.
func (a *App) SendDirect(to string, kind byte, payload []byte) error {
	m := a.runningMember()
	if m == nil {
		return a.notRunning()
	}
	return m.direct.Send(m.serf, to, kind, payload)
}

// HandleDirect registers fn to handle the direct messages of kind that
// reach this node, with the sender's node name and the payload, which fn
// may keep. The handlers of a member are called one at a time, from one
// goroutine, so a slow handler delays the others; messages that arrive
// while 1024 are waiting are dropped (and counted). A panic in fn is
// recovered and logged.
//
// Handlers belong to the serf member, which outlives config reloads: the
// module that registers one must call cancel when its config stops.
// Registering a kind again supersedes the earlier handler until cancel
// removes the newer one (as a reload does, registering before the old
// config cancels); cancel removes exactly its own registration and may be
// called more than once.
//
// It returns ErrNotRunning, or the name conflict, when the member does not
// run: before the first config with the app starts (Caddy starts apps in
// no particular order, so register at first use, not in Start), and after
// it stopped. During a reload the new config's app already finds the
// running member.
func (a *App) HandleDirect(kind byte, fn func(from string, payload []byte)) (cancel func(), err error) {
	m := a.runningMember()
	if m == nil {
		return nil, a.notRunning()
	}
	return m.direct.Handle(kind, fn), nil
}

// DirectTransport is the transport a member's memberlist runs on: an
// inner transport (memberlist's own NetTransport in the app), with direct
// messages taken out of the packets it receives and delivered to their
// handlers. It is exported for the gossip benchmark, which builds its
// serf members as the app does (NewDirectTransport over a transport that
// counts the traffic); the app's modules use App.SendDirect and
// App.HandleDirect.
//
// A received message names its sender, and is delivered only when it
// came from that member's gossip address as serf knows it: a UDP
// datagram whose source IP and port are the IP and port the alive member
// of that name advertises. Sending writes from the gossip socket itself,
// bound to the gossip port, so an honest member's messages always carry
// its bind port; the name inside the payload alone (which any member
// with the key can write) ties a message to nobody. Behind NAT, or with
// an advertise address that is not the address packets leave from, the
// source does not match and messages are dropped as
// dropped_wrong_source: advertise the address peers see (what memberlist
// needs for its own probes anyway).
type DirectTransport struct {
	// The inner transport does all the work but PacketCh and Shutdown;
	// embedding it passes on everything memberlist may ask of it.
	memberlist.NodeAwareTransport

	node    string              // this member's name, the sender of what it sends
	keyring *memberlist.Keyring // nil: no encrypt_key, messages in clear text
	logger  *zap.Logger

	packets chan *memberlist.Packet // to memberlist: every packet but direct messages
	inbox   chan *memberlist.Packet // direct messages waiting for their handler

	mu       sync.Mutex
	handlers map[byte][]*directHandler // by kind, oldest first; the last is called

	// alive caches serf's alive members' gossip addresses by name, for
	// at most aliveCacheFor: serf lists its members by copying them all,
	// and a member of a large cluster sends and receives many direct
	// messages a second.
	aliveMu   sync.Mutex
	alive     map[string]netip.AddrPort
	aliveRead time.Time

	sent, received [directResults]atomic.Uint64

	closing      chan struct{} // closed when Shutdown starts
	netDown      chan struct{} // closed once the NetTransport has shut down
	pumpDone     chan struct{}
	shutdownOnce sync.Once
	shutdownErr  error
}

// directHandler is one registration of a handler.
type directHandler struct {
	kind     byte
	fn       func(from string, payload []byte)
	panicked atomic.Bool // logged at error level once, then at debug
}

// listenDirect binds the member's gossip port as memberlist does when it
// creates its own transport (memberlist.newMemberlist without a
// Transport), wraps it, and sets it as the memberlist transport of conf.
// With port 0 it writes the port the kernel chose back to the bind and
// advertise ports, as memberlist does.
func listenDirect(conf *serf.Config, logger *zap.Logger) (*DirectTransport, error) {
	ml := conf.MemberlistConfig
	nc := &memberlist.NetTransportConfig{
		BindAddrs: []string{ml.BindAddr},
		BindPort:  ml.BindPort,
		Logger:    ml.Logger,
		// serf.Create copies its metric labels to memberlist's config,
		// after this.
		MetricLabels: conf.MetricLabels,
	}
	// With port 0 the UDP listener takes the port the kernel gave the TCP
	// one, which another process may hold already: try again, as
	// memberlist does.
	tries := 1
	if ml.BindPort == 0 {
		tries = 10
	}
	var nt *memberlist.NetTransport
	var err error
	for range tries {
		if nt, err = memberlist.NewNetTransport(nc); err == nil {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("could not set up network transport: %v", err)
	}
	if ml.BindPort == 0 {
		port := nt.GetAutoBindPort()
		ml.BindPort = port
		ml.AdvertisePort = port
	}
	return NewDirectTransport(nt, conf, logger), nil
}

// NewDirectTransport wraps inner, a memberlist transport that is bound
// already, for the serf member that conf configures: it sets itself as
// conf's memberlist transport, sends as conf's node name and encrypts
// with conf's keyring, if any. Call Deliver once serf runs, and
// Shutdown if serf.Create fails (serf shuts it down otherwise).
func NewDirectTransport(inner memberlist.NodeAwareTransport, conf *serf.Config, logger *zap.Logger) *DirectTransport {
	ml := conf.MemberlistConfig
	t := &DirectTransport{
		NodeAwareTransport: inner,
		node:               conf.NodeName,
		keyring:            ml.Keyring,
		logger:             logger.Named("direct"),
		packets:            make(chan *memberlist.Packet),
		inbox:              make(chan *memberlist.Packet, directQueueLen),
		handlers:           make(map[byte][]*directHandler),
		closing:            make(chan struct{}),
		netDown:            make(chan struct{}),
		pumpDone:           make(chan struct{}),
	}
	go t.pump()
	ml.Transport = t
	return t
}

// PacketCh returns the packets for memberlist: all that the NetTransport
// receives but direct messages.
func (t *DirectTransport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// Shutdown stops the inner transport and the goroutines of direct messages.
// memberlist calls it when it shuts down, before it stops reading
// PacketCh; it may be called again.
func (t *DirectTransport) Shutdown() error {
	t.shutdownOnce.Do(func() {
		close(t.closing)
		// pump keeps reading the NetTransport's packets, which its
		// listeners wait to hand over before they end.
		t.shutdownErr = t.NodeAwareTransport.Shutdown()
		close(t.netDown)
		<-t.pumpDone
	})
	return t.shutdownErr
}

// pump reads every packet the NetTransport receives until it has shut
// down: direct messages go to the inbox, the others to memberlist,
// unchanged and in order.
func (t *DirectTransport) pump() {
	defer close(t.pumpDone)
	for {
		select {
		case <-t.netDown:
			return
		case p := <-t.NodeAwareTransport.PacketCh():
			if len(p.Buf) > 0 && p.Buf[0] == directMagic {
				t.enqueue(p)
				continue
			}
			select {
			case t.packets <- p:
			case <-t.closing: // memberlist is shutting down
			}
		}
	}
}

// enqueue queues a direct message for delivery, or drops it when the
// queue is full: the pump never waits on a handler.
func (t *DirectTransport) enqueue(p *memberlist.Packet) {
	if len(p.Buf) > MaxDirectPacket {
		t.drop(directTooLarge, p.From)
		return
	}
	// The NetTransport reads each packet into its own 64 KiB buffer: keep
	// only the bytes, so that a full queue holds 1.4 MB, not 64 MB.
	p.Buf = bytes.Clone(p.Buf)
	select {
	case t.inbox <- p:
	default:
		t.drop(directQueueFull, p.From)
	}
}

// Deliver hands the queued direct messages to their handlers, one at a
// time, until the transport shuts down. sf is the member's serf, which
// knows the alive members. Run it in a goroutine of its own.
func (t *DirectTransport) Deliver(sf *serf.Serf) {
	for {
		select {
		case <-t.closing:
			return
		case p := <-t.inbox:
			t.receive(sf, p)
		}
	}
}

// receive decodes a direct message and calls its kind's handler.
func (t *DirectTransport) receive(sf *serf.Serf, p *memberlist.Packet) {
	var keys [][]byte // nil: clear text
	if t.keyring != nil {
		// Read at each message: the keys may change.
		if keys = t.keyring.GetKeys(); keys == nil {
			keys = [][]byte{} // never clear text on an encrypted cluster
		}
	}
	from, kind, payload, res := decodeDirect(p.Buf, keys)
	if res != directOK {
		t.drop(res, p.From)
		return
	}
	h := t.handler(kind)
	if h == nil {
		t.drop(directUnknownKind, p.From)
		return
	}
	if from == t.node {
		t.drop(directUnknownSender, p.From)
		return
	}
	addr, ok := t.aliveAddr(sf, from)
	if !ok {
		t.drop(directUnknownSender, p.From)
		return
	}
	if !sameSource(p.From, addr) {
		t.drop(directWrongSource, p.From)
		return
	}
	t.call(h, from, payload)
}

// sameSource reports whether from, a received packet's source, is the
// gossip address addr: a UDP address with the same IP (IPv4-mapped IPv6
// addresses count as IPv4) and port. Anything else, a TCP address from
// memberlist's stream transport among them, is not.
func sameSource(from net.Addr, addr netip.AddrPort) bool {
	u, ok := from.(*net.UDPAddr)
	if !ok || u == nil {
		return false
	}
	src := u.AddrPort()
	return src.Addr().Unmap() == addr.Addr() && src.Port() == addr.Port()
}

// call calls the handler, and recovers and logs its panic.
func (t *DirectTransport) call(h *directHandler, from string, payload []byte) {
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		t.received[directHandlerPanic].Add(1)
		level := zap.DebugLevel
		if !h.panicked.Swap(true) {
			level = zap.ErrorLevel // a bug: say it once, not at every message
		}
		if c := t.logger.Check(level, "direct message handler panicked"); c != nil {
			c.Write(zap.Uint8("kind", h.kind), zap.String("from", from), zap.Any("panic", r), zap.StackSkip("stack", 1))
		}
	}()
	h.fn(from, payload)
	t.received[directOK].Add(1)
}

// drop counts a received direct message dropped for reason.
func (t *DirectTransport) drop(reason directResult, from net.Addr) {
	t.received[reason].Add(1)
	if c := t.logger.Check(zap.DebugLevel, "direct message dropped"); c != nil {
		c.Write(zap.Stringer("reason", reason), zap.Stringer("from", from))
	}
}

// Handle registers fn for kind, and returns the function that removes
// this registration (App.HandleDirect says how handlers are called).
func (t *DirectTransport) Handle(kind byte, fn func(from string, payload []byte)) (cancel func()) {
	h := &directHandler{kind: kind, fn: fn}
	t.mu.Lock()
	t.handlers[kind] = append(t.handlers[kind], h)
	t.mu.Unlock()
	return func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		hs := t.handlers[kind]
		for i, other := range hs {
			if other == h {
				hs = append(hs[:i:i], hs[i+1:]...)
				break
			}
		}
		if len(hs) == 0 {
			delete(t.handlers, kind)
		} else {
			t.handlers[kind] = hs
		}
	}
}

// handler returns the handler of kind, the last registered, or nil.
func (t *DirectTransport) handler(kind byte) *directHandler {
	t.mu.Lock()
	defer t.mu.Unlock()
	hs := t.handlers[kind]
	if len(hs) == 0 {
		return nil
	}
	return hs[len(hs)-1]
}

// Send sends a direct message to the alive member of sf named to, and
// counts it (App.SendDirect says what may fail).
func (t *DirectTransport) Send(sf *serf.Serf, to string, kind byte, payload []byte) error {
	err := t.sendTo(sf, to, kind, payload)
	if err != nil {
		t.sent[directSendError].Add(1)
		if c := t.logger.Check(zap.DebugLevel, "direct message not sent"); c != nil {
			c.Write(zap.String("to", to), zap.Error(err))
		}
		return err
	}
	t.sent[directOK].Add(1)
	return nil
}

// sendTo looks the member up and writes the message to it.
func (t *DirectTransport) sendTo(sf *serf.Serf, to string, kind byte, payload []byte) error {
	if to == t.node {
		return fmt.Errorf("direct message to %q: that is this node", to)
	}
	addr, ok := t.aliveAddr(sf, to)
	if !ok {
		return fmt.Errorf("direct message to %q: no alive member of that name", to)
	}
	return t.write(addr.String(), kind, payload)
}

// write encodes a direct message and writes it to the gossip address
// addr.
func (t *DirectTransport) write(addr string, kind byte, payload []byte) error {
	var key []byte
	if t.keyring != nil {
		key = t.keyring.GetPrimaryKey()
	}
	pkt, err := encodeDirect(t.node, kind, payload, key)
	if err != nil {
		return err
	}
	_, err = t.WriteTo(pkt, addr)
	return err
}

// aliveCacheFor is how long the alive members' addresses are cached: a
// member that joined or failed since is seen that much later, which
// best-effort messages can take.
const aliveCacheFor = 250 * time.Millisecond

// aliveAddr returns the gossip address of the alive member of sf named
// name, from a cache of serf's members (aliveCacheFor); a name it does
// not hold refreshes it at once, so a member that just joined is found.
func (t *DirectTransport) aliveAddr(sf *serf.Serf, name string) (netip.AddrPort, bool) {
	t.aliveMu.Lock()
	defer t.aliveMu.Unlock()
	now := time.Now()
	addr, ok := t.alive[name]
	if ok && now.Sub(t.aliveRead) < aliveCacheFor {
		return addr, true
	}
	if !ok && t.alive != nil && now.Sub(t.aliveRead) < aliveCacheFor/10 {
		return netip.AddrPort{}, false // refreshed a moment ago: not a member
	}
	clear(t.alive)
	if t.alive == nil {
		t.alive = make(map[string]netip.AddrPort)
	}
	for _, sm := range sf.Members() {
		if sm.Status != serf.StatusAlive {
			continue
		}
		if ip, ok := netip.AddrFromSlice(sm.Addr); ok {
			t.alive[sm.Name] = netip.AddrPortFrom(ip.Unmap(), sm.Port)
		}
	}
	t.aliveRead = now
	addr, ok = t.alive[name]
	return addr, ok
}

// encodeDirect returns the direct message from sender from, sealed with
// key unless key is nil.
func encodeDirect(from string, kind byte, payload []byte, key []byte) ([]byte, error) {
	if from == "" || len(from) > maxNodeName {
		return nil, fmt.Errorf("direct message: sender name of %d bytes; want 1 to %d", len(from), maxNodeName)
	}
	size := 2 + 1 + len(from) + 1 + len(payload)
	if key != nil {
		size += directSealOverhead
	}
	if size > MaxDirectPacket {
		return nil, fmt.Errorf("direct message of %d bytes with a payload of %d; at most %d", size, len(payload), MaxDirectPacket)
	}
	plain := make([]byte, 0, 1+len(from)+1+len(payload))
	plain = append(plain, byte(len(from)))
	plain = append(plain, from...)
	plain = append(plain, kind)
	plain = append(plain, payload...)
	return sealDirect(plain, key)
}

// sealDirect returns the direct message of body plain: the header and
// plain, sealed with key unless key is nil.
func sealDirect(plain, key []byte) ([]byte, error) {
	header := []byte{directMagic, directVersion}
	if key == nil {
		return append(header, plain...), nil
	}
	aead, err := directAEAD(key)
	if err != nil {
		return nil, err
	}
	pkt := make([]byte, 2, 2+directSealOverhead+len(plain))
	copy(pkt, header)
	return aead.Seal(pkt, nil, plain, header), nil
}

// decodeDirect decodes the direct message pkt. With non-nil keys the
// body must open with one of them; with nil keys it is clear text. res
// says why the message is dropped, or is directOK. payload is part of pkt,
// or of a new buffer.
func decodeDirect(pkt []byte, keys [][]byte) (from string, kind byte, payload []byte, res directResult) {
	switch {
	case len(pkt) > MaxDirectPacket:
		return "", 0, nil, directTooLarge
	case len(pkt) < 2:
		return "", 0, nil, directTruncated
	case pkt[0] != directMagic || pkt[1] != directVersion:
		// The pump passes only packets that start with directMagic.
		return "", 0, nil, directBadVersion
	}
	body := pkt[2:]
	if keys != nil {
		if len(body) < directSealOverhead {
			return "", 0, nil, directTruncated
		}
		var ok bool
		if body, ok = openDirect(pkt[:2], body, keys); !ok {
			return "", 0, nil, directUndecryptable
		}
	}
	if len(body) < 1 {
		return "", 0, nil, directTruncated
	}
	n := int(body[0])
	if n == 0 || n > maxNodeName {
		return "", 0, nil, directBadName
	}
	if len(body) < 1+n+1 {
		return "", 0, nil, directTruncated
	}
	return string(body[1 : 1+n]), body[1+n], body[2+n:], directOK
}

// openDirect opens the sealed body with the first of keys that can.
func openDirect(header, sealed []byte, keys [][]byte) ([]byte, bool) {
	for _, key := range keys {
		aead, err := directAEAD(key)
		if err != nil {
			continue
		}
		if plain, err := aead.Open(nil, nil, sealed, header); err == nil {
			return plain, true
		}
	}
	return nil, false
}

// directAEAD returns AES-GCM under key (16, 24 or 32 bytes), with a
// random nonce that Seal prepends to the ciphertext and Open reads from
// it.
func directAEAD(key []byte) (cipher.AEAD, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, errors.New("direct message: gossip key: " + err.Error())
	}
	return cipher.NewGCMWithRandomNonce(block)
}

// Interface guards
var (
	_ memberlist.NodeAwareTransport = (*DirectTransport)(nil)
)
