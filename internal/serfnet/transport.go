package serfnet

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
//	[Magic] [Version] [body]
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
	// Magic starts every direct message. memberlist never starts a
	// packet with it: its first byte is a message type (0 to 13 in
	// memberlist 0.7, which adds them one at a time), an encryption version
	// (0 or 1) when gossip is encrypted, or its label marker (244).
	Magic byte = 'D'

	// Version is the version of the format above.
	Version byte = 1

	// SealOverhead is what AES-GCM adds: the nonce and the tag.
	SealOverhead = 12 + 16

	// QueueLen bounds the direct messages waiting for their handler,
	// per member: about 1.4 MB at most.
	QueueLen = 1024
)

// MaxPacket is the largest direct message on the wire, in bytes:
// memberlist's own UDP packet size, safe from IP fragmentation on common
// networks. The payload may take what the header (2 bytes), the sender's
// node name and its length byte, the kind byte and, with an encrypt_key,
// the 28 bytes of encryption leave of it.
const MaxPacket = 1400

// Result is what became of a direct message sent or received; its
// name is the metric's result label.
type Result uint8

const (
	OK Result = iota
	SendError
	Undecryptable
	Truncated
	TooLarge
	BadVersion
	BadName
	UnknownKind
	UnknownSender
	WrongSource
	QueueFull
	HandlerPanic
	NumResults // the number of results
)

// resultNames are the result labels of the metric.
var resultNames = [NumResults]string{
	OK:            "ok",
	SendError:     "send_error",
	Undecryptable: "dropped_undecryptable",
	Truncated:     "dropped_truncated",
	TooLarge:      "dropped_too_large",
	BadVersion:    "dropped_bad_version",
	BadName:       "dropped_bad_name",
	UnknownKind:   "dropped_unknown_kind",
	UnknownSender: "dropped_unknown_sender",
	WrongSource:   "dropped_wrong_source",
	QueueFull:     "dropped_queue_full",
	HandlerPanic:  "handler_panic",
}

// String returns the result's metric label.
func (r Result) String() string { return resultNames[r] }

// Transport is the transport a member's memberlist runs on: an inner
// transport (memberlist's own NetTransport in the cluster app, one that
// counts the traffic in the gossip benchmark), with direct messages taken
// out of the packets it receives and delivered to their handlers. The
// app's modules reach it through the cluster app's SendDirect and
// HandleDirect.
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
type Transport struct {
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

	sent, received [NumResults]atomic.Uint64

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

// Listen binds the member's gossip port as memberlist does when it
// creates its own transport (memberlist.newMemberlist without a
// Transport), wraps it, and sets it as the memberlist transport of conf.
// With port 0 it writes the port the kernel chose back to the bind and
// advertise ports, as memberlist does.
func Listen(conf *serf.Config, logger *zap.Logger) (*Transport, error) {
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
	return NewTransport(nt, conf, logger), nil
}

// NewTransport wraps inner, a memberlist transport that is bound
// already, for the serf member that conf configures: it sets itself as
// conf's memberlist transport, sends as conf's node name and encrypts
// with conf's keyring, if any. Call Deliver once serf runs, and
// Shutdown if serf.Create fails (serf shuts it down otherwise).
func NewTransport(inner memberlist.NodeAwareTransport, conf *serf.Config, logger *zap.Logger) *Transport {
	ml := conf.MemberlistConfig
	t := &Transport{
		NodeAwareTransport: inner,
		node:               conf.NodeName,
		keyring:            ml.Keyring,
		logger:             logger.Named("direct"),
		packets:            make(chan *memberlist.Packet),
		inbox:              make(chan *memberlist.Packet, QueueLen),
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
func (t *Transport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// Shutdown stops the inner transport and the goroutines of direct messages.
// memberlist calls it when it shuts down, before it stops reading
// PacketCh; it may be called again.
func (t *Transport) Shutdown() error {
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
func (t *Transport) pump() {
	defer close(t.pumpDone)
	for {
		select {
		case <-t.netDown:
			return
		case p := <-t.NodeAwareTransport.PacketCh():
			if len(p.Buf) > 0 && p.Buf[0] == Magic {
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
func (t *Transport) enqueue(p *memberlist.Packet) {
	if len(p.Buf) > MaxPacket {
		t.drop(TooLarge, p.From)
		return
	}
	// The NetTransport reads each packet into its own 64 KiB buffer: keep
	// only the bytes, so that a full queue holds 1.4 MB, not 64 MB.
	p.Buf = bytes.Clone(p.Buf)
	select {
	case t.inbox <- p:
	default:
		t.drop(QueueFull, p.From)
	}
}

// Deliver hands the queued direct messages to their handlers, one at a
// time, until the transport shuts down. sf is the member's serf, which
// knows the alive members. Run it in a goroutine of its own.
func (t *Transport) Deliver(sf *serf.Serf) {
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
func (t *Transport) receive(sf *serf.Serf, p *memberlist.Packet) {
	var keys [][]byte // nil: clear text
	if t.keyring != nil {
		// Read at each message: the keys may change.
		if keys = t.keyring.GetKeys(); keys == nil {
			keys = [][]byte{} // never clear text on an encrypted cluster
		}
	}
	from, kind, payload, res := Decode(p.Buf, keys)
	if res != OK {
		t.drop(res, p.From)
		return
	}
	h := t.handler(kind)
	if h == nil {
		t.drop(UnknownKind, p.From)
		return
	}
	if from == t.node {
		t.drop(UnknownSender, p.From)
		return
	}
	addr, ok := t.aliveAddr(sf, from)
	if !ok {
		t.drop(UnknownSender, p.From)
		return
	}
	if !sameSource(p.From, addr) {
		t.drop(WrongSource, p.From)
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
func (t *Transport) call(h *directHandler, from string, payload []byte) {
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		t.received[HandlerPanic].Add(1)
		level := zap.DebugLevel
		if !h.panicked.Swap(true) {
			level = zap.ErrorLevel // a bug: say it once, not at every message
		}
		if c := t.logger.Check(level, "direct message handler panicked"); c != nil {
			c.Write(zap.Uint8("kind", h.kind), zap.String("from", from), zap.Any("panic", r), zap.StackSkip("stack", 1))
		}
	}()
	h.fn(from, payload)
	t.received[OK].Add(1)
}

// drop counts a received direct message dropped for reason.
func (t *Transport) drop(reason Result, from net.Addr) {
	t.received[reason].Add(1)
	if c := t.logger.Check(zap.DebugLevel, "direct message dropped"); c != nil {
		c.Write(zap.Stringer("reason", reason), zap.Stringer("from", from))
	}
}

// Handle registers fn for kind, and returns the function that removes
// this registration (App.HandleDirect says how handlers are called).
func (t *Transport) Handle(kind byte, fn func(from string, payload []byte)) (cancel func()) {
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
func (t *Transport) handler(kind byte) *directHandler {
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
func (t *Transport) Send(sf *serf.Serf, to string, kind byte, payload []byte) error {
	err := t.sendTo(sf, to, kind, payload)
	if err != nil {
		t.sent[SendError].Add(1)
		if c := t.logger.Check(zap.DebugLevel, "direct message not sent"); c != nil {
			c.Write(zap.String("to", to), zap.Error(err))
		}
		return err
	}
	t.sent[OK].Add(1)
	return nil
}

// sendTo looks the member up and writes the message to it.
func (t *Transport) sendTo(sf *serf.Serf, to string, kind byte, payload []byte) error {
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
func (t *Transport) write(addr string, kind byte, payload []byte) error {
	var key []byte
	if t.keyring != nil {
		key = t.keyring.GetPrimaryKey()
	}
	pkt, err := Encode(t.node, kind, payload, key)
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
func (t *Transport) aliveAddr(sf *serf.Serf, name string) (netip.AddrPort, bool) {
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

// Encode returns the direct message from sender from, sealed with
// key unless key is nil.
func Encode(from string, kind byte, payload []byte, key []byte) ([]byte, error) {
	if from == "" || len(from) > MaxNodeName {
		return nil, fmt.Errorf("direct message: sender name of %d bytes; want 1 to %d", len(from), MaxNodeName)
	}
	size := 2 + 1 + len(from) + 1 + len(payload)
	if key != nil {
		size += SealOverhead
	}
	if size > MaxPacket {
		return nil, fmt.Errorf("direct message of %d bytes with a payload of %d; at most %d", size, len(payload), MaxPacket)
	}
	plain := make([]byte, 0, 1+len(from)+1+len(payload))
	plain = append(plain, byte(len(from)))
	plain = append(plain, from...)
	plain = append(plain, kind)
	plain = append(plain, payload...)
	return Seal(plain, key)
}

// Seal returns the direct message whose plaintext is plain: the header and
// plain, sealed with key unless key is nil.
func Seal(plain, key []byte) ([]byte, error) {
	header := []byte{Magic, Version}
	if key == nil {
		return append(header, plain...), nil
	}
	aead, err := directAEAD(key)
	if err != nil {
		return nil, err
	}
	pkt := make([]byte, 2, 2+SealOverhead+len(plain))
	copy(pkt, header)
	return aead.Seal(pkt, nil, plain, header), nil
}

// Decode decodes the direct message pkt. With non-nil keys the
// body must open with one of them; with nil keys it is clear text. res
// says why the message is dropped, or is OK. payload is part of pkt,
// or of a new buffer.
func Decode(pkt []byte, keys [][]byte) (from string, kind byte, payload []byte, res Result) {
	switch {
	case len(pkt) > MaxPacket:
		return "", 0, nil, TooLarge
	case len(pkt) < 2:
		return "", 0, nil, Truncated
	case pkt[0] != Magic || pkt[1] != Version:
		// The pump passes only packets that start with Magic.
		return "", 0, nil, BadVersion
	}
	body := pkt[2:]
	if keys != nil {
		if len(body) < SealOverhead {
			return "", 0, nil, Truncated
		}
		var ok bool
		if body, ok = openDirect(pkt[:2], body, keys); !ok {
			return "", 0, nil, Undecryptable
		}
	}
	if len(body) < 1 {
		return "", 0, nil, Truncated
	}
	n := int(body[0])
	if n == 0 || n > MaxNodeName {
		return "", 0, nil, BadName
	}
	if len(body) < 1+n+1 {
		return "", 0, nil, Truncated
	}
	return string(body[1 : 1+n]), body[1+n], body[2+n:], OK
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
	_ memberlist.NodeAwareTransport = (*Transport)(nil)
)

// Sent returns how many direct messages this transport sent with result
// r (OK or SendError).
func (t *Transport) Sent(r Result) uint64 { return t.sent[r].Load() }

// Received returns how many direct messages reached this transport with
// result r: OK, HandlerPanic, or why one was dropped.
func (t *Transport) Received(r Result) uint64 { return t.received[r].Load() }
