package testutil

import (
	"net"
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

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("finding a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
