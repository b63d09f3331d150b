package fleet

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// serve runs h on a free loopback port until the test ends.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, IdleTimeout: time.Minute}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	})
	return ln.Addr().String()
}

// drop closes the request's connection without a response.
func drop(t *testing.T, w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		t.Errorf("hijack: %v", err)
		return
	}
	conn.Close()
}

// TestIDCounterFindsLostAndDuplicated: a RawClient sends x-0 … x-4 on one
// kept-alive connection to servers that misbehave on purpose, and the
// count at the backend finds each fault: a request dropped before the
// backend (lost, not reached), one dropped after it (lost, reached), one
// handled twice (duplicated), and nothing for a server that behaves.
func TestIDCounterFindsLostAndDuplicated(t *testing.T) {
	for _, c := range []struct {
		name  string
		fault func(t *testing.T, ctr *IDCounter, w http.ResponseWriter, id string) bool // true: handled
		want  IDCheck
		// failed is the id whose request must fail, with an EOF on its
		// reused connection.
		failed string
	}{
		{name: "behaves", fault: func(*testing.T, *IDCounter, http.ResponseWriter, string) bool { return false }},
		{name: "drops one", failed: "x-2", want: IDCheck{Lost: 1}, fault: func(t *testing.T, _ *IDCounter, w http.ResponseWriter, id string) bool {
			if id != "x-2" {
				return false
			}
			drop(t, w)
			return true
		}},
		{name: "serves one, then drops its response", failed: "x-3", want: IDCheck{Lost: 1, Reached: 1}, fault: func(t *testing.T, ctr *IDCounter, w http.ResponseWriter, id string) bool {
			if id != "x-3" {
				return false
			}
			ctr.Count(id)
			drop(t, w)
			return true
		}},
		{name: "handles one twice", want: IDCheck{Duplicated: 1}, fault: func(_ *testing.T, ctr *IDCounter, _ http.ResponseWriter, id string) bool {
			if id == "x-1" {
				ctr.Count(id) // and ServeHTTP counts it again
			}
			return false
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctr := NewIDCounter()
			addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !c.fault(t, ctr, w, r.Header.Get(IDHeader)) {
					ctr.ServeHTTP(w, r)
				}
			}))
			cl := &RawClient{Addr: addr, Timeout: 5 * time.Second}
			defer cl.Close()
			var lost []string
			for i := range 5 {
				id := fmt.Sprintf("x-%d", i)
				r := cl.Do(http.MethodPost, id, []byte("body"))
				if r.Err != nil {
					if r.Sent {
						lost = append(lost, id)
					}
					if id != c.failed || r.Kind != KindEOF || !r.Reused || r.Stale {
						t.Errorf("%s: %v (kind %s, reused %v, stale %v); want success", id, r.Err, r.Kind, r.Reused, r.Stale)
					}
				} else if id == c.failed {
					t.Errorf("%s succeeded; want an EOF", id)
				}
			}
			if got := ctr.Check("x", lost); got != c.want {
				t.Errorf("Check = %+v; want %+v", got, c.want)
			}
			wantOpened := 1
			if c.failed != "" && c.failed != "x-4" {
				wantOpened = 2 // the client opened a new connection after the failure
			}
			if cl.Opened() != wantOpened {
				t.Errorf("opened %d connections; want %d", cl.Opened(), wantOpened)
			}
		})
	}
}

// TestRawClientConnectionClose: a response with "Connection: close" is
// graceful: the client closes the connection, the next request opens a
// new one, and nothing fails.
func TestRawClientConnectionClose(t *testing.T) {
	ctr := NewIDCounter()
	addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(IDHeader) == "c-1" {
			w.Header().Set("Connection", "close")
		}
		ctr.ServeHTTP(w, r)
	}))
	cl := &RawClient{Addr: addr, Timeout: 5 * time.Second}
	defer cl.Close()
	for i := range 4 {
		id := fmt.Sprintf("c-%d", i)
		r := cl.Do(http.MethodGet, id, nil)
		if r.Err != nil {
			t.Fatalf("%s: %v", id, r.Err)
		}
		if r.Closed != (i == 1) || r.Reused != (i != 0 && i != 2) {
			t.Errorf("%s: closed %v, reused %v", id, r.Closed, r.Reused)
		}
		if ctr.Seen(id) != 1 {
			t.Errorf("%s seen %d times at the backend; want 1", id, ctr.Seen(id))
		}
	}
	if cl.Opened() != 2 {
		t.Errorf("opened %d connections; want 2", cl.Opened())
	}
}

func TestFailureKind(t *testing.T) {
	op := func(err error) error {
		return &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", err)}
	}
	for _, c := range []struct {
		err  error
		want string
	}{
		{io.EOF, KindEOF},
		{fmt.Errorf("reading: %w", io.ErrUnexpectedEOF), KindShort},
		{op(syscall.ECONNRESET), KindReset},
		{op(syscall.EPIPE), KindReset},
		{op(os.ErrDeadlineExceeded), KindTimeout},
		{op(syscall.ECONNREFUSED), KindConnect},
		{fmt.Errorf("something else"), KindOther},
	} {
		if got := FailureKind(c.err); got != c.want {
			t.Errorf("FailureKind(%v) = %s; want %s", c.err, got, c.want)
		}
	}
}

// TestNoRetryKinds runs every kind of no-retry client for a moment
// against a server that closes each connection after its first
// response, without saying so: every kind must count the next request
// on that connection as a failure (Python's http.client as
// RemoteDisconnected) rather than resend it, and report its id lost, and
// see that the connection had closed before the request (stale).
func TestNoRetryKinds(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 in PATH")
	}
	ctr := NewIDCounter()
	addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "2")
		ctr.ServeHTTP(w, r)
		// The whole response is out (its length known, so not chunked);
		// the connection then closes as an idle close would, after the
		// client may have reused it.
		w.(http.Flusher).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			go func() {
				time.Sleep(20 * time.Millisecond)
				conn.Close()
			}()
		}
	}))
	n, err := StartNoRetry(addr, NoRetryMix{GET: 2, POST: 2, Python: 2, Every: 100 * time.Millisecond, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		done := true
		for _, tl := range n.Tallies() {
			done = done && tl.Failed() > 0 && tl.Requests-tl.Failed() > 0
		}
		if done || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	n.Close()
	tallies := n.Tallies()
	if len(tallies) != 3 {
		t.Fatalf("%d tallies; want 3", len(tallies))
	}
	// The close races the next request's write: Linux answers a write to
	// a closed socket with a reset.
	want := map[string]string{ClientGoGET: KindEOF, ClientGoPOST: KindEOF, ClientPython: KindRemoteDisconnected}
	for _, tl := range tallies {
		if tl.Failures[want[tl.Client]]+tl.Failures[KindReset] != tl.Failed() || tl.Reused != tl.Failed() {
			t.Errorf("%s: failures %v (%d on reused connections), samples %q; want only %s or reset, on reused connections",
				tl.Client, tl.Failures, tl.Reused, tl.Samples, want[tl.Client])
		}
		if tl.Stale == 0 {
			t.Errorf("%s: no failure on a connection seen closed before the request; the server closes 20 ms after each response", tl.Client)
		}
		check := ctr.Check(tl.Prefix, tl.Lost)
		if check.Lost == 0 || check.Reached != 0 || check.Duplicated != 0 {
			t.Errorf("%s: %+v; want lost requests, none of them reached, none duplicated", tl.Client, check)
		}
		if tl.Requests <= tl.Failed() {
			t.Errorf("%s: %d requests, %d failed; want some to succeed", tl.Client, tl.Requests, tl.Failed())
		}
	}
	if _, errs, _ := n.Stats(); len(errs) == 0 {
		t.Error("Stats has no failures")
	}
	if n.Opened() < 6 {
		t.Errorf("opened %d connections; want at least one per client", n.Opened())
	}
}

// TestRawClientBodyDelay: with BodyDelay the server has the headers
// (the handler runs) well before the body arrives.
func TestRawClientBodyDelay(t *testing.T) {
	waited := make(chan time.Duration, 1)
	addr := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		if _, err := io.ReadAll(r.Body); err != nil {
			t.Error(err)
		}
		waited <- time.Since(start)
		_, _ = io.WriteString(w, "ok")
	}))
	cl := &RawClient{Addr: addr, Timeout: 5 * time.Second, BodyDelay: 200 * time.Millisecond}
	defer cl.Close()
	if r := cl.Do(http.MethodPost, "b-0", []byte("body")); r.Err != nil {
		t.Fatal(r.Err)
	}
	if w := <-waited; w < 150*time.Millisecond {
		t.Errorf("the body arrived %v after the handler started; want about 200ms", w)
	}
}
