package conntrack

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// trackedServer is a real http.Server on 127.0.0.1 with a Tracker, and
// no WrapResponseWriter: a shed active connection closes when it next
// becomes idle.
type trackedServer struct {
	t       *testing.T
	tracker *Tracker
	addr    string
	entered chan struct{} // one value per /block request that started
	release chan struct{} // closed to let /block requests finish
}

func newTrackedServer(t *testing.T) *trackedServer {
	t.Helper()
	ts := &trackedServer{t: t, tracker: NewTracker(), entered: make(chan struct{}, 16), release: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("/fast", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("/block", func(w http.ResponseWriter, r *http.Request) {
		ts.entered <- struct{}{}
		select {
		case <-ts.release:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, "done")
	})
	mux.HandleFunc("/stream", serveEndlessEvents)
	mux.HandleFunc("/echo", echoBody)
	mux.HandleFunc("/upgrade", func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("hijack: %v", err)
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		io.Copy(conn, brw) // echo until the client or a shed closes it
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{
		Handler:     mux,
		ConnState:   ts.tracker.ConnState,
		ConnContext: ts.tracker.ConnContext,
	}
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ln) }()
	t.Cleanup(func() {
		select {
		case <-ts.release:
		default:
			close(ts.release)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		srv.Close()
		<-done
	})
	ts.addr = ln.Addr().String()
	return ts
}

// client is one raw HTTP/1.1 keep-alive connection.
type client struct {
	conn net.Conn
	br   *bufio.Reader
}

func (ts *trackedServer) dial() *client {
	ts.t.Helper()
	c, err := net.DialTimeout("tcp", ts.addr, 5*time.Second)
	if err != nil {
		ts.t.Fatal(err)
	}
	ts.t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return &client{conn: c, br: bufio.NewReader(c)}
}

func (c *client) send(path string) error {
	_, err := io.WriteString(c.conn, "GET "+path+" HTTP/1.1\r\nHost: test\r\n\r\n")
	return err
}

func (c *client) read() (*http.Response, string, error) {
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		return nil, "", err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(body), err
}

func (c *client) get(t *testing.T, path string) (*http.Response, string) {
	t.Helper()
	if err := c.send(path); err != nil {
		t.Fatal(err)
	}
	resp, body, err := c.read()
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return resp, body
}

// closedByServer reports whether the server closed c (EOF on read).
func (c *client) closedByServer() bool {
	c.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := c.br.ReadByte()
	return errors.Is(err, io.EOF)
}

func (ts *trackedServer) waitCounts(what string, ok func(Counts) bool) {
	ts.t.Helper()
	lbxtest.WaitFor(ts.t, 5*time.Second, what, func() (bool, string) {
		c := ts.tracker.Counts()
		return ok(c), spew(c)
	})
}

func spew(c Counts) string { return fmt.Sprintf("%+v", c) }

// shedTotals returns how many connections t shed since it was created, by
// how, and how many of the active ones have been closed at a response
// boundary so far.
func (t *Tracker) shedTotals() (shed ShedResult, closedAtBoundary uint64) {
	return ShedResult{
		Idle:     int(t.shedIdle.Load()),
		Active:   int(t.shedActive.Load()),
		Hijacked: int(t.shedHijacked.Load()),
	}, t.closedAtBoundary.Load()
}

// TestTrackerCounts follows connections through new, idle, active,
// hijacked and closed on a real server.
func TestTrackerCounts(t *testing.T) {
	ts := newTrackedServer(t)
	a, b := ts.dial(), ts.dial()
	ts.waitCounts("2 new", func(c Counts) bool { return c.New == 2 && c.total() == 2 })
	a.get(t, "/fast")
	b.get(t, "/fast")
	ts.waitCounts("2 idle", func(c Counts) bool { return c.Idle == 2 && c.total() == 2 })

	if err := a.send("/block"); err != nil {
		t.Fatal(err)
	}
	<-ts.entered
	ts.waitCounts("1 active, 1 idle", func(c Counts) bool { return c.Active == 1 && c.Idle == 1 })

	u := ts.dial()
	resp, _ := u.get(t, "/upgrade")
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: status %d", resp.StatusCode)
	}
	ts.waitCounts("1 hijacked", func(c Counts) bool { return c.Hijacked == 1 && c.total() == 3 })

	// The client closes the upgraded stream: net/http says nothing, the
	// sweep notices the closed socket.
	u.conn.Close()
	lbxtest.WaitFor(t, 5*time.Second, "sweep forgets the closed hijacked connection", func() (bool, string) {
		ts.tracker.Sweep(0, 0)
		c := ts.tracker.Counts()
		return c.Hijacked == 0, spew(c)
	})

	b.conn.Close()
	ts.waitCounts("b forgotten", func(c Counts) bool { return c.total() == 1 && c.Active == 1 })
	ts.release <- struct{}{} // the /block handler takes it and finishes
	if _, body, err := a.read(); err != nil || body != "done" {
		t.Fatalf("/block: %q, %v", body, err)
	}
}

// TestTrackerShedOrder sheds from a server holding 2 idle, 1 active
// and 1 hijacked connection: idle ones go first (closed once idle for
// the tracker's bound), then the active one is marked (not closed: its
// request completes, its response arrives whole, then the connection
// closes once idle for the bound), and the hijacked one last.
func TestTrackerShedOrder(t *testing.T) {
	ts := newTrackedServer(t)
	ts.tracker.SetIdleCloseAfter(100 * time.Millisecond)
	i1, i2, act, up := ts.dial(), ts.dial(), ts.dial(), ts.dial()
	i1.get(t, "/fast")
	i2.get(t, "/fast")
	if resp, _ := up.get(t, "/upgrade"); resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: status %d", resp.StatusCode)
	}
	if err := act.send("/block"); err != nil {
		t.Fatal(err)
	}
	<-ts.entered
	ts.waitCounts("2 idle, 1 active, 1 hijacked", func(c Counts) bool {
		return c.Idle == 2 && c.Active == 1 && c.Hijacked == 1
	})

	if r := ts.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
		t.Fatalf("Shed(1) = %+v; want one idle", r)
	}
	if r := ts.tracker.Shed(2); r != (ShedResult{Idle: 1, Active: 1}) {
		t.Fatalf("Shed(2) = %+v; want one idle and one active", r)
	}
	if !i1.closedByServer() || !i2.closedByServer() {
		t.Fatal("idle connections not closed")
	}
	ts.waitCounts("idle ones forgotten, the active one closing", func(c Counts) bool {
		return c.Idle == 0 && c.Active == 1 && c.Closing == 1 && c.Held() == 1
	})

	// The marked connection is not shed twice: next comes the hijacked one.
	if r := ts.tracker.Shed(5); r != (ShedResult{Hijacked: 1}) {
		t.Fatalf("Shed(5) = %+v; want the hijacked one only", r)
	}
	if !up.closedByServer() {
		t.Fatal("hijacked connection not closed")
	}

	// The active request completes normally, then its connection closes.
	close(ts.release)
	resp, body, err := act.read()
	if err != nil || resp.StatusCode != 200 || body != "done" {
		t.Fatalf("active request after shed: %v %v %q; want 200 \"done\"", err, resp, body)
	}
	if !act.closedByServer() {
		t.Fatal("shed active connection not closed after its response")
	}
	ts.waitCounts("nothing left", func(c Counts) bool { return c.total() == 0 && c.Closing == 0 })
	shed, atBoundary := ts.tracker.shedTotals()
	if shed != (ShedResult{Idle: 2, Active: 1, Hijacked: 1}) || atBoundary != 1 {
		t.Errorf("totals %+v, %d at a boundary; want 2/1/1 and 1", shed, atBoundary)
	}
	if r := ts.tracker.Shed(3); r.Total() != 0 {
		t.Errorf("Shed on an empty tracker: %+v", r)
	}
}

// TestTrackerNewGrace: a connection that has not sent its first
// request is not shed (its request may be on its way).
func TestTrackerNewGrace(t *testing.T) {
	ts := newTrackedServer(t)
	ts.dial()
	ts.waitCounts("1 new", func(c Counts) bool { return c.New == 1 })
	if r := ts.tracker.Shed(1); r.Total() != 0 {
		t.Fatalf("Shed(1) took a fresh new connection: %+v", r)
	}
}

// TestWrapResponseWriterConnectionClose: a response on a connection that
// was shed before the request started gets "Connection: close"; one on a
// connection no tracker knows gets the server's own writer.
func TestWrapResponseWriterConnectionClose(t *testing.T) {
	tr := NewTracker()
	c1, c2 := net.Pipe()
	defer c1.Close()
	defer c2.Close()
	ctx := tr.ConnContext(context.Background(), c1)
	h := closeMiddleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	req := httptest.NewRequest("GET", "/", nil).WithContext(ctx)

	untracked := httptest.NewRecorder()
	if w := WrapResponseWriter(untracked, httptest.NewRequest("GET", "/", nil), nil); w != http.ResponseWriter(untracked) {
		t.Fatalf("untracked request: writer %T; want the server's own", w)
	}

	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if got := rec.Header().Get("Connection"); got != "" {
		t.Fatalf("unshed connection: Connection %q", got)
	}
	tr.ConnState(c1, http.StateActive)
	if r := tr.Shed(1); r.Active != 1 {
		t.Fatalf("Shed(1) = %+v", r)
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if got := rec.Header().Get("Connection"); got != "close" {
		t.Fatalf("shed connection: Connection %q; want close", got)
	}
}

// TestTrackerConcurrent drives many connections through the tracker
// at once and checks that the counts return to zero.
func TestTrackerConcurrent(t *testing.T) {
	ts := newTrackedServer(t)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr := &http.Transport{MaxIdleConnsPerHost: 2}
			defer tr.CloseIdleConnections()
			cl := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			for range 50 {
				resp, err := cl.Get("http://" + ts.addr + "/fast")
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				ts.tracker.Shed(1)
			}
		}()
	}
	wg.Wait()
	ts.waitCounts("all connections closed and forgotten", func(c Counts) bool { return c.total() == 0 && c.Closing == 0 })
}
