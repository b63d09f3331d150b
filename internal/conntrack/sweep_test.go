package conntrack

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// serveEndlessEvents is a server-sent events response that never ends:
// an event every 10 ms until the client goes or the connection is closed.
func serveEndlessEvents(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for i := 0; ; i++ {
		if _, err := fmt.Fprintf(w, "data: %d\n\n", i); err != nil {
			return
		}
		if rc.Flush() != nil {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-tick.C:
		}
	}
}

// eventStream is a client reading a /stream response.
type eventStream struct{ body *bufio.Reader }

// openStream sends GET /stream on c and reads the response header.
func openStream(t *testing.T, c *client) *eventStream {
	t.Helper()
	if err := c.send("/stream"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		t.Fatalf("GET /stream: %v", err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return &eventStream{body: bufio.NewReader(resp.Body)}
}

// next reads one event.
func (s *eventStream) next() (string, error) {
	for {
		line, err := s.body.ReadString('\n')
		if err != nil {
			return "", err
		}
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			return strings.TrimSpace(data), nil
		}
	}
}

// TestSweepAccounting drives one tracked connection through Shed and
// sweeps at chosen times after the shed: a shed connection stops counting
// toward Held, counts again once it has been open recountAfter (once: it
// is neither shed nor counted twice), and is closed at boundaryTimeout
// when that is set, whether counted again or not; 0 never forces.
func TestSweepAccounting(t *testing.T) {
	type sweep struct {
		after    time.Duration // since the shed
		want     SweepResult
		closing  int
		overdue  int
		held     int
		isClosed bool
	}
	const hist = 10 * time.Second
	for _, tc := range []struct {
		name      string
		shed      bool
		hijack    bool // upgraded after it was shed
		recount   time.Duration
		timeout   time.Duration
		sweeps    []sweep
		forgotten bool
	}{{
		name: "just shed: closing, not held", shed: true, recount: hist,
		sweeps: []sweep{{after: time.Second, closing: 1}},
	}, {
		name: "open history after the shed: held again, once", shed: true, recount: hist,
		sweeps: []sweep{
			{after: hist - time.Millisecond, closing: 1},
			{after: hist, want: SweepResult{Overdue: 1}, overdue: 1, held: 1},
			{after: 2 * hist, overdue: 1, held: 1},
		},
	}, {
		name: "no boundary_timeout: never forced", shed: true, recount: hist,
		sweeps: []sweep{
			{after: hist, want: SweepResult{Overdue: 1}, overdue: 1, held: 1},
			{after: 100 * time.Hour, overdue: 1, held: 1},
		},
	}, {
		name: "boundary_timeout within history: forced while closing", shed: true, recount: hist, timeout: 3 * time.Second,
		sweeps: []sweep{
			{after: 3*time.Second - time.Millisecond, closing: 1},
			{after: 3 * time.Second, want: SweepResult{Forced: 1}, closing: 1, isClosed: true},
			{after: 4 * time.Second, closing: 1, isClosed: true},
			{after: 2 * hist, closing: 1, isClosed: true}, // closed: not counted again
		},
	}, {
		name: "boundary_timeout beyond history: held again, then forced", shed: true, recount: hist, timeout: 30 * time.Second,
		sweeps: []sweep{
			{after: hist, want: SweepResult{Overdue: 1}, overdue: 1, held: 1},
			{after: 30 * time.Second, want: SweepResult{Forced: 1}, overdue: 1, held: 1, isClosed: true},
			{after: 40 * time.Second, overdue: 1, held: 1, isClosed: true},
		},
	}, {
		name: "upgraded after the shed: forced and forgotten", shed: true, hijack: true, recount: hist, timeout: 3 * time.Second,
		sweeps: []sweep{
			{after: time.Second, closing: 1},
			{after: 3 * time.Second, want: SweepResult{Forced: 1}, isClosed: true},
		},
		forgotten: true,
	}, {
		name: "not shed: left alone", recount: hist, timeout: time.Second,
		sweeps: []sweep{{after: 100 * time.Hour, held: 1}},
	}, {
		name: "recount off", shed: true, timeout: 0,
		sweeps: []sweep{{after: 100 * time.Hour, closing: 1}},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker()
			c1, c2 := net.Pipe()
			defer c2.Close()
			defer c1.Close()
			tr.ConnState(c1, http.StateNew)
			tr.ConnState(c1, http.StateActive)
			tconn := tr.load(c1)
			if tc.shed {
				if r := tr.Shed(1); r != (ShedResult{Active: 1}) {
					t.Fatalf("Shed(1) = %+v; want one active", r)
				}
			}
			if tc.hijack {
				tr.ConnState(c1, http.StateHijacked)
			}
			shedAt := time.Duration(tconn.shedAt.Load())
			if !tc.shed {
				shedAt = tr.now()
			}
			forced := 0
			for i, sw := range tc.sweeps {
				got := tr.sweep(shedAt+sw.after, tc.recount, tc.timeout)
				forced += got.Forced
				c := tr.Counts()
				if got != sw.want || c.Closing != sw.closing || c.Overdue != sw.overdue || c.Held() != sw.held || tconn.closed.Load() != sw.isClosed {
					t.Errorf("sweep %d at +%v: %+v, counts %+v (held %d), closed %v; want %+v, closing %d, overdue %d, held %d, closed %v",
						i, sw.after, got, c, c.Held(), tconn.closed.Load(), sw.want, sw.closing, sw.overdue, sw.held, sw.isClosed)
				}
				// Never shed twice, counted again or not.
				if tc.shed {
					if r := tr.Shed(1); r.Total() != 0 {
						t.Errorf("sweep %d: Shed(1) = %+v; the connection was shed already", i, r)
					}
				}
			}
			if tc.forgotten {
				if c := tr.Counts(); c.total() != 0 {
					t.Errorf("counts %+v; want the upgraded connection forgotten", c)
				}
				return
			}
			// net/http reports the close: nothing is left, whatever state.
			tr.ConnState(c1, http.StateClosed)
			if c := tr.Counts(); c != (Counts{}) {
				t.Errorf("after StateClosed: %+v; want all zero", c)
			}
			if got := tr.forced.Load(); got != uint64(forced) {
				t.Errorf("forced total %d; the sweeps forced %d", got, forced)
			}
		})
	}
}

// TestSweepForgetRace: a connection forgotten (closed by its client)
// while sweeps and sheds run leaves the counts exact.
func TestSweepForgetRace(t *testing.T) {
	tr := NewTracker()
	var conns []net.Conn
	for range 200 {
		c1, c2 := net.Pipe()
		defer c2.Close()
		defer c1.Close()
		tr.ConnState(c1, http.StateNew)
		tr.ConnState(c1, http.StateActive)
		conns = append(conns, c1)
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for range 50 {
			tr.Shed(5)
			tr.sweep(tr.now()+time.Hour, time.Second, 0)
		}
	}()
	go func() {
		defer wg.Done()
		for _, c := range conns {
			tr.ConnState(c, http.StateClosed)
		}
	}()
	wg.Wait()
	if c := tr.Counts(); c != (Counts{}) {
		t.Fatalf("counts %+v; want all zero", c)
	}
}

// TestShedStreamNotForced holds a server-sent events response that never
// ends on a real server. Shed marks it; without a boundary timeout it is
// never closed: it stops counting toward Held, counts again once it has
// been open recountAfter (the app's history), keeps streaming, and is
// not shed a second time.
func TestShedStreamNotForced(t *testing.T) {
	ts := newTrackedServer(t)
	c := ts.dial()
	events := openStream(t, c)
	if _, err := events.next(); err != nil {
		t.Fatal(err)
	}
	ts.waitCounts("the stream active", func(c Counts) bool { return c.Active == 1 })
	if r := ts.tracker.Shed(1); r != (ShedResult{Active: 1}) {
		t.Fatalf("Shed(1) = %+v; want the active stream", r)
	}
	if c := ts.tracker.Counts(); c.Closing != 1 || c.Held() != 0 {
		t.Fatalf("after the shed: %+v (held %d); want closing 1, held 0", c, c.Held())
	}

	const history = 200 * time.Millisecond
	var swept SweepResult
	lbxtest.WaitFor(t, 10*time.Second, "the stream counted again", func() (bool, string) {
		r := ts.tracker.Sweep(history, 0)
		swept.Overdue += r.Overdue
		swept.Forced += r.Forced
		c := ts.tracker.Counts()
		return c.Overdue == 1 && c.Closing == 0 && c.Held() == 1, fmt.Sprintf("%+v", c)
	})
	for range 5 {
		r := ts.tracker.Sweep(history, 0)
		swept.Overdue += r.Overdue
		swept.Forced += r.Forced
	}
	if swept != (SweepResult{Overdue: 1}) {
		t.Errorf("sweeps added up to %+v; want exactly one overdue, none forced", swept)
	}
	// Still open and streaming.
	for range 3 {
		if _, err := events.next(); err != nil {
			t.Fatalf("the stream ended after the shed: %v", err)
		}
	}
	if r := ts.tracker.Shed(1); r.Total() != 0 {
		t.Errorf("Shed(1) = %+v: the stream was shed twice", r)
	}
	c.conn.Close()
	ts.waitCounts("the stream forgotten", func(c Counts) bool { return c.total() == 0 && c.Overdue == 0 && c.Closing == 0 })
}

// TestShedStreamForced: with a boundary timeout, a shed stream that never
// ends is closed once the timeout has passed (counted as forced, once),
// while a shed request in flight at the same time that completes within
// the timeout gets its whole response and closes at its boundary (idle
// for the tracker's bound: no WrapResponseWriter here). Sweeps
// run all along, every few milliseconds, on a clock the test moves past
// the timeout once the request is done, so that "within the timeout"
// does not depend on how fast the machine is.
func TestShedStreamForced(t *testing.T) {
	ts := newTrackedServer(t)
	ts.tracker.SetIdleCloseAfter(100 * time.Millisecond)
	sc, rc := ts.dial(), ts.dial()
	events := openStream(t, sc)
	if _, err := events.next(); err != nil {
		t.Fatal(err)
	}
	if err := rc.send("/block"); err != nil {
		t.Fatal(err)
	}
	<-ts.entered
	ts.waitCounts("the stream and the request active", func(c Counts) bool { return c.Active == 2 })

	const timeout = 30 * time.Second
	if r := ts.tracker.Shed(2); r != (ShedResult{Active: 2}) {
		t.Fatalf("Shed(2) = %+v; want both active connections", r)
	}
	var (
		skew   atomic.Int64 // added to the sweeps' clock
		mu     sync.Mutex
		swept  SweepResult
		sweeps int
	)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			r := ts.tracker.sweep(ts.tracker.now()+time.Duration(skew.Load()), time.Hour, timeout)
			mu.Lock()
			swept.Forced += r.Forced
			swept.Overdue += r.Overdue
			sweeps++
			mu.Unlock()
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	defer func() { close(stop); <-done }()
	sweptSoFar := func() (SweepResult, int) {
		mu.Lock()
		defer mu.Unlock()
		return swept, sweeps
	}
	lbxtest.WaitFor(t, 5*time.Second, "sweeps running", func() (bool, string) {
		_, n := sweptSoFar()
		return n >= 3, fmt.Sprint(n, " sweeps")
	})

	// The request completes within the timeout: whole, then closed.
	close(ts.release)
	resp, body, err := rc.read()
	if err != nil || resp.StatusCode != http.StatusOK || body != "done" {
		t.Fatalf("the shed request: %v, %v, %q; want 200 \"done\"", err, resp, body)
	}
	if !rc.closedByServer() {
		t.Error("the shed request's connection was not closed after its response")
	}
	ts.waitCounts("the request's connection forgotten", func(c Counts) bool { return c.total() == 1 && c.Closing == 1 })
	if got, _ := sweptSoFar(); got != (SweepResult{}) {
		t.Fatalf("sweeps within the timeout did %+v; want nothing", got)
	}
	for range 3 { // the stream goes on
		if _, err := events.next(); err != nil {
			t.Fatalf("the stream ended within the timeout: %v", err)
		}
	}

	// The timeout passes: the stream is cut.
	skew.Store(int64(timeout))
	var readErr error
	for readErr == nil {
		_, readErr = events.next()
	}
	if readErr == io.EOF {
		t.Errorf("the stream ended cleanly; want it cut (an unexpected EOF)")
	}
	ts.waitCounts("both forgotten", func(c Counts) bool { return c.total() == 0 && c.Closing == 0 })
	_, n := sweptSoFar()
	lbxtest.WaitFor(t, 5*time.Second, "more sweeps", func() (bool, string) {
		_, m := sweptSoFar()
		return m >= n+3, fmt.Sprint(m-n, " more sweeps")
	})
	if got, _ := sweptSoFar(); got != (SweepResult{Forced: 1}) {
		t.Errorf("sweeps added up to %+v; want exactly one forced (the stream)", got)
	}
	if _, atBoundary := ts.tracker.shedTotals(); atBoundary != 1 || ts.tracker.forced.Load() != 1 {
		t.Errorf("%d closed at a boundary, %d forced; want 1 and 1", atBoundary, ts.tracker.forced.Load())
	}
}

// TestShedStreamForcedHTTP2: a long HTTP/2 stream (server-sent events over
// h2c, through WrapResponseWriter) on a shed connection writes no new response
// header, so no GOAWAY goes out and the connection stays active; the
// boundary timeout closes it.
func TestShedStreamForcedHTTP2(t *testing.T) {
	cs := newCloseServer(t, true)
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: p}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get("http://" + cs.addr + "/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.ProtoMajor != 2 {
		t.Fatalf("protocol %s; want HTTP/2", resp.Proto)
	}
	events := &eventStream{body: bufio.NewReader(resp.Body)}
	if _, err := events.next(); err != nil {
		t.Fatal(err)
	}
	ts := &trackedServer{t: t, tracker: cs.tracker, addr: cs.addr}
	ts.waitCounts("the connection active", func(c Counts) bool { return c.Active == 1 })
	if r := cs.tracker.Shed(1); r != (ShedResult{Active: 1}) {
		t.Fatalf("Shed(1) = %+v; want the HTTP/2 connection", r)
	}
	forced := 0
	lbxtest.WaitFor(t, 10*time.Second, "the connection forced closed", func() (bool, string) {
		forced += cs.tracker.Sweep(time.Hour, 200*time.Millisecond).Forced
		return forced > 0, fmt.Sprintf("%+v", cs.tracker.Counts())
	})
	var readErr error
	for readErr == nil {
		_, readErr = events.next()
	}
	ts.waitCounts("the connection forgotten", func(c Counts) bool { return c.total() == 0 })
	if forced != 1 {
		t.Errorf("forced %d; want 1", forced)
	}
}
