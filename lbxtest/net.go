package lbxtest

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
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

// SettleReload waits out what a config load into an in-process Caddy
// leaves racing, before a test's next request on client: the old config's
// server closes its keep-alive connections, and a POST sent on one as it
// closes fails and is not resent, so client's idle connections are
// dropped; and the old server's socket may still take a connection and
// reset it, so it waits until one socket listens on httpPort
// (WaitOneListener). A test harness calls it after every load, and
// WaitOneListener on the admin port before one.
func SettleReload(t testing.TB, client *http.Client, httpPort int) {
	t.Helper()
	client.CloseIdleConnections()
	WaitOneListener(t, httpPort, "HTTP")
}

// WaitOneListener waits, up to 5 s, until one socket at most listens on
// port, and logs it when two still do. After a reload Caddy stops the
// old config's servers without waiting for them, and until the old
// socket closes the kernel may hand it a new connection and reset it as
// it closes (SO_REUSEPORT): a test that connects right after a reload
// waits first. Linux only: elsewhere it returns at once.
func WaitOneListener(t testing.TB, port int, what string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		n, ok := ListenersOnPort(port)
		if !ok || n <= 1 {
			return
		}
	}
	t.Logf("two sockets still listen on the %s port %d after 5 s", what, port)
}

// ListenersOnPort counts the TCP sockets in state LISTEN on port, from
// /proc/net/tcp and tcp6; ok is false where those cannot be read.
func ListenersOnPort(port int) (n int, ok bool) {
	want := fmt.Sprintf(":%04X ", port)
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		ok = true
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fields := strings.Fields(line)
			// local_address is fields[1] (addr:PORT), st is fields[3]: 0A is LISTEN.
			if len(fields) > 3 && strings.HasSuffix(fields[1]+" ", want) && fields[3] == "0A" {
				n++
			}
		}
	}
	return n, ok
}
