package conntrack

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// Connection states the tracker distinguishes.
const (
	connNew uint32 = iota
	connActive
	connIdle
	connHijacked
	numConnStates
)

// newConnGrace is how long a connection that has not sent its first
// request is left alone by shedding: net/http's own idle-connection
// closing (Server.Shutdown) uses the same 5 seconds, since the request may
// be on its way.
const newConnGrace = 5 * time.Second

// Shed states of a tracked connection: they keep the Closing and Overdue
// counts exact whichever of Shed, Sweep and net/http's StateClosed gets
// to a connection first.
const (
	notShed     uint32 = iota
	shedClosing        // shed, not closed yet: not counted toward Held
	shedOverdue        // shed, still open Sweep's recountAfter later: counted again
	shedGone           // forgotten by the tracker
)

// trackedConn is one connection the tracker knows.
type trackedConn struct {
	conn  net.Conn
	state atomic.Uint32
	since time.Time // when it was accepted
	// shed is the connection's shed state (notShed, shedClosing, …). A
	// shed active connection gets "Connection: close" on its next
	// response (when the response goes through WrapResponseWriter) and
	// is closed when it next becomes idle (an HTTP/2 one gracefully: see
	// shutDownH2).
	shed atomic.Uint32
	// shedAt is when it was shed, as the tracker's clock (Tracker.now);
	// written by Shed and read by Sweep, both under the tracker's shedMu.
	shedAt atomic.Int64
	// ws is set by WrapResponseWriter's writer when the connection is
	// upgraded to a WebSocket whose frames it follows: the tracker then
	// closes the stream with a close frame instead of cutting it (see
	// wsclose.go).
	ws atomic.Pointer[wsConn]
	// closed is set by the first close from the tracker.
	closed atomic.Bool
	// h2 is set once the connection is seen to speak HTTP/2: over TLS
	// from its ALPN protocol; in clear text (h2c) from the client preface
	// a ByteCounters listener saw, or when a response on it goes through
	// WrapResponseWriter (Go's server reports h2c connections' states
	// like HTTP/1 ones).
	h2 atomic.Bool
	// gen counts the connection's state changes: a timer armed while it
	// was idle acts only if it has not changed state since.
	gen atomic.Uint64
	// goAway says who sent this HTTP/2 connection a GOAWAY (goAwayNone,
	// goAwayServer, goAwayTracker).
	goAway atomic.Uint32
	// shutDownGen is gen+1 of the idle period shutDownH2 last armed its
	// timer for: one timer per idle period, whoever calls it.
	shutDownGen atomic.Uint64
	// shedActive is set when it was shed while active (Active in
	// ShedResult), for the closedAtBoundary count.
	shedActive atomic.Bool
	// idleAt is when its current idle period started (when it was
	// accepted, while new), as the tracker's clock (Tracker.now).
	idleAt atomic.Int64
	// quietGen is gen+1 of the idle period closeWhenQuiet last armed its
	// timer for: one timer per idle period, whoever calls it.
	quietGen atomic.Uint64
	// reused is set when a request starts on it after it was shed: its
	// client keeps using it, so Sweep may count it toward Held again
	// (overdue) even while it is idle between requests.
	reused atomic.Bool
}

// Senders of a GOAWAY on a shed HTTP/2 connection.
const (
	goAwayNone    uint32 = iota
	goAwayServer         // a response carried Connection: close, which Go's server turns into a GOAWAY
	goAwayTracker        // the tracker wrote goAwayFrame
)

// isH2 reports whether tc is known to speak HTTP/2.
func (tc *trackedConn) isH2() bool {
	if tc.h2.Load() {
		return true
	}
	if sawH2Preface(tc.conn) {
		tc.h2.Store(true)
		return true
	}
	return false
}

// idleSince reports whether tc is open and idle, and has not changed
// state since its gen was gen.
func (tc *trackedConn) idleSince(gen uint64) bool {
	return tc.state.Load() == connIdle && tc.gen.Load() == gen && !tc.closed.Load()
}

// noteServerGoAway records that a response on tc, an HTTP/2 connection,
// carries Connection: close: Go's server sends a GOAWAY for it and closes
// the connection once its streams are done.
func (tc *trackedConn) noteServerGoAway() {
	tc.goAway.CompareAndSwap(goAwayNone, goAwayServer)
}

// closeAtBoundary reports whether tc was shed and is to close at its
// next response boundary (overdue ones too: they still close there).
func (tc *trackedConn) closeAtBoundary() bool {
	s := tc.shed.Load()
	return s == shedClosing || s == shedOverdue
}

// h2IdleCloseDelay is how long a shed HTTP/2 connection must have been
// idle (no open stream) before the tracker writes a GOAWAY to it or,
// after one, closes it. Go's HTTP/2 server reports a connection idle when
// its last stream ends, before the frames it buffered are flushed; a
// second later they are long gone, so the GOAWAY lands between two
// frames, and a client that was opening a stream as the GOAWAY left has
// had a round trip to do so (Go's server waits the same second after its
// own GOAWAY before it closes).
const h2IdleCloseDelay = time.Second

// goAwayFrame is the HTTP/2 GOAWAY frame (RFC 9113 §6.8) the tracker
// sends a shed idle connection: last stream ID 2^31-1 and NO_ERROR, the
// first GOAWAY of a graceful shutdown. The client opens no new stream on
// the connection and reconnects for the next one (grpc-go and Go's client
// retry any that raced the frame on a new connection), while every stream
// it already opened is still served: the server does not know of the
// frame. So it needs no stream ID from the server, and a GOAWAY Go's
// server sends later (a response through WrapResponseWriter) can only
// lower the ID, as the RFC requires.
var goAwayFrame = append([]byte{
	0, 0, 8 + byte(len(goAwayDebug)), // payload length
	0x7,        // type GOAWAY
	0,          // no flags
	0, 0, 0, 0, // stream 0
	0x7f, 0xff, 0xff, 0xff, // last stream ID
	0, 0, 0, 0, // NO_ERROR
}, goAwayDebug...)

// goAwayDebug is the GOAWAY's debug data, which clients log (grpc-go as
// `debug data: "rebalance: connection shed"`).
const goAwayDebug = "rebalance: connection shed"

// baseConn returns the connection net/http accepted for c: Go's server
// hands cleartext HTTP/2 (h2c) connections to its HTTP/2 server wrapped
// in a *tls.Conn that is not one, and reports their HTTP/2 states with
// the wrapper, while ConnContext and StateClosed see the accepted one.
func baseConn(c net.Conn) (base net.Conn, h2 bool) {
	if tc, ok := c.(*tls.Conn); ok {
		if u, ok := tc.NetConn().(interface{ UnencryptedNetConn() net.Conn }); ok {
			return u.UnencryptedNetConn(), true
		}
		return c, tc.ConnectionState().NegotiatedProtocol == "h2"
	}
	return c, false
}

// closeIdle closes tc, which is idle and shed, without racing a request:
// an HTTP/1 connection once it has stayed idle for IdleCloseAfter with no
// request arriving (closeWhenQuiet; a request before that gets
// "Connection: close" through WrapResponseWriter); an HTTP/2 one
// gracefully (shutDownH2).
func (t *Tracker) closeIdle(tc *trackedConn) {
	if tc.isH2() {
		t.shutDownH2(tc)
		return
	}
	t.closeWhenQuiet(tc)
}

// shutDownH2 shuts down tc, a shed HTTP/2 connection that is idle, once
// it has stayed idle for h2IdleCloseDelay: without a GOAWAY so far, it
// writes goAwayFrame, and closes the connection h2IdleCloseDelay later if
// it is still idle then (the client usually closes it first: grpc-go and
// Go's client do as soon as they have no stream left); after a GOAWAY,
// it closes the connection. A connection that becomes active meanwhile
// comes back here at its next idle transition, and Sweep's
// boundary_timeout bounds a stream that does not end.
//
// Cutting an idle HTTP/2 connection instead is not safe: a client that
// sends a request on it as it closes loses that request (grpc-go fails
// the RPC with "error reading from server: EOF"), since nothing told it
// the connection was going. The GOAWAY goes through the connection
// net/http serves (the *tls.Conn over TLS, so that it is encrypted; the
// accepted connection for h2c), whose writes are serialized per Write
// call (the TLS output lock, the socket's write lock); with no open stream
// for h2IdleCloseDelay, the server has nothing buffered, and whatever it
// writes next (a PING or SETTINGS acknowledgement) is one whole Write.
func (t *Tracker) shutDownH2(tc *trackedConn) {
	gen := tc.gen.Load()
	if tc.shutDownGen.Swap(gen+1) == gen+1 {
		return
	}
	time.AfterFunc(h2IdleCloseDelay, func() {
		if !tc.idleSince(gen) {
			return
		}
		if !tc.goAway.CompareAndSwap(goAwayNone, goAwayTracker) {
			t.closeShed(tc, nil)
			return
		}
		// The close is armed first: the write blocks on a client that
		// reads nothing, and closing the connection frees it.
		time.AfterFunc(h2IdleCloseDelay, func() {
			if tc.idleSince(gen) {
				t.closeShed(tc, nil)
			}
		})
		if _, err := tc.conn.Write(goAwayFrame); err != nil {
			tc.closeConn()
			return
		}
		t.goAways.Add(1)
	})
}

// closeShed closes tc, a shed connection that is idle after its last
// response, counting it in closedAtBoundary if it was shed while active,
// and in also unless nil, once. The counts come first: whoever sees the
// close sees them.
func (t *Tracker) closeShed(tc *trackedConn, also *atomic.Uint64) {
	if !tc.closed.CompareAndSwap(false, true) {
		return
	}
	if tc.shedActive.Load() {
		t.closedAtBoundary.Add(1)
	}
	if also != nil {
		also.Add(1)
	}
	// net/http then reports StateClosed, which forgets it.
	_ = tc.conn.Close()
}

// markClosing marks tc shed (counted in Closing, out of Held) and
// reports whether this call did: a connection is shed at most once, and
// never after the tracker forgot it. The caller holds shedMu.
func (t *Tracker) markClosing(tc *trackedConn) bool {
	if tc.shed.CompareAndSwap(notShed, shedClosing) {
		tc.shedAt.Store(int64(t.now()))
		t.closing.Add(1)
		return true
	}
	return false
}

// closeStream closes tc, a hijacked connection, and reports whether this
// call did: a WebSocket whose frames WrapResponseWriter's writer follows
// gets a close frame at its next frame boundary and is closed shortly
// after; any other stream is closed at once.
func (t *Tracker) closeStream(tc *trackedConn) bool {
	ws := tc.ws.Load()
	if ws == nil {
		return tc.closeConn()
	}
	if tc.closed.CompareAndSwap(false, true) {
		ws.closeGracefully(&t.wsCloses)
		return true
	}
	return false
}

// closeConn closes tc's connection once, and reports whether this call
// closed it.
func (tc *trackedConn) closeConn() bool {
	if tc.closed.CompareAndSwap(false, true) {
		_ = tc.conn.Close()
		return true
	}
	return false
}

// Counts are the connections a tracker holds, by state.
type Counts struct {
	// New connections have not sent a request yet.
	New int `json:"new"`
	// Active connections have a request in progress (HTTP/1) or at least
	// one open stream (HTTP/2).
	Active int `json:"active"`
	// Idle connections are kept alive between requests.
	Idle int `json:"idle"`
	// Hijacked connections were taken over by a handler: WebSocket and
	// other upgraded streams.
	Hijacked int `json:"hijacked"`
	// Closing connections were shed and are not closed yet: active ones
	// wait for a response boundary; idle HTTP/1 ones for their next
	// response (which carries Connection: close) or for IdleCloseAfter
	// without a request; idle HTTP/2 ones are gone within about 2 s (see
	// Shed). They are included in the other counts.
	Closing int `json:"closing"`
	// Overdue connections were shed and are still open Sweep's
	// recountAfter (the rebalance app's `history`) later: a response
	// that does not end (server-sent events, a long poll, an endless
	// download, a long HTTP/2 stream). They count toward Held again, are
	// included in the other counts and not in Closing, and still close at
	// their response boundary (or at Sweep's boundaryTimeout).
	Overdue int `json:"overdue"`
}

// total returns the number of connections held, in any state.
func (c Counts) total() int { return c.New + c.Active + c.Idle + c.Hijacked }

// Held returns the connections that count toward the load they put on
// this process: all of them except those already shed and waiting for a
// response boundary (until Sweep counts them again as overdue).
func (c Counts) Held() int { return c.total() - c.Closing }

// ShedResult says how a shed was carried out.
type ShedResult struct {
	// Idle connections (and new ones without a request after 5 s):
	// HTTP/1 ones marked, to close at their next response boundary or
	// once idle for IdleCloseAfter with no request arriving; HTTP/2 ones
	// sent a GOAWAY after a second without a stream, then closed.
	Idle int `json:"idle"`
	// Active connections marked to close at their next response boundary.
	Active int `json:"active"`
	// Hijacked (upgraded) connections closed.
	Hijacked int `json:"hijacked"`
}

// Total returns the number of connections shed.
func (r ShedResult) Total() int { return r.Idle + r.Active + r.Hijacked }

// Tracker counts the connections of the HTTP servers it is registered
// with, by state, and sheds them gracefully. Register its ConnState and
// ConnContext methods with each server (http.Server's fields, or Caddy's
// Server.RegisterConnState and RegisterConnContext); a tracker may serve
// several servers, and connections of a server from a previous config stay
// tracked until they close. It is safe for concurrent use; the per-request
// cost is a sync.Map load and an atomic store. Create it with NewTracker.
type Tracker struct {
	conns  sync.Map // net.Conn -> *trackedConn
	counts [numConnStates]atomic.Int64
	// closing and overdue count tracked connections in the shed states
	// shedClosing and shedOverdue.
	closing, overdue atomic.Int64

	// Totals since the tracker was created.
	shedIdle, shedActive, shedHijacked atomic.Uint64
	closedAtBoundary, forced           atomic.Uint64
	goAways                            atomic.Uint64
	wsCloses                           wsCloseCounters
	// idleCloses counts shed connections closed after IdleCloseAfter
	// idle; inputSeen the checks that found a request arriving instead.
	idleCloses, inputSeen atomic.Uint64

	// idleCloseAfter is SetIdleCloseAfter's bound (0: the default).
	idleCloseAfter atomic.Int64

	shedMu sync.Mutex // one Shed or Sweep at a time
}

// NewTracker returns a tracker with no connections.
func NewTracker() *Tracker { return new(Tracker) }

// now returns the tracker's clock, lbx's one monotonic clock (a
// wall-clock step cannot force or recount a connection early).
func (t *Tracker) now() time.Duration { return time.Duration(monoclock.Now()) }

// connCtxKey is the context key under which ConnContext stores the
// connection's *trackedConn.
type connCtxKey struct{}

// load returns the tracked connection for c, creating it in state New.
func (t *Tracker) load(c net.Conn) *trackedConn {
	if v, ok := t.conns.Load(c); ok {
		return v.(*trackedConn)
	}
	tc := &trackedConn{conn: c, since: time.Now()}
	tc.state.Store(connNew)
	tc.idleAt.Store(int64(t.now()))
	v, loaded := t.conns.LoadOrStore(c, tc)
	if !loaded {
		t.counts[connNew].Add(1)
	}
	return v.(*trackedConn)
}

// setState moves tc to state s, keeping the counts. Only net/http's
// ConnState calls it, one call at a time for a connection.
func (t *Tracker) setState(tc *trackedConn, s uint32) {
	if tc.state.Load() == s {
		return
	}
	if s == connIdle {
		// Before the state: whoever sees it idle sees when it became so.
		tc.idleAt.Store(int64(t.now()))
	}
	// gen first: a timer that saw the old state with the old gen must not
	// act in the new state.
	tc.gen.Add(1)
	old := tc.state.Swap(s)
	if old != s {
		t.counts[old].Add(-1)
		t.counts[s].Add(1)
	}
}

// ConnContext stores the connection's tracking entry in the connection's
// context, for WrapResponseWriter. Register it with
// http.Server.ConnContext or Caddy's Server.RegisterConnContext.
func (t *Tracker) ConnContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connCtxKey{}, t.load(c))
}

// ConnState follows a connection through its states. Register it with
// http.Server.ConnState or Caddy's Server.RegisterConnState. A shed
// connection that becomes idle (its response written and flushed, no
// other request read) is closed from here without racing its client's
// next request (closeIdle): an HTTP/1 one whose response did not carry
// Connection: close (no WrapResponseWriter on its route) once it has
// stayed idle for IdleCloseAfter.
func (t *Tracker) ConnState(c net.Conn, s http.ConnState) {
	c, h2 := baseConn(c)
	if h2 && s != http.StateClosed {
		t.load(c).h2.Store(true)
	}
	switch s {
	case http.StateNew:
		t.load(c)
	case http.StateActive:
		tc := t.load(c)
		t.setState(tc, connActive)
		if tc.closeAtBoundary() {
			tc.reused.Store(true)
		}
	case http.StateIdle:
		tc := t.load(c)
		// State first, then the flag: Shed sets the flag, then reads the
		// state, so one of the two sees the other and closes.
		t.setState(tc, connIdle)
		if tc.closeAtBoundary() {
			t.closeIdle(tc)
		}
	case http.StateHijacked:
		t.setState(t.load(c), connHijacked)
	case http.StateClosed:
		t.forget(c)
	}
}

// forget removes c from the tracker.
func (t *Tracker) forget(c net.Conn) {
	v, ok := t.conns.LoadAndDelete(c)
	if !ok {
		return
	}
	tc := v.(*trackedConn)
	t.counts[tc.state.Load()].Add(-1)
	switch tc.shed.Swap(shedGone) {
	case shedClosing:
		t.closing.Add(-1)
	case shedOverdue:
		t.overdue.Add(-1)
	}
}

// Counts returns the connections held now, by state.
func (t *Tracker) Counts() Counts {
	return Counts{
		New:      int(t.counts[connNew].Load()),
		Active:   int(t.counts[connActive].Load()),
		Idle:     int(t.counts[connIdle].Load()),
		Hijacked: int(t.counts[connHijacked].Load()),
		Closing:  int(t.closing.Load()),
		Overdue:  int(t.overdue.Load()),
	}
}

// GoAwayTotal returns how many GOAWAY frames the tracker wrote to shed
// idle HTTP/2 connections since it was created (shutDownH2).
func (t *Tracker) GoAwayTotal() uint64 { return t.goAways.Load() }

// Shed sheds up to n connections, gracefully: idle connections first,
// then active connections, and hijacked connections (WebSockets and other
// upgraded streams) last, closed. No connection a request may be on is
// closed: an idle HTTP/1 connection, or a new one without a request after
// 5 s, is marked, like an active one: its next response carries
// Connection: close (through WrapResponseWriter) and it closes at that
// boundary; one that stays idle for IdleCloseAfter with no request
// arriving is closed then (closeWhenQuiet). An active one on a route
// without WrapResponseWriter goes the same way from its next idle
// transition. HTTP/2 connections get a GOAWAY (shutDownH2). New
// connections younger than 5 s are left alone: their first request may be
// on its way. Connections already shed are not counted again, even once
// they count toward Held again (Sweep). A WebSocket whose upgrade went
// through WrapResponseWriter gets a close frame (going away) first.
func (t *Tracker) Shed(n int) ShedResult {
	var res ShedResult
	if n <= 0 {
		return res
	}
	t.shedMu.Lock()
	defer t.shedMu.Unlock()
	now := time.Now()
	var active, hijacked []*trackedConn
	t.conns.Range(func(_, v any) bool {
		tc := v.(*trackedConn)
		if tc.shed.Load() != notShed {
			return true
		}
		switch tc.state.Load() {
		case connIdle:
			if res.Idle < n && t.markClosing(tc) {
				res.Idle++
				t.closeIdle(tc)
			}
		case connNew:
			if res.Idle < n && now.Sub(tc.since) >= newConnGrace && t.markClosing(tc) {
				res.Idle++
				t.closeWhenQuiet(tc)
			}
		case connActive:
			if len(active) < n {
				active = append(active, tc)
			}
		case connHijacked:
			if len(hijacked) < n {
				hijacked = append(hijacked, tc)
			}
		}
		return true
	})
	for _, tc := range active {
		if res.Total() >= n {
			break
		}
		tc.shedActive.Store(true) // before the mark, which ConnState may act on
		if t.markClosing(tc) {
			res.Active++
			// It may have become idle meanwhile, in which case no
			// transition will close it: close it now.
			if tc.state.Load() == connIdle {
				t.closeIdle(tc)
			}
		}
	}
	for _, tc := range hijacked {
		if res.Total() >= n {
			break
		}
		if t.markClosing(tc) {
			res.Hijacked++
			t.closeStream(tc)
			// net/http no longer reports anything about a hijacked conn.
			t.forget(tc.conn)
		}
	}
	t.shedIdle.Add(uint64(res.Idle))
	t.shedActive.Add(uint64(res.Active))
	t.shedHijacked.Add(uint64(res.Hijacked))
	return res
}

// SweepResult says what one Sweep did.
type SweepResult struct {
	// Hijacked connections found closed, and forgotten.
	Hijacked int
	// Overdue shed connections, still open recountAfter after they were
	// shed, count toward Held again from this sweep on.
	Overdue int
	// Forced shed connections were closed because they had not reached a
	// response boundary within the boundary timeout.
	Forced int
}

// Sweep is the tracker's pass over its connections, once per decision
// interval (nothing here runs per request):
//   - it forgets hijacked connections that have been closed (net/http
//     reports nothing about a connection after handing it to a handler);
//     one whose file descriptor cannot be reached (a listener wrapper
//     that hides it) stays counted until it is shed;
//   - a shed connection still open recountAfter after it was shed counts
//     toward Held again: it is evidently not closing soon, and the caller
//     may shed others instead. It is not shed a second time. A shed
//     HTTP/1 connection idle (or new) with no request since the shed is
//     not counted again: it closes at its next response or after
//     IdleCloseAfter idle, whichever comes first, and its client, if it
//     comes back, reconnects elsewhere for the request after;
//   - with boundaryTimeout > 0, a shed connection still active (or
//     upgraded since) boundaryTimeout after it was shed is closed anyway,
//     cutting its response; an upgraded WebSocket whose frames
//     WrapResponseWriter's writer follows gets a close frame first.
//
// Zero recountAfter or boundaryTimeout turns that part off.
func (t *Tracker) Sweep(recountAfter, boundaryTimeout time.Duration) SweepResult {
	return t.sweep(t.now(), recountAfter, boundaryTimeout)
}

// sweep is Sweep at now, on the tracker's clock.
func (t *Tracker) sweep(now, recountAfter, boundaryTimeout time.Duration) SweepResult {
	t.shedMu.Lock()
	defer t.shedMu.Unlock()
	var res SweepResult
	t.conns.Range(func(_, v any) bool {
		tc := v.(*trackedConn)
		state := tc.state.Load()
		if state == connHijacked && connClosed(tc.conn) {
			t.forget(tc.conn)
			res.Hijacked++
			return true
		}
		if !tc.closeAtBoundary() || tc.closed.Load() {
			// Not shed, or closed by the tracker and about to be
			// forgotten.
			return true
		}
		age := now - time.Duration(tc.shedAt.Load())
		if boundaryTimeout > 0 && age >= boundaryTimeout && (state == connActive || state == connHijacked) {
			if state == connHijacked {
				if t.closeStream(tc) {
					res.Forced++
				}
				t.forget(tc.conn)
			} else if tc.closeConn() {
				// net/http reports StateClosed once the handler
				// returns, which forgets it.
				res.Forced++
			}
			return true
		}
		if (state == connIdle || state == connNew) && !tc.reused.Load() {
			// Waiting for its next request or for IdleCloseAfter.
			return true
		}
		if recountAfter > 0 && age >= recountAfter && tc.shed.CompareAndSwap(shedClosing, shedOverdue) {
			t.closing.Add(-1)
			t.overdue.Add(1)
			res.Overdue++
		}
		return true
	})
	t.forced.Add(uint64(res.Forced))
	return res
}

// connClosed reports whether c's socket is known to be closed. It unwraps
// TLS (NetConn) and PROXY-protocol (Raw) wrappers down to a syscall.Conn,
// whose RawConn.Control fails once the descriptor is closed.
func connClosed(c net.Conn) bool {
	sc, ok := findConn[syscall.Conn](c)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	return raw.Control(func(uintptr) {}) != nil
}
