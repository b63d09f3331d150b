package conntrack

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// echoBody answers the request body.
func echoBody(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Write(b)
}

// rawLoad is keep-alive clients that never retry: each writes a request
// on its connection, reads the response with http.ReadResponse and
// reuses the connection, as Python's http.client does. A request that
// does not get its whole response is a failure, on a reused connection
// too; after a response with Connection: close the client reads the
// server's EOF and dials again.
type rawLoad struct {
	addr string
	// pause returns how long a client waits before its next request.
	pause func() time.Duration
	// reconnectEvery, when > 0, makes a client close its connection
	// itself after that many requests (so that new ones get shed).
	reconnectEvery int

	requests, closes, dials atomic.Int64
	mu                      sync.Mutex
	failures                []string
}

func (l *rawLoad) fail(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failures = append(l.failures, fmt.Sprintf(format, args...))
}

// run is one client, until stop is closed.
func (l *rawLoad) run(stop <-chan struct{}) {
	var (
		c    net.Conn
		br   *bufio.Reader
		used int
	)
	defer func() {
		if c != nil {
			c.Close()
		}
	}()
	drop := func() { c.Close(); c = nil }
	for {
		select {
		case <-stop:
			return
		default:
		}
		if c == nil {
			var err error
			if c, err = net.DialTimeout("tcp", l.addr, 5*time.Second); err != nil {
				l.fail("dial: %v", err)
				return
			}
			br, used = bufio.NewReader(c), 0
			l.dials.Add(1)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, "GET /fast HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
			l.fail("write (request %d on the connection): %v", used+1, err)
			drop()
			continue
		}
		resp, err := http.ReadResponse(br, nil)
		var body []byte
		if err == nil {
			body, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		if err != nil || resp.StatusCode != http.StatusOK || string(body) != "ok" {
			l.fail("request %d on the connection: %v, %q", used+1, err, body)
			drop()
			continue
		}
		l.requests.Add(1)
		used++
		if resp.Close {
			l.closes.Add(1)
			if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
				l.fail("after Connection: close: %v; want EOF", err)
			}
			drop()
			continue
		}
		if l.reconnectEvery > 0 && used >= l.reconnectEvery {
			drop()
			continue
		}
		if d := l.pause(); d > 0 {
			time.Sleep(d)
		}
	}
}

// TestShedIdleNeverRacesRequest: keep-alive clients that never retry send
// requests back to back, or after a pause of up to 2 ms, to a real
// net/http server while the tracker sheds every half millisecond, so
// that many connections are shed idle at the moment their client sends
// its next request. No request fails: a shed idle connection is marked,
// not closed. Behind WrapResponseWriter the next response carries
// Connection: close and the connection closes after it; without it, the
// connection stays until it is idle for the bound (a minute here), and
// the clients reconnect themselves every 20 requests so that new
// connections keep being shed. (Before, idle connections were closed at
// the shed, and some of these requests failed with EOF or a reset.)
func TestShedIdleNeverRacesRequest(t *testing.T) {
	for _, wrapped := range []bool{true, false} {
		name := map[bool]string{true: "rebalance_close", false: "no_wrapper"}[wrapped]
		t.Run(name, func(t *testing.T) {
			var tracker *Tracker
			var addr string
			if wrapped {
				cs := newCloseServer(t, false)
				tracker, addr = cs.tracker, cs.addr
			} else {
				ts := newTrackedServer(t)
				tracker, addr = ts.tracker, ts.addr
			}
			tracker.SetIdleCloseAfter(time.Minute)
			load := &rawLoad{addr: addr, pause: func() time.Duration {
				if rand.IntN(2) == 0 {
					return 0
				}
				return time.Duration(rand.Int64N(int64(2 * time.Millisecond)))
			}}
			if !wrapped {
				load.reconnectEvery = 20
			}
			const clients, minIdleSheds = 16, 300
			stop := make(chan struct{})
			var wg sync.WaitGroup
			for range clients {
				wg.Add(1)
				go func() { defer wg.Done(); load.run(stop) }()
			}
			shedderDone := make(chan struct{})
			go func() {
				defer close(shedderDone)
				for {
					select {
					case <-stop:
						return
					default:
					}
					tracker.Shed(2)
					time.Sleep(500 * time.Microsecond)
				}
			}()
			deadline := time.Now().Add(30 * time.Second)
			for {
				shed, _ := tracker.shedTotals()
				if shed.Idle >= minIdleSheds && load.requests.Load() >= 3000 || time.Now().After(deadline) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			close(stop)
			wg.Wait()
			<-shedderDone
			shed, _ := tracker.shedTotals()
			t.Logf("%d requests on %d connections, %d ended by Connection: close; shed %+v; %d closed idle after the bound",
				load.requests.Load(), load.dials.Load(), load.closes.Load(), shed, tracker.IdleCloseTotal())
			if n := len(load.failures); n > 0 {
				t.Errorf("%d requests failed; first: %v", n, load.failures[:min(n, 5)])
			}
			if shed.Idle < minIdleSheds {
				t.Errorf("only %d idle connections shed in 30 s; want at least %d for the test to mean something", shed.Idle, minIdleSheds)
			}
			if wrapped && load.closes.Load() < int64(shed.Idle)/2 {
				t.Errorf("%d responses with Connection: close for %d idle connections shed", load.closes.Load(), shed.Idle)
			}
			if n := tracker.IdleCloseTotal(); n != 0 {
				t.Errorf("%d connections closed after the idle bound of a minute", n)
			}
		})
	}
}

// waitIdleFor waits until c's connection (the only one tracker holds)
// has been idle for at least d.
func waitIdleFor(t *testing.T, tracker *Tracker, d time.Duration) *trackedConn {
	t.Helper()
	var tc *trackedConn
	lbxtest.WaitFor(t, 5*time.Second, fmt.Sprint("the connection idle for ", d), func() (bool, string) {
		tracker.conns.Range(func(_, v any) bool { tc = v.(*trackedConn); return false })
		if tc == nil || tc.state.Load() != connIdle {
			return false, spew(tracker.Counts())
		}
		idle := tracker.now() - time.Duration(tc.idleAt.Load())
		return idle >= d, fmt.Sprint("idle for ", idle)
	})
	return tc
}

// TestShedIdleClosesAfterBound: a shed idle connection whose client sends
// nothing is counted as closing (not held, never counted again by a
// sweep) and closed once it has been idle for the bound, not before;
// it is counted once in the shed totals and once as closed after the
// bound. Behind WrapResponseWriter, a request before the bound gets
// Connection: close instead, and nothing is closed outright.
func TestShedIdleClosesAfterBound(t *testing.T) {
	const bound = 300 * time.Millisecond
	t.Run("idle", func(t *testing.T) {
		ts := newTrackedServer(t)
		ts.tracker.SetIdleCloseAfter(bound)
		c := ts.dial()
		c.get(t, "/fast")
		idleFrom := time.Now()
		ts.waitCounts("1 idle", func(c Counts) bool { return c.Idle == 1 })
		if r := ts.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
			t.Fatalf("Shed(1) = %+v; want one idle", r)
		}
		if got := ts.tracker.Counts(); got.Closing != 1 || got.Held() != 0 {
			t.Fatalf("after the shed: %+v; want closing 1, held 0", got)
		}
		if sw := ts.tracker.sweep(ts.tracker.now()+time.Hour, time.Millisecond, time.Millisecond); sw != (SweepResult{}) {
			t.Errorf("a sweep an hour on counted the marked idle connection: %+v; want nothing", sw)
		}
		if !c.closedByServer() {
			t.Fatal("the marked idle connection was not closed")
		}
		if idle := time.Since(idleFrom); idle < bound {
			t.Errorf("closed after %v idle; want at least %v", idle, bound)
		}
		ts.waitCounts("nothing left", func(c Counts) bool { return c == Counts{} })
		if shed, _ := ts.tracker.shedTotals(); shed != (ShedResult{Idle: 1}) || ts.tracker.IdleCloseTotal() != 1 {
			t.Errorf("totals %+v, %d closed after the bound; want one idle, 1", shed, ts.tracker.IdleCloseTotal())
		}
	})
	t.Run("rebalance_close", func(t *testing.T) {
		cs := newCloseServer(t, false)
		cs.tracker.SetIdleCloseAfter(time.Minute)
		ts := &trackedServer{t: t, tracker: cs.tracker, addr: cs.addr}
		c := ts.dial()
		c.get(t, "/fast")
		ts.waitCounts("1 idle", func(c Counts) bool { return c.Idle == 1 })
		if r := cs.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
			t.Fatalf("Shed(1) = %+v; want one idle", r)
		}
		resp, body := c.get(t, "/fast")
		if !resp.Close || body != "ok" {
			t.Fatalf("the request after the shed: close %v, %q; want Connection: close, ok", resp.Close, body)
		}
		if !c.closedByServer() {
			t.Fatal("not closed after the response with Connection: close")
		}
		ts.waitCounts("nothing left", func(c Counts) bool { return c == Counts{} })
		if n := cs.tracker.IdleCloseTotal(); n != 0 {
			t.Errorf("%d closed after the bound; want 0", n)
		}
	})
}

// TestShedIdleRequestArriving: the first bytes of a request on a shed
// idle connection, whose header is not whole yet (net/http has read them,
// and still reports the connection idle), keep it from being closed
// outright, bound after bound; the request, once whole, is answered.
// Without WrapResponseWriter the connection then closes once idle for
// the bound again.
func TestShedIdleRequestArriving(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the arrival of bytes is read from the socket on Linux only")
	}
	const bound = 200 * time.Millisecond
	ts := newTrackedServer(t)
	ts.tracker.SetIdleCloseAfter(bound)
	c := ts.dial()
	c.get(t, "/fast")
	waitIdleFor(t, ts.tracker, 2*dataSlack)
	if r := ts.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
		t.Fatalf("Shed(1) = %+v; want one idle", r)
	}
	if _, err := io.WriteString(c.conn, "GET /fast HTTP/1.1\r\nHost: te"); err != nil {
		t.Fatal(err)
	}
	lbxtest.WaitFor(t, 10*time.Second, "two checks finding the request arriving", func() (bool, string) {
		if n := ts.tracker.IdleCloseTotal(); n != 0 {
			t.Fatalf("closed with a request arriving (%d closes)", n)
		}
		return ts.tracker.inputSeen.Load() >= 2, fmt.Sprint(ts.tracker.inputSeen.Load(), " checks")
	})
	if n := ts.tracker.IdleCloseTotal(); n != 0 {
		t.Fatalf("closed with a request arriving (%d closes)", n)
	}
	if _, err := io.WriteString(c.conn, "st\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, body, err := c.read()
	if err != nil || resp.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("the request that was arriving: %v, %v, %q", err, resp, body)
	}
	if !c.closedByServer() {
		t.Fatal("not closed once idle for the bound after the response")
	}
	ts.waitCounts("nothing left", func(c Counts) bool { return c == Counts{} })
	if n := ts.tracker.IdleCloseTotal(); n != 1 {
		t.Errorf("%d closed after the bound; want 1", n)
	}
}

// TestShedIdleBytesWaiting: a shed idle connection with bytes waiting on
// its socket, unread (here nobody reads them: the test plays net/http's
// part), is not closed outright, however long it stays idle; once they
// are read and it has been quiet for the bound, it is.
func TestShedIdleBytesWaiting(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the bytes waiting are read from the socket on Linux only")
	}
	const bound = 100 * time.Millisecond
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	if _, err := io.WriteString(client, "GET / HTTP/1.1\r\n"); err != nil {
		t.Fatal(err)
	}
	lbxtest.WaitFor(t, 5*time.Second, "the bytes waiting on the socket", func() (bool, string) {
		in := readInput(server)
		return in.waiting == 16, fmt.Sprintf("%+v", in)
	})
	// Data older than the idle period: only the bytes waiting tell.
	time.Sleep(2 * dataSlack)
	tr := NewTracker()
	tr.SetIdleCloseAfter(bound)
	tr.ConnState(server, http.StateNew)
	tr.ConnState(server, http.StateActive)
	tr.ConnState(server, http.StateIdle)
	if in := readInput(server); !in.requestArriving(0) || !in.sinceDataKnown || in.sinceData < dataSlack {
		t.Fatalf("readInput = %+v", in)
	}
	if r := tr.Shed(1); r != (ShedResult{Idle: 1}) {
		t.Fatalf("Shed(1) = %+v; want one idle", r)
	}
	lbxtest.WaitFor(t, 10*time.Second, "three checks finding bytes waiting", func() (bool, string) {
		if tr.load(server).closed.Load() {
			t.Fatal("closed with bytes waiting")
		}
		return tr.inputSeen.Load() >= 3, fmt.Sprint(tr.inputSeen.Load(), " checks")
	})
	if tr.load(server).closed.Load() {
		t.Fatal("closed with bytes waiting")
	}
	// Read them, as net/http would; the connection is then quiet.
	buf := make([]byte, 16)
	if _, err := io.ReadFull(server, buf); err != nil {
		t.Fatal(err)
	}
	// They arrived during this idle period, so the next one decides.
	tr.ConnState(server, http.StateActive)
	tr.ConnState(server, http.StateIdle)
	lbxtest.WaitFor(t, 10*time.Second, "the quiet connection closed", func() (bool, string) {
		return tr.IdleCloseTotal() == 1, spew(tr.Counts())
	})
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := client.Read(buf); !errors.Is(err, io.EOF) {
		t.Errorf("client read %v; want EOF", err)
	}
}

// TestShedActivePipelined: a shed active connection without
// WrapResponseWriter, with a second request pipelined behind the one in
// progress, answers both (it is no longer closed at its next idle
// transition, when net/http already holds the second request), then
// closes once idle for the bound.
func TestShedActivePipelined(t *testing.T) {
	ts := newTrackedServer(t)
	ts.tracker.SetIdleCloseAfter(100 * time.Millisecond)
	c := ts.dial()
	if _, err := io.WriteString(c.conn, "GET /block HTTP/1.1\r\nHost: test\r\n\r\nGET /fast HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	<-ts.entered
	ts.waitCounts("the connection active", func(c Counts) bool { return c.Active == 1 })
	if r := ts.tracker.Shed(1); r != (ShedResult{Active: 1}) {
		t.Fatalf("Shed(1) = %+v; want one active", r)
	}
	close(ts.release)
	for _, want := range []string{"done", "ok"} {
		resp, body, err := c.read()
		if err != nil || resp.StatusCode != http.StatusOK || body != want {
			t.Fatalf("pipelined response: %v, %v, %q; want 200 %q", err, resp, body, want)
		}
	}
	if !c.closedByServer() {
		t.Fatal("not closed once idle for the bound")
	}
	ts.waitCounts("nothing left", func(c Counts) bool { return c == Counts{} })
	if _, atBoundary := ts.tracker.shedTotals(); atBoundary != 1 || ts.tracker.IdleCloseTotal() != 1 {
		t.Errorf("%d closed at a boundary, %d after the bound; want 1 and 1", atBoundary, ts.tracker.IdleCloseTotal())
	}
}

// TestShedBodyArriving: a request whose header has been read while its
// body is still arriving is active, not idle: shed then, it is not
// closed however long the body takes, and is answered whole; without
// WrapResponseWriter the connection closes once idle for the bound after
// that.
func TestShedBodyArriving(t *testing.T) {
	const bound = 100 * time.Millisecond
	ts := newTrackedServer(t)
	ts.tracker.SetIdleCloseAfter(bound)
	c := ts.dial()
	if _, err := io.WriteString(c.conn, "POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nhello"); err != nil {
		t.Fatal(err)
	}
	ts.waitCounts("the connection active", func(c Counts) bool { return c.Active == 1 })
	if r := ts.tracker.Shed(1); r != (ShedResult{Active: 1}) {
		t.Fatalf("Shed(1) = %+v; want one active", r)
	}
	tc := waitActiveFor(t, ts.tracker, 3*bound)
	if tc.closed.Load() {
		t.Fatal("closed while its body was arriving")
	}
	if _, err := io.WriteString(c.conn, "world"); err != nil {
		t.Fatal(err)
	}
	resp, body, err := c.read()
	if err != nil || resp.StatusCode != http.StatusOK || body != "helloworld" {
		t.Fatalf("the request: %v, %v, %q", err, resp, body)
	}
	if !c.closedByServer() {
		t.Fatal("not closed once idle for the bound")
	}
}

// waitActiveFor waits, on the tracker's clock, until d has passed since
// the only connection tracker holds was shed, checking that it stays
// active.
func waitActiveFor(t *testing.T, tracker *Tracker, d time.Duration) *trackedConn {
	t.Helper()
	var tc *trackedConn
	tracker.conns.Range(func(_, v any) bool { tc = v.(*trackedConn); return false })
	lbxtest.WaitFor(t, 10*time.Second, fmt.Sprint(d, " since the shed"), func() (bool, string) {
		if s := tc.state.Load(); s != connActive {
			t.Fatalf("state %d; want active", s)
		}
		age := tracker.now() - time.Duration(tc.shedAt.Load())
		return age >= d, fmt.Sprint(age)
	})
	return tc
}

// TestShedIdleExpectContinue: a request with Expect: 100-continue on a
// shed idle connection behind WrapResponseWriter gets its 100 Continue,
// sends its body, and gets its whole response with Connection: close.
func TestShedIdleExpectContinue(t *testing.T) {
	cs := newCloseServer(t, false)
	ts := &trackedServer{t: t, tracker: cs.tracker, addr: cs.addr}
	c := ts.dial()
	c.get(t, "/fast")
	ts.waitCounts("1 idle", func(c Counts) bool { return c.Idle == 1 })
	if r := cs.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
		t.Fatalf("Shed(1) = %+v; want one idle", r)
	}
	if _, err := io.WriteString(c.conn, "POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil || resp.StatusCode != http.StatusContinue {
		t.Fatalf("interim response: %v, %v; want 100 Continue", err, resp)
	}
	if _, err := io.WriteString(c.conn, "hello"); err != nil {
		t.Fatal(err)
	}
	resp, body, err := c.read()
	if err != nil || resp.StatusCode != http.StatusOK || body != "hello" || !resp.Close {
		t.Fatalf("final response: %v, %v, %q; want 200 hello with Connection: close", err, resp, body)
	}
	if !c.closedByServer() {
		t.Fatal("not closed after the response")
	}
}

// embedding wraps a connection as Caddy's http2Conn does: by embedding
// it, with no method that returns it.
type embedding struct {
	idx int
	net.Conn
}

// embeddingValue is the same as a value type, as Caddy's tlsStateConn.
type embeddingValue struct{ net.Conn }

// TestReadInputUnwraps: the socket is found through wrappers that embed
// the connection (pointer or value) and through countingConn; a
// connection without one (net.Pipe) reads as unknown, and the idle close
// then goes by time alone.
func TestReadInputUnwraps(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("Linux only")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	if _, err := io.WriteString(client, "abc"); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]net.Conn{
		"embedded pointer":        &embedding{Conn: server},
		"embedded value":          embeddingValue{&embedding{Conn: server}},
		"counting, then embedded": &countingConn{Conn: embeddingValue{server}, counters: new(ByteCounters)},
	} {
		lbxtest.WaitFor(t, 5*time.Second, name+": 3 bytes waiting", func() (bool, string) {
			in := readInput(c)
			return in.waitingKnown && in.waiting == 3 && in.sinceDataKnown, fmt.Sprintf("%+v", in)
		})
	}
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	if in := readInput(p1); in != (inputState{}) || in.requestArriving(time.Hour) {
		t.Errorf("net.Pipe: %+v; want nothing known", in)
	}
	if c := embeddedConn(embeddingValue{}); c != nil {
		t.Errorf("embeddedConn of an empty wrapper = %v", c)
	}
}

// TestSweepMarkedIdle: a shed idle connection that has had no request
// since the shed is never counted toward Held again, however old the
// shed (it closes at its next response or after the bound, and the
// decision must not shed again for it); once a request has used it since
// the shed (no WrapResponseWriter to end it), it is, at recountAfter,
// once, and it is never shed twice. Its shed is counted once.
func TestSweepMarkedIdle(t *testing.T) {
	tr := NewTracker()
	c1, c2 := net.Pipe()
	defer c2.Close()
	defer c1.Close()
	tr.ConnState(c1, http.StateNew)
	tr.ConnState(c1, http.StateActive)
	tr.ConnState(c1, http.StateIdle)
	if r := tr.Shed(1); r != (ShedResult{Idle: 1}) {
		t.Fatalf("Shed(1) = %+v; want one idle", r)
	}
	for _, after := range []time.Duration{time.Second, time.Hour, 100 * time.Hour} {
		if sw := tr.sweep(tr.now()+after, time.Second, time.Second); sw != (SweepResult{}) {
			t.Errorf("sweep %v on: %+v; want nothing", after, sw)
		}
		if c := tr.Counts(); c.Closing != 1 || c.Overdue != 0 || c.Held() != 0 {
			t.Errorf("sweep %v on: counts %+v (held %d); want closing 1, held 0", after, c, c.Held())
		}
	}
	// Its client uses it again; without Connection: close it stays.
	tr.ConnState(c1, http.StateActive)
	tr.ConnState(c1, http.StateIdle)
	if sw := tr.sweep(tr.now()+time.Hour, time.Second, 0); sw != (SweepResult{Overdue: 1}) {
		t.Errorf("sweep after a request: %+v; want one overdue", sw)
	}
	if sw := tr.sweep(tr.now()+2*time.Hour, time.Second, 0); sw != (SweepResult{}) {
		t.Errorf("second sweep: %+v; want nothing", sw)
	}
	if c := tr.Counts(); c.Closing != 0 || c.Overdue != 1 || c.Held() != 1 {
		t.Errorf("counts %+v (held %d); want overdue 1, held 1", c, c.Held())
	}
	if r := tr.Shed(1); r.Total() != 0 {
		t.Errorf("Shed(1) = %+v: shed twice", r)
	}
	tr.ConnState(c1, http.StateClosed)
	if c := tr.Counts(); c != (Counts{}) {
		t.Errorf("after StateClosed: %+v; want all zero", c)
	}
	if shed, _ := tr.shedTotals(); shed != (ShedResult{Idle: 1}) {
		t.Errorf("shed totals %+v; want one idle", shed)
	}
}
