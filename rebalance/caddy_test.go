package rebalance

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// runningConns returns the process's connections, which the running
// config uses.
func runningConns(t *testing.T) *processConns {
	t.Helper()
	c := loadedConns()
	if c == nil {
		t.Fatal("no config uses the process's connections")
	}
	return c
}

// TestCaddyWiring loads a real Caddy config (an HTTP server on loopback
// and the rebalance app), holds keep-alive connections to it, and checks
// that the tracker registered through Server.RegisterConnState counts
// them, that the node gossips them as its load, and that a reload with
// changed settings keeps the serf member and the counts.
func TestCaddyWiring(t *testing.T) {
	httpPort := freePort(t)
	gossipPort := freePort(t)
	config := func(threshold int) []byte {
		return fmt.Appendf(nil, `{
			"admin": {"disabled": true},
			"apps": {
				"http": {"servers": {"s": {
					"listen": ["127.0.0.1:%d"],
					"routes": [{"handle": [{"handler": "static_response", "body": "ok"}]}]
				}}},
				"cluster": {"node_name": "wired", "bind": "127.0.0.1:%d"}, "rebalance": {"interval": "100ms", "history": "100ms", "threshold": %d}
			}
		}`, httpPort, gossipPort, threshold)
	}
	if err := caddy.Load(config(20), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })
	tracker := runningConns(t).tracker
	base := tracker.Counts().Idle

	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range 3 {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", httpPort))
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		buf := make([]byte, 512)
		n, _ := c.Read(buf)
		if n == 0 {
			t.Fatal("no response")
		}
	}
	lbxtest.WaitFor(t, 5*time.Second, "3 idle connections tracked", func() (bool, string) {
		c := tracker.Counts()
		return c.Idle-base >= 3, fmt.Sprintf("%+v (before: %d)", c, base)
	})

	var n *node
	nodes.Range(func(k, v any) bool {
		if v.(*node).name == "wired" {
			n = v.(*node)
		}
		return true
	})
	if n == nil {
		t.Fatal("no node in the pool")
	}
	lbxtest.WaitFor(t, 5*time.Second, "the node gossips 3 connections", func() (bool, string) {
		tag := selfTags(n)[shed.LoadTag]
		_, load, _ := shed.ParseLoadTag(tag)
		return load >= 3, fmt.Sprintf("tag %q", tag)
	})

	// Reload with another threshold: same member, new settings.
	if err := caddy.Load(config(40), true); err != nil {
		t.Fatal(err)
	}
	var n2 *node
	nodes.Range(func(k, v any) bool {
		if v.(*node).name == "wired" {
			n2 = v.(*node)
		}
		return true
	})
	if n2 != n {
		t.Fatal("the reload replaced the serf member")
	}
	if runningConns(t).tracker != tracker {
		t.Fatal("the reload replaced the process's connection tracker")
	}
	if d := n.driver(); d == nil || d.params.Threshold != 0.4 {
		t.Fatalf("after the reload the node runs with %+v; want threshold 0.4", d)
	}
	// The connections of the old config's server are still held and
	// still counted (they close when the old server shuts them down or
	// the client goes). A new one goes to the new server once the old
	// one's socket has closed (CI saw a reset before).
	lbxtest.WaitOneListener(t, httpPort, "HTTP")
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", httpPort))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
}
