package lbxtest

import (
	"net"
	"sync"
	"testing"
	"time"
)

// TCPPair returns the two ends of a loopback TCP connection, closed when
// the test ends, with a 20 s deadline: the server end as accepted
// through wrap(listener) (wrap may be nil), and the client end.
func TCPPair(t testing.TB, wrap func(net.Listener) net.Listener) (server, client net.Conn) {
	t.Helper()
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := raw
	if wrap != nil {
		ln = wrap(raw)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	client, err = net.Dial("tcp", raw.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		client.Close()
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { server.Close(); client.Close() })
	deadline := time.Now().Add(20 * time.Second)
	server.SetDeadline(deadline)
	client.SetDeadline(deadline)
	return server, client
}

// handedOut holds the ports FreePort has returned in this process. The
// kernel may offer a port it just released to the next pick, and Caddy's
// listeners set SO_REUSEPORT, so two of a test's listeners given the same
// port would share it without an error (CI once saw a test's admin API
// answer on its site's port).
var handedOut sync.Map

// FreePort returns a port on 127.0.0.1 that was free for both TCP and UDP
// a moment ago (serf binds both) and that it has not returned before in
// this process.
func FreePort(t testing.TB) int {
	t.Helper()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("finding a free port: %v", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		pc, err := net.ListenPacket("udp", ln.Addr().String())
		ln.Close()
		if err != nil {
			continue
		}
		pc.Close()
		if _, seen := handedOut.LoadOrStore(port, true); !seen {
			return port
		}
	}
	t.Fatal("no fresh free port in 100 tries")
	return 0
}
