package conntrack

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// closeServer is a real http.Server on 127.0.0.1 whose handlers write
// through WrapResponseWriter (as behind Caddy's rebalance_close), with its
// own Tracker.
type closeServer struct {
	tracker *Tracker
	addr    string
	entered chan struct{}
	release chan struct{}
}

// newCloseServer starts the server; h2c adds cleartext HTTP/2.
func newCloseServer(t *testing.T, h2c bool) *closeServer {
	t.Helper()
	cs := &closeServer{tracker: NewTracker(), entered: make(chan struct{}, 16), release: make(chan struct{}, 16)}
	wait := func(r *http.Request) bool {
		cs.entered <- struct{}{}
		select {
		case <-cs.release:
			return true
		case <-r.Context().Done():
			return false
		}
	}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/block": // explicit WriteHeader
			if wait(r) {
				w.WriteHeader(http.StatusOK)
				io.WriteString(w, "done")
			}
		case "/flush": // Flush before anything is written
			if wait(r) {
				http.NewResponseController(w).Flush()
				io.WriteString(w, "flushed")
			}
		case "/readfrom": // ReadFrom before anything is written
			if wait(r) {
				w.(io.ReaderFrom).ReadFrom(strings.NewReader("read"))
			}
		case "/stream": // server-sent events that never end
			serveEndlessEvents(w, r)
		case "/echo": // the request body
			echoBody(w, r)
		default: // implicit header on Write
			io.WriteString(w, "ok")
		}
	})
	srv := &http.Server{
		Handler:     closeMiddleware(next),
		ConnState:   cs.tracker.ConnState,
		ConnContext: cs.tracker.ConnContext,
	}
	if h2c {
		p := new(http.Protocols)
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		srv.Protocols = p
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	cs.addr = ln.Addr().String()
	return cs
}

// closeMiddleware runs next with the writer WrapResponseWriter returns.
func closeMiddleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(WrapResponseWriter(w, r, nil), r)
	})
}

// TestWrapResponseWriterHTTP1: a response on a connection shed while its
// handler ran carries "Connection: close" and arrives whole, whichever
// way the handler writes it; the server then closes the connection. An
// unshed connection gets no such header and stays open.
func TestWrapResponseWriterHTTP1(t *testing.T) {
	cs := newCloseServer(t, false)
	ts := &trackedServer{t: t, tracker: cs.tracker, addr: cs.addr}

	c := ts.dial()
	resp, body := c.get(t, "/fast")
	if resp.Header.Get("Connection") != "" || resp.Close || body != "ok" {
		t.Fatalf("unshed: Connection %q, close %v, body %q", resp.Header.Get("Connection"), resp.Close, body)
	}
	resp, _ = c.get(t, "/fast")
	if resp.Close {
		t.Fatal("unshed connection closed")
	}
	// Shed would take this idle connection first.
	c.conn.Close()
	ts.waitCounts("the idle connection gone", func(c Counts) bool { return c.total() == 0 })

	for _, tc := range []struct{ path, body string }{
		{"/block", "done"}, {"/flush", "flushed"}, {"/readfrom", "read"},
	} {
		t.Run(strings.TrimPrefix(tc.path, "/"), func(t *testing.T) {
			ts := &trackedServer{t: t, tracker: cs.tracker, addr: cs.addr}
			c := ts.dial()
			if err := c.send(tc.path); err != nil {
				t.Fatal(err)
			}
			<-cs.entered
			ts.waitCounts("the connection active", func(c Counts) bool { return c.Active == 1 })
			if r := cs.tracker.Shed(1); r.Active != 1 {
				t.Fatalf("Shed(1) = %+v; want one active", r)
			}
			cs.release <- struct{}{}
			resp, body, err := c.read()
			if err != nil || resp.StatusCode != http.StatusOK || body != tc.body {
				t.Fatalf("request on a shed connection: %v, %v, %q; want 200 %q", err, resp, body, tc.body)
			}
			// http.ReadResponse turns "Connection: close" into Close.
			if !resp.Close {
				t.Error("response on a shed connection without Connection: close")
			}
			if !c.closedByServer() {
				t.Error("the server did not close the shed connection after the response")
			}
			ts.waitCounts("connection forgotten", func(c Counts) bool { return c.Active == 0 && c.Closing == 0 })
		})
	}
}

// TestWrapResponseWriterHTTP2: on HTTP/2 the header becomes a GOAWAY: the
// stream in flight completes, and the client's next request goes over a
// new connection.
func TestWrapResponseWriterHTTP2(t *testing.T) {
	cs := newCloseServer(t, true)
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: p}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr, Timeout: 10 * time.Second}

	var conns []string
	get := func(path string) (string, error) {
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
			GotConn: func(i httptrace.GotConnInfo) { conns = append(conns, i.Conn.LocalAddr().String()) },
		})
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+cs.addr+path, nil)
		resp, err := cl.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("protocol %s; want HTTP/2", resp.Proto)
		}
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	if body, err := get("/fast"); err != nil || body != "ok" {
		t.Fatalf("first request: %q, %v", body, err)
	}
	type result struct {
		body string
		err  error
	}
	res := make(chan result, 1)
	go func() {
		b, err := get("/block")
		res <- result{b, err}
	}()
	<-cs.entered
	if r := cs.tracker.Shed(1); r.Active != 1 {
		t.Fatalf("Shed(1) = %+v; want one active", r)
	}
	cs.release <- struct{}{}
	if r := <-res; r.err != nil || r.body != "done" {
		t.Fatalf("stream on a shed connection: %q, %v; want done", r.body, r.err)
	}
	if body, err := get("/fast"); err != nil || body != "ok" {
		t.Fatalf("request after the GOAWAY: %q, %v", body, err)
	}
	if len(conns) != 3 || conns[0] != conns[1] || conns[2] == conns[1] {
		t.Fatalf("connections used %v; want the first twice, then a new one", conns)
	}
}

// TestWrapResponseWriterDraining: while draining says so, every final
// response carries "Connection: close" and the server closes the
// connection after it, on a connection no tracker follows too; before,
// the connection stays open for the next request.
func TestWrapResponseWriterDraining(t *testing.T) {
	var draining atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w = WrapResponseWriter(w, r, func(*http.Request) bool { return draining.Load() })
		io.WriteString(w, "ok")
	}))
	defer srv.Close()
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	br := bufio.NewReader(conn)
	get := func() *http.Response {
		t.Helper()
		if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := io.ReadAll(resp.Body); err != nil || string(b) != "ok" {
			t.Fatalf("body %q, %v", b, err)
		}
		return resp
	}
	if resp := get(); resp.Close {
		t.Fatal("not draining: the response closes the connection")
	}
	draining.Store(true)
	// (ReadResponse takes "Connection: close" out of the header into Close.)
	if resp := get(); !resp.Close {
		t.Fatal("draining: the response does not say Connection: close")
	}
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := br.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("after the draining response: read %d, %v; want the server's close (EOF)", n, err)
	}
}
