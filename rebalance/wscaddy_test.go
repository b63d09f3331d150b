package rebalance

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/gorilla/websocket"

	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// streamSizes are the sizes of the messages the test backend streams, in
// turn: 7-bit, 16-bit and 64-bit frame lengths, and (with its 128 KiB
// write buffer) messages fragmented into several frames.
var streamSizes = []int{3, 125, 126, 4000, 70000, 300000, 0, 40}

// streamingBackend is a WebSocket server on 127.0.0.1 that streams
// messages to each client without pause until the connection ends:
// message i has size streamSizes[i%len] and every byte is byte(i).
func streamingBackend(t *testing.T) string {
	t.Helper()
	up := websocket.Upgrader{WriteBufferSize: 1 << 17}
	var wg sync.WaitGroup
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer conn.Close()
		gone := make(chan struct{})
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer close(gone)
			for {
				// Handles the client's close frame (and answers it).
				if _, _, err := conn.ReadMessage(); err != nil {
					return
				}
			}
		}()
		for i := 0; ; i++ {
			select {
			case <-gone:
				return
			default:
			}
			msg := make([]byte, streamSizes[i%len(streamSizes)])
			for j := range msg {
				msg[j] = byte(i)
			}
			if err := conn.WriteMessage(websocket.BinaryMessage, msg); err != nil {
				return
			}
		}
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close() // hijacked connections are the handlers' to close
		<-done
		wg.Wait()
	})
	return ln.Addr().String()
}

// wsClient reads a stream through Caddy and records how it ended.
type wsClient struct {
	conn     *websocket.Conn
	messages atomic.Int64
	bad      atomic.Value // string: a message that did not match
	err      error        // what ended the stream; set before done closes
	done     chan struct{}
}

func dialStream(t *testing.T, url string) *wsClient {
	t.Helper()
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	conn, resp, err := d.Dial(url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	resp.Body.Close()
	c := &wsClient{conn: conn, done: make(chan struct{})}
	conn.SetReadDeadline(time.Now().Add(60 * time.Second))
	go func() {
		defer close(c.done)
		for i := 0; ; i++ {
			_, msg, err := conn.ReadMessage()
			if err != nil {
				c.err = err
				return
			}
			if want := streamSizes[i%len(streamSizes)]; len(msg) != want || (want > 0 && (msg[0] != byte(i) || msg[want-1] != byte(i))) {
				c.bad.Store(fmt.Sprintf("message %d: %d bytes (first %v); want %d bytes of %d", i, len(msg), msg[:min(1, len(msg))], want, byte(i)))
			}
			c.messages.Add(1)
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-c.done
	})
	return c
}

// TestWebSocketShedThroughCaddy runs a real Caddy (rebalance app,
// rebalance_close, reverse_proxy) in front of a backend that streams
// large and small messages without pause, to real WebSocket clients; a
// second server has access logs on, which puts Caddy's own wrapper under
// the hijacked connection. 50 streams are shed, 10 at a time, through the
// process tracker's Shed (the node's path) while they stream, so that most
// sheds land inside a frame. Every client must get every message intact
// and then a well-formed close frame with code 1001, never a protocol
// error or a cut stream; Caddy logs no error.
func TestWebSocketShedThroughCaddy(t *testing.T) {
	backend := streamingBackend(t)
	plainPort, loggedPort, gossipPort := freePort(t), freePort(t), freePort(t)
	errLog := filepath.Join(t.TempDir(), "errors.log")
	route := fmt.Sprintf(`[{"handle": [{"handler": "rebalance_close"},
		{"handler": "reverse_proxy", "upstreams": [{"dial": %q}]}]}]`, backend)
	config := fmt.Sprintf(`{
		"admin": {"disabled": true},
		"logging": {"logs": {
			"default": {"writer": {"output": "file", "filename": %q}, "level": "ERROR", "exclude": ["http.log.access"]},
			"access": {"writer": {"output": "discard"}, "include": ["http.log.access"]}
		}},
		"apps": {
			"http": {"servers": {
				"plain": {"listen": ["127.0.0.1:%d"], "routes": %s},
				"logged": {"listen": ["127.0.0.1:%d"], "routes": %s, "logs": {}}
			}},
			"cluster": {"node_name": "ws-node", "bind": "127.0.0.1:%d"}, "rebalance": {"interval": "100ms", "history": "1s"}
		}
	}`, errLog, plainPort, route, loggedPort, route, gossipPort)
	if err := caddy.Load([]byte(config), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })
	tracker := runningConns(t).tracker
	lbxtest.WaitFor(t, 10*time.Second, "no connections left from earlier tests", func() (bool, string) {
		tracker.Sweep(0, 0)
		c := tracker.Counts()
		return c == (conntrack.Counts{}), fmt.Sprintf("%+v", c)
	})
	before := tracker.WebSocketCloses()

	const batches, perBatch = 5, 10
	rng := rand.New(rand.NewPCG(7, 11))
	var failures []string
	for b := range batches {
		clients := make([]*wsClient, perBatch)
		for i := range clients {
			port := plainPort
			if i%2 == 1 {
				port = loggedPort
			}
			clients[i] = dialStream(t, fmt.Sprintf("ws://127.0.0.1:%d/", port))
		}
		lbxtest.WaitFor(t, 20*time.Second, "every client streaming", func() (bool, string) {
			for i, c := range clients {
				if c.messages.Load() < int64(len(streamSizes)) {
					return false, fmt.Sprintf("client %d: %d messages", i, c.messages.Load())
				}
			}
			return true, ""
		})
		for range perBatch {
			if r := tracker.Shed(1); r != (ShedResult{Hijacked: 1}) {
				t.Fatalf("batch %d: Shed(1) = %+v; want one upgraded stream", b, r)
			}
			time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond) // vary where in the stream the next shed lands
		}
		for i, c := range clients {
			select {
			case <-c.done:
			case <-time.After(20 * time.Second):
				t.Fatalf("batch %d client %d: the stream did not end after the shed", b, i)
			}
			var ce *websocket.CloseError
			if !errors.As(c.err, &ce) || ce.Code != websocket.CloseGoingAway {
				failures = append(failures, fmt.Sprintf("batch %d client %d: ended with %v after %d messages; want close 1001", b, i, c.err, c.messages.Load()))
			}
			if bad, _ := c.bad.Load().(string); bad != "" {
				failures = append(failures, fmt.Sprintf("batch %d client %d: %s", b, i, bad))
			}
			c.conn.Close()
		}
	}
	for _, f := range failures {
		t.Error(f)
	}

	var got conntrack.WebSocketCloses
	lbxtest.WaitFor(t, 10*time.Second, "every shed stream counted", func() (bool, string) {
		now := tracker.WebSocketCloses()
		got = conntrack.WebSocketCloses{CloseFrame: now.CloseFrame - before.CloseFrame, AfterFrameEnd: now.AfterFrameEnd - before.AfterFrameEnd,
			WithoutFrame: now.WithoutFrame - before.WithoutFrame}
		return got.CloseFrame+got.WithoutFrame == batches*perBatch, fmt.Sprintf("%+v", got)
	})
	t.Logf("%d shed WebSockets: %d got a 1001 close frame, %d of them shed mid-frame (the frame was finished first); %d closed without a frame",
		batches*perBatch, got.CloseFrame, got.AfterFrameEnd, got.WithoutFrame)
	if got.CloseFrame != batches*perBatch || got.WithoutFrame != 0 {
		t.Errorf("close frames %d, without %d; want all %d with one", got.CloseFrame, got.WithoutFrame, batches*perBatch)
	}
	if got.AfterFrameEnd == 0 {
		t.Errorf("no shed landed inside a frame: the test did not exercise the mid-frame path")
	}
	lbxtest.WaitFor(t, 10*time.Second, "the shed streams forgotten", func() (bool, string) {
		c := tracker.Counts()
		return c.Hijacked == 0, fmt.Sprintf("%+v", c)
	})
	if logged, err := os.ReadFile(errLog); err != nil || len(strings.TrimSpace(string(logged))) > 0 {
		t.Errorf("Caddy's error log (%v):\n%s", err, logged)
	}
}
