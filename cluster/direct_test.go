package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/serfnet"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// Gossip keys of the tests: base64 of 32 bytes.
const (
	testGossipKey  = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=" // 0123456789abcdef…
	otherGossipKey = "ZmVkY2JhOTg3NjU0MzIxMGZlZGNiYTk4NzY1NDMyMTA=" // fedcba9876543210…
)

// directCluster starts n cluster apps named prefix-0 … prefix-(n-1) on
// 127.0.0.1, each with encrypt_key key (none when empty), the others
// joining the first, and waits until every one sees all n alive.
func directCluster(t *testing.T, prefix string, n int, key string) []*App {
	t.Helper()
	apps := make([]*App, n)
	for i := range n {
		apps[i] = testCluster(t, fmt.Sprintf("%s-%d", prefix, i), func(a *App) {
			a.EncryptKey = key
			if i > 0 {
				a.Join = []string{apps[0].gossipAddr()}
			}
		})
	}
	for _, a := range apps {
		waitAlive(t, a, n)
	}
	return apps
}

// waitAlive waits until a sees n alive members, itself included.
func waitAlive(t *testing.T, a *App, n int) {
	t.Helper()
	lbxtest.WaitFor(t, 15*time.Second, a.NodeName+" sees every member alive", func() (bool, string) {
		ms, err := a.Members()
		alive := 0
		for _, m := range ms {
			if m.Status == StatusAlive {
				alive++
			}
		}
		return alive == n, fmt.Sprintf("%d alive of %d, %v", alive, n, err)
	})
}

// waitTag waits until a sees member's tag key with value.
func waitTag(t *testing.T, a *App, member, key, value string) {
	t.Helper()
	lbxtest.WaitFor(t, 15*time.Second, a.NodeName+" sees the tag of "+member, func() (bool, string) {
		ms, _ := a.Members()
		for _, m := range ms {
			if m.Name == member && m.Tags[key] == value {
				return true, ""
			}
		}
		return false, "not yet"
	})
}

// directMsg is a direct message as a handler saw it.
type directMsg struct{ from, payload string }

// directBox records the direct messages of a handler.
type directBox struct {
	mu  sync.Mutex
	got []directMsg
}

func (b *directBox) add(from string, payload []byte) {
	b.mu.Lock()
	b.got = append(b.got, directMsg{from, string(payload)})
	b.mu.Unlock()
}

func (b *directBox) has(from, payload string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range b.got {
		if m.from == from && m.payload == payload {
			return true
		}
	}
	return false
}

func (b *directBox) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.got)
}

// listenDirectKind registers a handler of kind on a that records into a
// new box, until the end of the test.
func listenDirectKind(t *testing.T, a *App, kind byte) *directBox {
	t.Helper()
	box := new(directBox)
	cancel, err := a.HandleDirect(kind, box.add)
	if err != nil {
		t.Fatalf("HandleDirect on %s: %v", a.NodeName, err)
	}
	t.Cleanup(cancel)
	return box
}

// sendUntilReceived sends payload from from to to until to's box has it:
// datagrams may be lost, even on loopback.
func sendUntilReceived(t *testing.T, from, to *App, kind byte, payload string, box *directBox) {
	t.Helper()
	lbxtest.WaitFor(t, 10*time.Second, fmt.Sprintf("%s receives %.40q from %s", to.NodeName, payload, from.NodeName), func() (bool, string) {
		if box.has(from.NodeName, payload) {
			return true, ""
		}
		if err := from.SendDirect(to.NodeName, kind, []byte(payload)); err != nil {
			return false, err.Error()
		}
		return false, "not received yet"
	})
}

// received is the count of received direct messages of a's member with
// result r.
func received(a *App, r serfnet.Result) uint64 { return a.member.direct.Received(r) }

// dropped is the count of a's received direct messages that were
// dropped, for any reason.
func dropped(a *App) uint64 {
	var n uint64
	for r := range serfnet.NumResults {
		if r != serfnet.OK && r != serfnet.HandlerPanic {
			n += received(a, r)
		}
	}
	return n
}

// directSeries returns the value of caddy_lbx_cluster_direct_messages_total
// for node, direction and result, from one collection of the metrics
// collector; -1 when there is no such series.
func directSeries(t *testing.T, node, direction, result string) float64 {
	t.Helper()
	value := -1.0
	for _, s := range collect(t, descDirectMessages) {
		if s.labels["node"] == node && s.labels["direction"] == direction && s.labels["result"] == result {
			value = s.value
		}
	}
	return value
}

// TestDirectExchange: two and three real members, with and without an
// encrypt_key, send each other direct messages both ways, up to the
// largest payload that fits; serf keeps working on the wrapped transport
// (the members see each other, tags propagate); the metric counts.
func TestDirectExchange(t *testing.T) {
	for i, tc := range []struct {
		name string
		n    int
		key  string
	}{
		{"two members", 2, ""},
		{"two members, encrypted", 2, testGossipKey},
		{"three members", 3, ""},
		{"three members, encrypted", 3, testGossipKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			apps := directCluster(t, fmt.Sprintf("ex%d", i), tc.n, tc.key)
			boxes := make([]*directBox, len(apps))
			for j, a := range apps {
				boxes[j] = listenDirectKind(t, a, 1)
			}
			for j, from := range apps {
				for k, to := range apps {
					if j != k {
						sendUntilReceived(t, from, to, 1, "hello from "+from.NodeName, boxes[k])
					}
				}
			}
			// The largest payload that fits, and one byte more.
			overhead := 2 + 1 + len(apps[0].NodeName) + 1
			if tc.key != "" {
				overhead += serfnet.SealOverhead
			}
			largest := strings.Repeat("x", serfnet.MaxPacket-overhead)
			sendUntilReceived(t, apps[0], apps[1], 1, largest, boxes[1])
			if err := apps[0].SendDirect(apps[1].NodeName, 1, []byte(largest+"x")); err == nil {
				t.Errorf("a payload of %d bytes was sent; want an error above serfnet.MaxPacket", len(largest)+1)
			}
			// Tags still propagate through the wrapper.
			if err := apps[len(apps)-1].Publish("lbx_direct", "on"); err != nil {
				t.Fatal(err)
			}
			for _, a := range apps[:len(apps)-1] {
				waitTag(t, a, apps[len(apps)-1].NodeName, "lbx_direct", "on")
			}
			node := apps[0].NodeName
			if got := directSeries(t, node, "sent", "ok"); got < float64(tc.n) {
				t.Errorf("sent ok of %s: %v; want at least %d", node, got, tc.n)
			}
			if got := directSeries(t, node, "received", "ok"); got < float64(tc.n-1) {
				t.Errorf("received ok of %s: %v; want at least %d", node, got, tc.n-1)
			}
			if got := directSeries(t, node, "sent", "send_error"); got != 1 {
				t.Errorf("send_error of %s: %v; want 1 (the payload too large)", node, got)
			}
			if got := directSeries(t, node, "received", "send_error"); got != -1 {
				t.Errorf("a received send_error series exists: %v", got)
			}
			if got := directSeries(t, node, "received", "dropped_queue_full"); got != 0 {
				t.Errorf("dropped_queue_full of %s: %v; want a series at 0", node, got)
			}
		})
	}
}

// TestDirectWrongKey: a member with another key cannot deliver to the
// cluster (its messages are dropped as undecryptable and counted), and
// does not keep the others from exchanging theirs.
func TestDirectWrongKey(t *testing.T) {
	apps := directCluster(t, "key", 2, testGossipKey)
	a, b := apps[0], apps[1]
	boxA, boxB := listenDirectKind(t, a, 1), listenDirectKind(t, b, 1)
	stranger := testCluster(t, "key-stranger", func(s *App) {
		s.EncryptKey = otherGossipKey
		s.Join = []string{a.gossipAddr()}
	})
	listenDirectKind(t, stranger, 1)

	// It does not know b (it could not join), so SendDirect refuses; a
	// message written to b's address anyway is dropped there.
	if err := stranger.SendDirect(b.NodeName, 1, []byte("hi")); err == nil {
		t.Error("the stranger sent to a member it cannot know")
	}
	undecryptable := received(b, serfnet.Undecryptable)
	// (Sealed with the stranger's key and sent from a socket of the test's
	// own: b cannot open it, which it finds before it looks at the source.)
	pkt, err := serfnet.Encode(stranger.NodeName, 1, []byte("from the stranger"), mustDecodeKey(t, otherGossipKey))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("udp", b.gossipAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write(pkt); err != nil {
		t.Fatal(err)
	}
	lbxtest.WaitFor(t, 10*time.Second, "b drops the stranger's message", func() (bool, string) {
		got := received(b, serfnet.Undecryptable)
		return got == undecryptable+1, fmt.Sprintf("%d undecryptable", got)
	})
	if boxB.len() != 0 {
		t.Errorf("b's handler got %v", boxB.got)
	}

	sendUntilReceived(t, a, b, 1, "still here", boxB)
	sendUntilReceived(t, b, a, 1, "me too", boxA)
	waitAlive(t, a, 2)
	if ms, _ := a.Members(); len(ms) != 2 {
		t.Errorf("a knows %d members; want 2 (not the stranger)", len(ms))
	}
}

// TestDirectHostileDatagrams sends datagrams that start with the magic
// byte from a plain UDP socket to a member's gossip port: each is dropped
// and counted by reason, none reaches a handler or panics, serf keeps
// working, and a real message afterwards is delivered.
func TestDirectHostileDatagrams(t *testing.T) {
	for i, key := range []string{"", testGossipKey} {
		name := "plain text"
		if key != "" {
			name = "encrypted"
		}
		t.Run(name, func(t *testing.T) {
			apps := directCluster(t, fmt.Sprintf("hostile%d", i), 2, key)
			a, b := apps[0], apps[1]
			box := listenDirectKind(t, b, 1)
			var k []byte // nil without a key
			if len(b.keys) > 0 {
				k = b.keys[0]
			}
			conn, err := net.Dial("udp", b.gossipAddr())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()

			seal := func(body []byte) []byte {
				pkt, err := serfnet.Seal(body, k)
				if err != nil {
					t.Fatal(err)
				}
				return pkt
			}
			encode := func(from string, kind byte, payload string, key []byte) []byte {
				pkt, err := serfnet.Encode(from, kind, []byte(payload), key)
				if err != nil {
					t.Fatal(err)
				}
				return pkt
			}
			valid := encode(a.NodeName, 1, "not from a", k)
			cases := []struct {
				name string
				pkt  []byte
				want serfnet.Result
			}{
				{"magic byte only", []byte{serfnet.Magic}, serfnet.Truncated},
				{"header only", []byte{serfnet.Magic, serfnet.Version}, serfnet.Truncated},
				{"another version", append([]byte{serfnet.Magic, serfnet.Version + 1}, valid[2:]...), serfnet.BadVersion},
				{"too large", append([]byte{serfnet.Magic, serfnet.Version}, make([]byte, serfnet.MaxPacket)...), serfnet.TooLarge},
				{"huge name length", seal([]byte{255, 'x', 1, 'p'}), serfnet.BadName},
				{"empty name", seal([]byte{0, 1, 'p'}), serfnet.BadName},
				{"name longer than the packet", seal([]byte{50, 'x', 'y'}), serfnet.Truncated},
				{"no kind", seal([]byte{1, 'x'}), serfnet.Truncated},
				{"unknown kind", encode(a.NodeName, 99, "x", k), serfnet.UnknownKind},
				{"unknown sender", encode("ghost", 1, "boo", k), serfnet.UnknownSender},
				{"this node as sender", encode(b.NodeName, 1, "me?", k), serfnet.UnknownSender},
				// a's name, from a socket that is not a's gossip socket.
				{"a member's name from another address", encode(a.NodeName, 1, "i am a", k), serfnet.WrongSource},
			}
			if k != nil {
				cases = append(cases, []struct {
					name string
					pkt  []byte
					want serfnet.Result
				}{
					{"plain text on an encrypted cluster", encode(a.NodeName, 1, "clear text, as long as a sealed body", nil), serfnet.Undecryptable},
					{"another key", encode(a.NodeName, 1, "other", mustDecodeKey(t, otherGossipKey)), serfnet.Undecryptable},
					{"shorter than nonce and tag", valid[:2+serfnet.SealOverhead-1], serfnet.Truncated},
					{"last byte cut", valid[:len(valid)-1], serfnet.Undecryptable},
					{"a bit flipped", flipBit(valid, 20), serfnet.Undecryptable},
				}...)
			}
			for _, c := range cases {
				before := received(b, c.want)
				if _, err := conn.Write(c.pkt); err != nil {
					t.Fatal(err)
				}
				lbxtest.WaitFor(t, 10*time.Second, c.name+" dropped as "+c.want.String(), func() (bool, string) {
					got := received(b, c.want)
					return got == before+1, fmt.Sprintf("%d, was %d", got, before)
				})
			}

			// Random bytes after the magic byte, half with the right
			// version; in batches, so that the socket's buffer holds them.
			rng := rand.New(rand.NewPCG(1, uint64(i)))
			for batch := range 6 {
				before := dropped(b)
				const random = 50
				for j := range random {
					pkt := make([]byte, 1+rng.IntN(serfnet.MaxPacket))
					for n := range pkt {
						pkt[n] = byte(rng.Uint32())
					}
					pkt[0] = serfnet.Magic
					if j%2 == 0 && len(pkt) > 1 {
						pkt[1] = serfnet.Version
					}
					if _, err := conn.Write(pkt); err != nil {
						t.Fatal(err)
					}
				}
				lbxtest.WaitFor(t, 10*time.Second, fmt.Sprintf("every random packet of batch %d dropped", batch), func() (bool, string) {
					got := dropped(b) - before
					return got == random, fmt.Sprintf("%d dropped of %d", got, random)
				})
			}
			if box.len() != 0 {
				t.Fatalf("a hostile packet reached the handler: %v", box.got)
			}
			if n := received(b, serfnet.OK) + received(b, serfnet.HandlerPanic); n != 0 {
				t.Errorf("%d hostile packets counted as delivered", n)
			}

			// Serf and direct messages still work.
			if err := b.Publish("lbx_after", "1"); err != nil {
				t.Fatal(err)
			}
			waitTag(t, a, b.NodeName, "lbx_after", "1")
			waitAlive(t, a, 2)
			sendUntilReceived(t, a, b, 1, "a real one", box)
		})
	}
}

// mustDecodeKey decodes a base64 gossip key.
func mustDecodeKey(t *testing.T, key string) []byte {
	t.Helper()
	k, err := parseKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// flipBit returns a copy of b with one bit of byte i flipped.
func flipBit(b []byte, i int) []byte {
	c := bytes.Clone(b)
	c[i] ^= 1
	return c
}

// TestDirectQueueFull: while a handler blocks, the member's queue fills
// and the messages beyond it are dropped and counted; serf is not held up
// (tags still propagate both ways), and once the handler returns, the
// next message is delivered.
func TestDirectQueueFull(t *testing.T) {
	apps := directCluster(t, "full", 2, "")
	a, b := apps[0], apps[1]
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before the members stop: cleanups run last first
	box := new(directBox)
	cancel, err := b.HandleDirect(1, func(from string, payload []byte) {
		<-release
		box.add(from, payload)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()

	const sent = serfnet.QueueLen + 500
	for j := range sent {
		if err := a.SendDirect(b.NodeName, 1, fmt.Appendf(nil, "m%d", j)); err != nil {
			t.Fatal(err)
		}
	}
	lbxtest.WaitFor(t, 10*time.Second, "b drops messages on a full queue", func() (bool, string) {
		n := received(b, serfnet.QueueFull)
		return n > 0, fmt.Sprintf("%d dropped", n)
	})
	// Serf is not held up by the blocked handler.
	if err := b.Publish("lbx_busy", "yes"); err != nil {
		t.Fatal(err)
	}
	waitTag(t, a, b.NodeName, "lbx_busy", "yes")
	if err := a.Publish("lbx_busy", "too"); err != nil {
		t.Fatal(err)
	}
	waitTag(t, b, a.NodeName, "lbx_busy", "too")

	unblock()
	sendUntilReceived(t, a, b, 1, "after the jam", box)
	t.Logf("%d sent while blocked: %d delivered, %d dropped on a full queue", sent, box.len()-1, received(b, serfnet.QueueFull))
	if full := received(b, serfnet.QueueFull); full > sent-serfnet.QueueLen {
		t.Errorf("%d dropped on a full queue; want at most %d", full, sent-serfnet.QueueLen)
	}
}

// TestDirectHandlers: a newer registration of a kind supersedes the older
// until cancelled, cancel removes exactly its own registration (twice is
// harmless), a kind without handlers is dropped as unknown, a panicking
// handler is recovered and counted, and SendDirect and HandleDirect
// refuse what they cannot do.
func TestDirectHandlers(t *testing.T) {
	idle := &App{NodeName: "direct-idle", Bind: "127.0.0.1:0"}
	ctx, cancelCtx := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancelCtx()
	if err := idle.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := idle.HandleDirect(1, func(string, []byte) {}); !errors.Is(err, ErrNotRunning) {
		t.Errorf("HandleDirect before Start: %v; want ErrNotRunning", err)
	}
	if err := idle.SendDirect("x", 1, nil); !errors.Is(err, ErrNotRunning) {
		t.Errorf("SendDirect before Start: %v; want ErrNotRunning", err)
	}

	apps := directCluster(t, "handlers", 2, testGossipKey)
	a, b := apps[0], apps[1]
	older, newer := new(directBox), new(directBox)
	cancelOlder, err := b.HandleDirect(7, older.add)
	if err != nil {
		t.Fatal(err)
	}
	cancelNewer, err := b.HandleDirect(7, newer.add)
	if err != nil {
		t.Fatal(err)
	}
	sendUntilReceived(t, a, b, 7, "to the newer", newer)
	cancelNewer()
	sendUntilReceived(t, a, b, 7, "to the older", older)
	cancelNewer()
	sendUntilReceived(t, a, b, 7, "still the older", older)
	if newer.has(a.NodeName, "to the older") || newer.has(a.NodeName, "still the older") {
		t.Error("a cancelled handler was called")
	}
	cancelOlder()
	unknown := received(b, serfnet.UnknownKind)
	lbxtest.WaitFor(t, 10*time.Second, "a kind without handlers dropped", func() (bool, string) {
		if err := a.SendDirect(b.NodeName, 7, []byte("nobody")); err != nil {
			return false, err.Error()
		}
		got := received(b, serfnet.UnknownKind)
		return got > unknown, fmt.Sprintf("%d unknown kind", got)
	})

	// A panicking handler: recovered, counted, and the next message is
	// delivered.
	box := new(directBox)
	cancelPanic, err := b.HandleDirect(3, func(from string, payload []byte) {
		if string(payload) == "boom" {
			panic("handler bug")
		}
		box.add(from, payload)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cancelPanic()
	lbxtest.WaitFor(t, 10*time.Second, "a handler panic recovered and counted", func() (bool, string) {
		if err := a.SendDirect(b.NodeName, 3, []byte("boom")); err != nil {
			return false, err.Error()
		}
		n := received(b, serfnet.HandlerPanic)
		return n > 0, fmt.Sprintf("%d panics", n)
	})
	sendUntilReceived(t, a, b, 3, "after the panic", box)

	sendErrors := a.member.direct.Sent(serfnet.SendError)
	for _, c := range []struct {
		to      string
		payload []byte
	}{
		{a.NodeName, nil},
		{"nobody", nil},
		{b.NodeName, make([]byte, serfnet.MaxPacket)},
	} {
		if err := a.SendDirect(c.to, 1, c.payload); err == nil {
			t.Errorf("SendDirect to %q with %d bytes: no error", c.to, len(c.payload))
		}
	}
	if got := a.member.direct.Sent(serfnet.SendError) - sendErrors; got != 3 {
		t.Errorf("%d send errors counted; want 3", got)
	}
}

// TestDirectShutdown: stopping the members ends the transport's
// goroutines (and memberlist's listeners), and the members' API says
// they do not run.
func TestDirectShutdown(t *testing.T) {
	apps := directCluster(t, "shut", 2, testGossipKey)
	box := listenDirectKind(t, apps[1], 1)
	sendUntilReceived(t, apps[0], apps[1], 1, "before stopping", box)
	for _, a := range apps {
		if err := a.Stop(); err != nil {
			t.Fatal(err)
		}
	}
	for _, a := range apps {
		if err := a.SendDirect("x", 1, nil); !errors.Is(err, ErrNotRunning) {
			t.Errorf("SendDirect after Stop: %v; want ErrNotRunning", err)
		}
	}
	lbxtest.WaitFor(t, 10*time.Second, "the transports' goroutines end", func() (bool, string) {
		left := lbxtest.Goroutines("serfnet.(*Transport)", "memberlist.(*NetTransport)")
		return len(left) == 0, strings.Join(left, "\n\n")
	})
}

// TestDirectTransportReleasedWhenSerfFails: when serf refuses to start
// (here: tags above its limit), the transport newMember bound is shut
// down, its port free again.
func TestDirectTransportReleasedWhenSerfFails(t *testing.T) {
	port := freePort(t)
	s := &settings{name: "refused", logger: zap.NewNop(), tags: map[string]string{"big": strings.Repeat("x", 600)}}
	if m, err := newMember("refused", s, "127.0.0.1", port); err == nil {
		m.Destruct()
		t.Fatal("serf started with 600 bytes of tags")
	}
	udp, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
	if err != nil {
		t.Fatalf("the gossip port is still bound: %v", err)
	}
	udp.Close()
	lbxtest.WaitFor(t, 10*time.Second, "the transport's goroutines end", func() (bool, string) {
		left := lbxtest.Goroutines("serfnet.(*Transport)", "memberlist.(*NetTransport)")
		return len(left) == 0, strings.Join(left, "\n\n")
	})
}
