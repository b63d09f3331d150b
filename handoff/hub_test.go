package handoff

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// reusePortListen opens a socket on addr with SO_REUSEPORT, as Caddy does
// for each config's listener.
func reusePortListen(t *testing.T, addr string) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		})
		return errors.Join(err, serr)
	}}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// acceptInto accepts from l into a channel until l is closed; the
// channel is closed then, with the error that ended it in *end.
func acceptInto(l net.Listener) (<-chan net.Conn, *error) {
	ch := make(chan net.Conn, 64)
	var end error
	go func() {
		defer close(ch)
		for {
			c, err := l.Accept()
			if err != nil {
				end = err
				return
			}
			ch <- c
		}
	}()
	return ch, &end
}

// dialTaken dials addr and waits up to 10 s for the server side to come
// out of taken, as who's. Both ends are closed at the end of the test.
func dialTaken(t *testing.T, addr string, taken <-chan net.Conn, who string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	select {
	case got := <-taken:
		got.Close()
	case <-time.After(10 * time.Second):
		t.Fatalf("%s took no connection in 10s", who)
	}
}

func TestNewestListenerTakesAll(t *testing.T) {
	old := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := old.Addr().String()
	oldConns, oldEnd := acceptInto(old)

	// Alone, the old listener takes what its socket accepts.
	dialTaken(t, addr, oldConns, "the only listener")

	// With a newer listener on the same address, the newer one takes
	// every connection, including those the old socket accepts.
	before := promtest.ToFloat64(handedOver)
	newer := attach(reusePortListen(t, addr))
	newConns, _ := acceptInto(newer)
	// Each dial lands on either socket (the kernel hashes it); dial until
	// the old socket has accepted one, bounded.
	dials := 0
	for ; dials < 200 && promtest.ToFloat64(handedOver) == before; dials++ {
		dialTaken(t, addr, newConns, "the newest listener")
	}
	if promtest.ToFloat64(handedOver) == before {
		t.Fatalf("after %d dials, none was accepted by the old socket and handed over", dials)
	}
	select {
	case got := <-oldConns:
		t.Fatalf("the old listener took %v while a newer one was open", got.RemoteAddr())
	default:
	}

	// The newer config fails to start: its listener closes, and the old
	// one takes connections again.
	if err := newer.Close(); err != nil {
		t.Fatal(err)
	}
	dialTaken(t, addr, oldConns, "the old listener, after the newer one closed,")

	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	for range oldConns {
	}
	if !errors.Is(*oldEnd, net.ErrClosed) {
		t.Errorf("Accept after Close: %v; want net.ErrClosed", *oldEnd)
	}
	hubsMu.Lock()
	n := len(hubs)
	hubsMu.Unlock()
	if n != 0 {
		t.Errorf("%d hubs left after every listener closed", n)
	}
}

// newServer returns an HTTP server that answers with gen and calls
// onRequest (if not nil) on each request. Like Caddy's, it serves
// cleartext HTTP/2 too, so net/http first reads only as much of a
// connection as could tell the HTTP/2 preface (14 bytes) and reads an
// HTTP/1 request's headers in two reads.
func newServer(gen int, onRequest func()) *http.Server {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if onRequest != nil {
			onRequest()
		}
		fmt.Fprint(w, gen)
	})}
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	return srv
}

// TestReloadsLoseNoRequest reloads an HTTP server the way Caddy does (the
// new server on its own socket, then Shutdown of the old one) 20 times
// under a stream of requests, each on a new connection. No request may be
// closed unanswered by a server that shuts down (EOF).
func TestReloadsLoseNoRequest(t *testing.T) {
	first := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := first.Addr().String()
	current := newServer(0, nil)
	go current.Serve(first)

	var (
		requests, eofs, resets, others atomic.Int64
		wg                             sync.WaitGroup
		lastErr                        atomic.Value
	)
	stop := make(chan struct{})
	for range 8 {
		wg.Go(func() {
			cl := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
			for {
				select {
				case <-stop:
					return
				default:
				}
				res, err := cl.Get("http://" + addr + "/")
				if err == nil {
					_, err = io.ReadAll(res.Body)
					res.Body.Close()
				}
				requests.Add(1)
				switch {
				case err == nil:
				case errors.Is(err, io.EOF):
					eofs.Add(1)
					lastErr.Store(err.Error())
				case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
					// The kernel resets what is still queued on the
					// old socket as it closes; lbx_handoff narrows that
					// window but cannot close it (tcp_migrate_req does).
					resets.Add(1)
				default:
					others.Add(1)
					lastErr.Store(err.Error())
				}
			}
		})
	}
	for gen := 1; gen <= 20; gen++ {
		lbxtest.WaitFor(t, 10*time.Second, "requests between reloads", func() (bool, string) {
			n := requests.Load()
			return n >= int64(gen)*50, fmt.Sprintf("%d requests", n)
		})
		// Caddy starts the new config's servers, then stops the old
		// config's: the old server shuts down once the new one serves.
		served := make(chan struct{})
		var once sync.Once
		next := newServer(gen, func() { once.Do(func() { close(served) }) })
		go next.Serve(attach(reusePortListen(t, addr)))
		select {
		case <-served:
		case <-time.After(10 * time.Second):
			t.Fatalf("generation %d served nothing in 10s", gen)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := current.Shutdown(ctx); err != nil {
			t.Errorf("shutting down generation %d: %v", gen-1, err)
		}
		cancel()
		current = next
	}
	close(stop)
	wg.Wait()
	current.Close()
	t.Logf("%d requests, %d EOF, %d reset, %d other; %v handed over in all", requests.Load(), eofs.Load(), resets.Load(), others.Load(), promtest.ToFloat64(handedOver))
	if eofs.Load() > 0 || others.Load() > 0 {
		t.Errorf("%d requests closed unanswered (EOF) and %d other failures; want none (last: %v)", eofs.Load(), others.Load(), lastErr.Load())
	}
}

// acceptOne takes one connection from l, within 10 s.
func acceptOne(t *testing.T, l net.Listener) net.Conn {
	t.Helper()
	ch, _ := acceptInto(l)
	select {
	case c := <-ch:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no connection accepted in 10s")
		return nil
	}
}

// TestDroppedRequestMovesOn drives a connection as net/http does when it
// reads a request after its shutdown began and closes it unanswered: the
// request and the socket go to the newer listener, which answers.
// Connections whose server read again or wrote stay closed.
func TestDroppedRequestMovesOn(t *testing.T) {
	const get = "GET / HTTP/1.1\r\nHost: x\r\n\r\n"
	for _, c := range []struct {
		name  string
		req   string
		reads []int          // the sizes of the old server's reads (0: the rest)
		after func(net.Conn) // what the old server does after them
		moves bool
	}{
		// net/http may leave deadlines on the socket; the newer server
		// must not inherit them.
		{"dropped", get, []int{0}, func(c net.Conn) { c.SetDeadline(time.Now()) }, true},
		// net/http's look for the HTTP/2 preface reads 14 bytes first.
		{"dropped, read in two", get, []int{14, 0}, func(net.Conn) {}, true},
		// A POST may have reached a handler that closed it unanswered.
		{"dropped POST", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", []int{0}, func(net.Conn) {}, false},
		{"wrote", get, []int{0}, func(c net.Conn) { c.Write([]byte("HTTP/1.1 400 Bad Request\r\n\r\n")) }, false},
		{"read again", get, []int{0}, func(c net.Conn) {
			c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
			c.Read(make([]byte, 1))
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			old := attach(reusePortListen(t, "127.0.0.1:0"))
			defer old.Close()
			addr := old.Addr().String()
			client, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			client.SetDeadline(time.Now().Add(10 * time.Second))
			req := c.req
			client.Write([]byte(req))
			sc := acceptOne(t, old)
			buf := make([]byte, 512)
			n := 0
			for _, size := range c.reads {
				if size == 0 {
					size = len(buf) - n
				}
				m, err := sc.Read(buf[n : n+size])
				if err != nil {
					t.Fatalf("old server's read: %v", err)
				}
				n += m
			}
			if string(buf[:n]) != req {
				t.Fatalf("old server read %q; want %q", buf[:n], req)
			}
			newer := attach(reusePortListen(t, addr))
			defer newer.Close()
			newConns, _ := acceptInto(newer)
			c.after(sc)
			sc.Close()

			if !c.moves {
				if _, err := io.ReadAll(client); err != nil && !errors.Is(err, syscall.ECONNRESET) {
					t.Fatalf("client: %v; want the connection closed", err)
				}
				select {
				case nc := <-newConns:
					t.Fatalf("the newer listener got %v", nc.RemoteAddr())
				default:
				}
				return
			}
			var nc net.Conn
			select {
			case nc = <-newConns:
			case <-time.After(10 * time.Second):
				t.Fatal("the newer listener got nothing in 10s")
			}
			n, err = nc.Read(buf)
			if err != nil || string(buf[:n]) != req {
				t.Fatalf("newer server's first read: %q %v; want the request again", buf[:n], err)
			}
			if _, err := nc.Write([]byte("HTTP/1.1 204 No Content\r\n\r\n")); err != nil {
				t.Fatalf("newer server's write: %v", err)
			}
			nc.Close()
			got, _ := io.ReadAll(client)
			if !strings.HasPrefix(string(got), "HTTP/1.1 204") {
				t.Errorf("client got %q; want the newer server's answer", got)
			}
		})
	}
}

// TestFailedSocketLeavesTheHub: when the newest listener's socket fails,
// its server stops serving, and the older listener takes connections again.
func TestFailedSocketLeavesTheHub(t *testing.T) {
	old := attach(reusePortListen(t, "127.0.0.1:0"))
	defer old.Close()
	addr := old.Addr().String()
	oldConns, _ := acceptInto(old)
	raw := reusePortListen(t, addr)
	newer := attach(raw)
	defer newer.Close()
	newConns, newEnd := acceptInto(newer)
	dialTaken(t, addr, newConns, "the newest listener")

	raw.Close() // the socket fails under the listener
	for range newConns {
	}
	if !errors.Is(*newEnd, net.ErrClosed) {
		t.Errorf("the failed listener's Accept: %v; want the socket's error", *newEnd)
	}
	dialTaken(t, addr, oldConns, "the old listener, after the newer one's socket failed,")
}
