package handoff

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// genServer is one config generation's HTTP server, set up as Caddy's is
// (HTTP/1 and cleartext HTTP/2), that keeps the connections it served.
type genServer struct {
	*http.Server
	mu    sync.Mutex
	conns []net.Conn
}

// serveGen serves l with handler h in a new genServer, shut down (at the
// latest) at the end of the test. onState, if given, sees the
// connections' states too.
func serveGen(t *testing.T, l net.Listener, h http.HandlerFunc, onState ...func(net.Conn, http.ConnState)) *genServer {
	t.Helper()
	s := &genServer{Server: &http.Server{Handler: h}}
	s.Protocols = new(http.Protocols)
	s.Protocols.SetHTTP1(true)
	s.Protocols.SetUnencryptedHTTP2(true)
	s.ConnState = func(c net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
		}
		for _, f := range onState {
			f(c, st)
		}
	}
	go s.Serve(l)
	t.Cleanup(func() { s.Close() })
	return s
}

// handed counts the connections of s that went to another server.
func (s *genServer) handed() (handed, all int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.conns {
		if hc, ok := c.(*conn); ok && hc.handed.Load() {
			handed++
		}
	}
	return handed, len(s.conns)
}

// shutdown shuts s down as Caddy stops an old config's server, and waits
// for it, within 10 s.
func (s *genServer) shutdown(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Errorf("shutting down: %v", err)
	}
}

// answerGen answers every request with gen and the request's body.
func answerGen(gen int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%d %s", gen, body)
	}
}

// client is an HTTP/1.1 client on one connection that never sends a
// request again: a request whose response does not come in full fails.
type client struct {
	c  net.Conn
	br *bufio.Reader
}

func dialClient(t *testing.T, addr string) *client {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &client{c: c, br: bufio.NewReader(c)}
}

// post sends a POST with body and returns the response's body, and
// whether the server said it closes the connection.
func (cl *client) post(body string) (answer string, closes bool, err error) {
	cl.c.SetDeadline(time.Now().Add(10 * time.Second))
	req := fmt.Sprintf("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if _, err := io.WriteString(cl.c, req); err != nil {
		return "", false, err
	}
	res, err := http.ReadResponse(cl.br, nil)
	if err != nil {
		return "", false, err
	}
	b, err := io.ReadAll(res.Body)
	res.Body.Close()
	return string(b), res.Close, err
}

// mustPost posts body and wants the answer of generation gen.
func (cl *client) mustPost(t *testing.T, body string, gen int) {
	t.Helper()
	got, _, err := cl.post(body)
	if want := fmt.Sprintf("%d %s", gen, body); err != nil || got != want {
		t.Fatalf("POST %q: %q, %v; want %q", body, got, err, want)
	}
}

// TestReloadsLoseNoKeptAlivePOST reloads an HTTP server the way Caddy does
// (the new server on its own socket, then Shutdown of the old one) under
// clients that each keep one connection and send POSTs on it, one after
// the other, never again: every POST must be answered, and reach a handler
// once. Some responses are written in two parts, so that a reload finds
// them in progress. It runs with the server on lbx_handoff's listener, and
// on a wrapper after it (as rebalance's is), whose connections forward
// Close.
func TestReloadsLoseNoKeptAlivePOST(t *testing.T) {
	t.Run("direct", func(t *testing.T) { testReloadsKeptAlivePOST(t, func(l net.Listener) net.Listener { return l }) })
	t.Run("behind a wrapper", func(t *testing.T) {
		testReloadsKeptAlivePOST(t, func(l net.Listener) net.Listener { return forwardingListener{l} })
	})
}

// forwardingListener is a listener wrapper whose connections forward
// every call.
type forwardingListener struct{ net.Listener }

func (l forwardingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return forwardingConn{c}, nil
}

type forwardingConn struct{ net.Conn }

func (c forwardingConn) Close() error { return c.Conn.Close() }

func testReloadsKeptAlivePOST(t *testing.T, wrap func(net.Listener) net.Listener) {
	const clients, reloads = 16, 30
	var (
		seenMu sync.Mutex
		seen   = map[string]int{}
	)
	handler := func(gen int) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			id := string(body)
			seenMu.Lock()
			seen[id]++
			seenMu.Unlock()
			answer := fmt.Sprintf("%d %s", gen, id)
			if n, _ := strconv.Atoi(id[strings.IndexByte(id, '-')+1:]); n%4 == 0 {
				// Half the response now, the rest after a moment.
				w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
				io.WriteString(w, answer[:len(answer)/2])
				w.(http.Flusher).Flush()
				time.Sleep(time.Millisecond)
				io.WriteString(w, answer[len(answer)/2:])
				return
			}
			io.WriteString(w, answer)
		}
	}

	first := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := first.Addr().String()
	current := serveGen(t, wrap(first), handler(0))

	var (
		sent, answered, reused, failed, newResets atomic.Int64
		lastErr                                   atomic.Value
		wg                                        sync.WaitGroup
	)
	stop := make(chan struct{})
	for i := range clients {
		wg.Go(func() {
			var cl *client
			fresh := false
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if cl == nil {
					c, err := net.Dial("tcp", addr)
					if errors.Is(err, syscall.ECONNRESET) {
						newResets.Add(1) // as below
						continue
					}
					if err != nil {
						lastErr.Store(err.Error())
						failed.Add(1)
						return
					}
					defer c.Close()
					cl, fresh = &client{c: c, br: bufio.NewReader(c)}, true
				}
				id := fmt.Sprintf("%d-%d", i, n)
				sent.Add(1)
				got, closes, err := cl.post(id)
				switch {
				case err == nil && strings.HasSuffix(got, " "+id):
					answered.Add(1)
					if !fresh {
						reused.Add(1)
					}
				case fresh && (errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)):
					// The kernel resets what is still queued on the old
					// socket as it closes (a new connection; see
					// TestReloadsLoseNoRequest).
					newResets.Add(1)
					closes = true
				default:
					failed.Add(1)
					lastErr.Store(fmt.Sprintf("POST %s (reused %v): %q, %v", id, !fresh, got, err))
					closes = true
				}
				fresh = false
				if closes {
					cl.c.Close()
					cl = nil
				}
			}
		})
	}
	for gen := 1; gen <= reloads; gen++ {
		lbxtest.WaitFor(t, 20*time.Second, "requests between reloads", func() (bool, string) {
			n := answered.Load()
			return n >= int64(gen)*clients*4 || failed.Load() > 0, fmt.Sprintf("%d answered", n)
		})
		next := serveGen(t, wrap(attach(reusePortListen(t, addr))), handler(gen))
		current.shutdown(t)
		current = next
	}
	close(stop)
	wg.Wait()
	current.shutdown(t)

	seenMu.Lock()
	defer seenMu.Unlock()
	duplicated := 0
	for _, n := range seen {
		if n > 1 {
			duplicated++
		}
	}
	t.Logf("%d reloads: %d POSTs sent, %d answered (%d on reused connections), %d failed, %d new connections reset, %d duplicated, %d reached a handler",
		reloads, sent.Load(), answered.Load(), reused.Load(), failed.Load(), newResets.Load(), duplicated, len(seen))
	if failed.Load() > 0 || duplicated > 0 {
		t.Errorf("%d POSTs failed, %d reached a handler twice; want none (last failure: %v)", failed.Load(), duplicated, lastErr.Load())
	}
	if int64(len(seen)) < answered.Load() {
		t.Errorf("%d POSTs answered but %d reached a handler", answered.Load(), len(seen))
	}
}

// A kept-alive connection that is idle when the old server shuts down goes
// to the new server, which answers the POST sent on it next.
func TestIdleKeptAliveMovesOn(t *testing.T) {
	old := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := old.Addr().String()
	oldSrv := serveGen(t, old, answerGen(0))
	cl := dialClient(t, addr)
	cl.mustPost(t, "a", 0)

	newSrv := serveGen(t, attach(reusePortListen(t, addr)), answerGen(1))
	oldSrv.shutdown(t)
	if handed, all := oldSrv.handed(); handed != 1 || all != 1 {
		t.Fatalf("%d of the old server's %d connections handed over; want 1 of 1", handed, all)
	}
	cl.mustPost(t, "b", 1)
	cl.mustPost(t, "c", 1)
	newSrv.shutdown(t)
}

// instantConn is a socket on which a request arrives at the instant the
// server's pending read is cut short: the read that a deadline in the
// past ends returns it.
type instantConn struct {
	net.Conn
	arrives []byte
	armed   *atomic.Bool
	cut     atomic.Bool
}

func (c *instantConn) SetReadDeadline(t time.Time) error {
	if c.armed.Load() && !t.IsZero() && t.Before(time.Now()) && len(c.arrives) > 0 {
		c.cut.Store(true)
	}
	return c.Conn.SetReadDeadline(t)
}

func (c *instantConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n == 0 && c.cut.Load() && len(c.arrives) > 0 {
		n = copy(p, c.arrives)
		c.arrives = c.arrives[n:]
		return n, nil
	}
	return n, err
}

// instantListener gives instantConns whose request is req, once armed:
// before, net/http's own reads cut short (its background read) get
// nothing.
type instantListener struct {
	net.Listener
	req   string
	armed *atomic.Bool
}

func (l instantListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &instantConn{Conn: c, arrives: []byte(l.req), armed: l.armed}, nil
}

// A request that arrives as Shutdown closes the idle connection goes, with
// the connection, to the new server: the old one never sees it.
func TestRequestArrivingAtIdleCloseMovesOn(t *testing.T) {
	const arriving = "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\ninstant"
	raw := reusePortListen(t, "127.0.0.1:0")
	addr := raw.Addr().String()
	var (
		oldSaw atomic.Int64
		armed  atomic.Bool
	)
	old := attach(instantListener{raw, arriving, &armed})
	idle := make(chan struct{}, 1)
	oldSrv := serveGen(t, old, func(w http.ResponseWriter, r *http.Request) {
		oldSaw.Add(1)
		answerGen(0)(w, r)
	}, func(_ net.Conn, st http.ConnState) {
		if st == http.StateIdle {
			select {
			case idle <- struct{}{}:
			default:
			}
		}
	})
	cl := dialClient(t, addr)
	cl.mustPost(t, "a", 0)
	// Armed once the server waits for the next request.
	select {
	case <-idle:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection did not become idle in 10s")
	}
	armed.Store(true)

	// The same wrappers before lbx_handoff, or it would not hand over.
	newSrv := serveGen(t, attach(instantListener{reusePortListen(t, addr), "", new(atomic.Bool)}), answerGen(1))
	oldSrv.shutdown(t)
	if handed, _ := oldSrv.handed(); handed != 1 {
		t.Fatalf("%d connections handed over; want 1", handed)
	}
	// The response to the request that arrived comes first.
	res, err := http.ReadResponse(cl.br, nil)
	if err != nil {
		t.Fatalf("response to the request that arrived at the close: %v", err)
	}
	got, _ := io.ReadAll(res.Body)
	if string(got) != "1 instant" || oldSaw.Load() != 1 {
		t.Errorf("got %q, and the old server's handler ran %d times; want %q from the new server, and 1 (the first POST)", got, oldSaw.Load(), "1 instant")
	}
	cl.mustPost(t, "b", 1)
	newSrv.shutdown(t)
}

// A response in progress when Shutdown begins is finished by the old
// server; the connection then goes to the new server, which answers the
// next POST. A response that says Connection: close ends its connection,
// and so does one shorter than its Content-Length (after the wait for
// closeIdleConns, which does not come): its client sees it cut short, as
// without lbx_handoff, rather than wait for the rest.
func TestResponseInProgressThenMovesOn(t *testing.T) {
	for _, c := range []struct {
		name   string
		header string // set on the response in progress
		rest   string // the rest of its body
		moves  bool
	}{
		{"keep-alive", "", "slow!!", true},
		{"Connection: close", "close", "slow!!", false},
		{"short of its Content-Length", "", "sl", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			old := attach(reusePortListen(t, "127.0.0.1:0"))
			addr := old.Addr().String()
			flushed, release := make(chan struct{}), make(chan struct{})
			oldSrv := serveGen(t, old, func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				if c.header != "" {
					w.Header().Set("Connection", c.header)
				}
				w.Header().Set("Content-Length", "8")
				io.WriteString(w, "0 ")
				w.(http.Flusher).Flush()
				close(flushed)
				<-release
				io.WriteString(w, c.rest)
			})
			cl := dialClient(t, addr)
			errc := make(chan error, 1)
			go func() {
				got, closes, err := cl.post("slow")
				switch {
				case len(c.rest) < 6:
					if !errors.Is(err, io.ErrUnexpectedEOF) {
						err = fmt.Errorf("got %q, %v; want the body cut short", got, err)
					} else {
						err = nil
					}
				case err == nil && (got != "0 slow!!" || closes != !c.moves):
					err = fmt.Errorf("got %q, Connection: close %v", got, closes)
				}
				errc <- err
			}()
			<-flushed

			newSrv := serveGen(t, attach(reusePortListen(t, addr)), answerGen(1))
			shut := make(chan struct{})
			go func() { defer close(shut); oldSrv.shutdown(t) }()
			// Shutdown has begun once the old listener has left the hub.
			lbxtest.WaitFor(t, 10*time.Second, "the old listener to close", func() (bool, string) {
				newest, _ := old.hub.newest()
				old.hub.mu.Lock()
				n := len(old.hub.gens)
				old.hub.mu.Unlock()
				return n == 1 && newest != old, fmt.Sprintf("%d listeners", n)
			})
			close(release)
			if err := <-errc; err != nil {
				t.Fatalf("the response in progress: %v", err)
			}
			<-shut
			handed, _ := oldSrv.handed()
			if !c.moves {
				if handed != 0 {
					t.Fatalf("%d connections handed over after Connection: close; want none", handed)
				}
				if _, err := cl.br.ReadByte(); err == nil {
					t.Error("the connection stayed open after Connection: close")
				}
				return
			}
			if handed != 1 {
				t.Fatalf("%d connections handed over; want 1", handed)
			}
			cl.mustPost(t, "next", 1)
			newSrv.shutdown(t)
		})
	}
}

// A POST whose handler aborts (Caddy's abort: a panic with
// http.ErrAbortHandler) before it reads the body or writes is closed
// unanswered as without lbx_handoff, even with a newer server: it reached
// a handler, and must not reach another.
func TestAbortedPOSTStays(t *testing.T) {
	old := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := old.Addr().String()
	var oldSaw atomic.Int64
	oldSrv := serveGen(t, old, func(w http.ResponseWriter, r *http.Request) {
		if oldSaw.Add(1) > 1 {
			panic(http.ErrAbortHandler)
		}
		answerGen(0)(w, r)
	})
	cl := dialClient(t, addr)
	cl.mustPost(t, "a", 0)
	var newSaw atomic.Int64
	serveGen(t, attach(reusePortListen(t, addr)), func(w http.ResponseWriter, r *http.Request) {
		newSaw.Add(1)
		answerGen(1)(w, r)
	})
	if got, _, err := cl.post("b"); err == nil {
		t.Fatalf("the aborted POST was answered: %q", got)
	}
	if handed, _ := oldSrv.handed(); handed != 0 || oldSaw.Load() != 2 || newSaw.Load() != 0 {
		t.Errorf("%d connections handed over; the old handler saw %d requests, the new one %d; want 0, 2 and 0", handed, oldSaw.Load(), newSaw.Load())
	}
}

// Cleartext HTTP/2 connections stay with the old server, which ends them
// with GOAWAY after their streams.
func TestH2CStaysAndEnds(t *testing.T) {
	old := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := old.Addr().String()
	oldSrv := serveGen(t, old, answerGen(0))
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	post := func(body string) (string, int, error) {
		res, err := hc.Post("http://"+addr+"/", "text/plain", strings.NewReader(body))
		if err != nil {
			return "", 0, err
		}
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		return string(b), res.ProtoMajor, err
	}
	if got, proto, err := post("a"); err != nil || got != "0 a" || proto != 2 {
		t.Fatalf("h2c POST: %q, HTTP/%d, %v; want %q over HTTP/2", got, proto, err, "0 a")
	}
	newSrv := serveGen(t, attach(reusePortListen(t, addr)), answerGen(1))
	oldSrv.shutdown(t)
	if handed, all := oldSrv.handed(); handed != 0 || all != 1 {
		t.Fatalf("%d of %d h2c connections handed over; want 0 of 1", handed, all)
	}
	// The client opens a new connection, which the new server serves.
	if got, _, err := post("b"); err != nil || got != "1 b" {
		t.Errorf("h2c POST after the reload: %q, %v; want %q", got, err, "1 b")
	}
	newSrv.shutdown(t)
}

// A kept-alive TLS connection (lbx_handoff before tls) cannot move: its
// TLS state is the old config's. The old server closes it as before.
func TestKeptAliveTLSStays(t *testing.T) {
	_, _, cert := lbxtest.Cert(t)
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}}
	old := attach(reusePortListen(t, "127.0.0.1:0"))
	addr := old.Addr().String()
	oldSrv := serveGen(t, tls.NewListener(old, cfg), answerGen(0))
	c, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl := &client{c: c, br: bufio.NewReader(c)}
	cl.mustPost(t, "a", 0)
	serveGen(t, tls.NewListener(attach(reusePortListen(t, addr)), cfg), answerGen(1))
	oldSrv.shutdown(t)
	if handed, all := oldSrv.handed(); handed != 0 || all != 1 {
		t.Fatalf("%d of %d TLS connections handed over; want 0 of 1", handed, all)
	}
	if _, _, err := cl.post("b"); err == nil {
		t.Error("a POST on the old TLS connection was answered after the old server shut down")
	}
}

// The requests a connection follows: framing it cannot follow makes it
// stay.
func TestBodyLength(t *testing.T) {
	for _, c := range []struct {
		head string
		n    int64
		ok   bool
	}{
		{"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0, true},
		{"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 12\r\n\r\n", 12, true},
		{"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n", 3, true},
		{"POST / HTTP/1.0\r\nContent-Length: 3\r\n\r\n", 0, false},
		{"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 0, false},
		{"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 0, false},
		{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 0, false},
		{"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", 0, false},
		{"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n", 0, false},
		{"PRI * HTTP/2.0\r\n\r\n", 0, false},
		{"PROXY TCP4 127.0.0.1 127.0.0.1 1 2\r\nGET / HTTP/1.1\r\n\r\n", 0, false},
		{"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 0, false},
	} {
		n, ok := bodyLength([]byte(c.head))
		if n != c.n || ok != c.ok {
			t.Errorf("%q: %d, %v; want %d, %v", c.head, n, ok, c.n, c.ok)
		}
	}
}

// scriptConn returns its reads in turn; writes are discarded.
type scriptConn struct {
	net.Conn
	reads []string
}

func (c *scriptConn) Read(p []byte) (int, error) {
	if len(c.reads) == 0 {
		return 0, io.EOF
	}
	n := copy(p, c.reads[0])
	c.reads = c.reads[1:]
	return n, nil
}

func (c *scriptConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *scriptConn) SetReadDeadline(time.Time) error  { return nil }
func (c *scriptConn) SetWriteDeadline(time.Time) error { return nil }

// A connection follows its requests as net/http reads and answers them,
// and stays with its server when it cannot tell what the server holds.
func TestFollowRequests(t *testing.T) {
	const (
		post = "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab"
		get  = "GET / HTTP/1.1\r\nHost: x\r\n\r\n"
		res  = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
	)
	for _, c := range []struct {
		name  string
		steps []string // "r": read the next chunk; "w": write res; "W": write a response with Connection: close
		reads []string
		stays bool
		// the request being read: its first bytes, and whether answered
		cur      string
		answered bool
	}{
		{"one request", []string{"r", "w"}, []string{post}, false, "", true},
		{"body in a later read", []string{"r", "r", "w"}, []string{post[:len(post)-2], "ab"}, false, "", true},
		{"next request in a later read", []string{"r", "w", "r"}, []string{post, get[:5]}, false, get[:5], false},
		// net/http's background read caught the next request's first
		// byte after the response: the rest follows, nothing was lost.
		{"first byte by the background read", []string{"r", "w", "r", "r"}, []string{get, "G", get[1:]}, false, get, false},
		// ... but before the end of the response: pipelining.
		{"first byte before the response ends", []string{"r", "r", "w"}, []string{get, "G"}, true, "", false},
		{"two requests in a read", []string{"r"}, []string{post + get}, true, "", false},
		{"chunked", []string{"r"}, []string{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"}, true, "", false},
		{"TLS", []string{"r"}, []string{"\x16\x03\x01\x02\x00"}, true, "", false},
		{"h2c", []string{"r", "r"}, []string{"PRI * HTTP/2.0", "\r\n\r\nSM\r\n\r\n"}, true, "", false},
		{"headers too long", []string{"r"}, []string{"GET /" + strings.Repeat("x", maxHead) + " HTTP/1.1\r\n"}, true, "", false},
		{"a write within the headers", []string{"r", "w"}, []string{get[:10]}, true, "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			l := attach(ln)
			defer l.Close()
			hc := &conn{Conn: &scriptConn{reads: c.reads}, l: l}
			buf := make([]byte, 64<<10)
			for _, s := range c.steps {
				switch s {
				case "r":
					if _, err := hc.Read(buf); err != nil {
						t.Fatalf("read: %v", err)
					}
				case "w":
					hc.Write([]byte(res))
					hc.SetWriteDeadline(time.Time{})
				}
			}
			if hc.stays.Load() != c.stays {
				t.Fatalf("stays %v; want %v", hc.stays.Load(), c.stays)
			}
			if c.stays {
				return
			}
			if got := string(hc.req.bytes); !strings.HasPrefix(c.cur, got) || len(got) == 0 && c.cur != "" {
				t.Errorf("the request being read: %q; want the start of %q", got, c.cur)
			}
			if hc.req.answered != c.answered {
				t.Errorf("answered %v; want %v", hc.req.answered, c.answered)
			}
		})
	}
}
