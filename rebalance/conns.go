package rebalance

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
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
	shedOverdue        // shed, still open `history` later: counted again
	shedGone           // forgotten by the tracker
)

// trackerEpoch is the origin of trackedConn.shedAt: durations since it
// use the monotonic clock, so a wall-clock step cannot force or recount
// a connection early.
var trackerEpoch = time.Now()

// trackedConn is one connection the tracker knows.
type trackedConn struct {
	conn  net.Conn
	state atomic.Uint32
	since time.Time // when it was accepted
	// shed is the connection's shed state (notShed, shedClosing, …). A
	// shed active connection gets "Connection: close" on its next
	// response (when the request passes through Middleware or
	// CloseHandler) and is closed when it next becomes idle.
	shed atomic.Uint32
	// shedAt is when it was shed, as time since trackerEpoch; written by
	// Shed and read by Sweep, both under the tracker's shedMu.
	shedAt atomic.Int64
	// ws is set by CloseHandler when the connection is upgraded to a
	// WebSocket whose frames it follows: the tracker then closes the
	// stream with a close frame instead of cutting it (see wsclose.go).
	ws atomic.Pointer[wsConn]
	// closed is set by the first close from the tracker.
	closed atomic.Bool
	// h2 is set once the connection is seen to speak HTTP/2: over TLS
	// from its ALPN protocol; in clear text (h2c) when a request on it
	// passes through CloseHandler or Middleware (Go's server reports
	// h2c connections' states like HTTP/1 ones).
	h2 atomic.Bool
}

// closeAtBoundary reports whether tc was shed and is to close at its
// next response boundary (overdue ones too: they still close there).
func (tc *trackedConn) closeAtBoundary() bool {
	s := tc.shed.Load()
	return s == shedClosing || s == shedOverdue
}

// h2IdleCloseDelay is how long a shed HTTP/2 connection is left idle
// before the tracker closes it: Go's HTTP/2 server reports a connection
// idle when its last stream's handler returns, before the response's
// last frames are written, so closing at once could cut them off. A
// response that passed through CloseHandler sent a GOAWAY and the server
// closes the connection itself, usually sooner.
const h2IdleCloseDelay = time.Second

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

// closeIdle closes tc, which is idle and shed. An HTTP/2 connection is
// closed after h2IdleCloseDelay if it is still idle then.
func (t *ConnTracker) closeIdle(tc *trackedConn) {
	if !tc.h2.Load() {
		if tc.closeConn() {
			// net/http then reports StateClosed, which forgets it.
			t.closedAtBoundary.Add(1)
		}
		return
	}
	time.AfterFunc(h2IdleCloseDelay, func() {
		if tc.state.Load() == connIdle && tc.closeConn() {
			t.closedAtBoundary.Add(1)
		}
	})
}

// markClosing marks tc shed (counted in Closing, out of Held) and
// reports whether this call did: a connection is shed at most once, and
// never after the tracker forgot it. The caller holds shedMu.
func (t *ConnTracker) markClosing(tc *trackedConn) bool {
	if tc.shed.CompareAndSwap(notShed, shedClosing) {
		tc.shedAt.Store(int64(time.Since(trackerEpoch)))
		t.closing.Add(1)
		return true
	}
	return false
}

// closeStream closes tc, a hijacked connection, and reports whether this
// call did: a WebSocket whose frames CloseHandler follows gets a close
// frame at its next frame boundary and is closed shortly after; any
// other stream is closed at once.
func (t *ConnTracker) closeStream(tc *trackedConn) bool {
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

// ConnCounts are the connections a tracker holds, by state.
type ConnCounts struct {
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
	// wait for a response boundary; idle ones are gone within moments.
	// They are included in the other counts.
	Closing int `json:"closing"`
	// Overdue connections were shed and are still open `history` (the
	// smoothing window) later: a response that does not end (server-sent
	// events, a long poll, an endless download, a long HTTP/2 stream).
	// They count toward Held again, are included in the other counts and
	// not in Closing, and still close at their response boundary (or at
	// boundary_timeout).
	Overdue int `json:"overdue"`
}

// Total returns the number of connections held, in any state.
func (c ConnCounts) Total() int { return c.New + c.Active + c.Idle + c.Hijacked }

// Held returns the connections that count toward this node's load: all of
// them except those already shed and waiting for a response boundary (for
// at most `history`: overdue ones count again).
func (c ConnCounts) Held() int { return c.Total() - c.Closing }

// ShedResult says how a shed was carried out.
type ShedResult struct {
	// Idle connections closed at once.
	Idle int `json:"idle"`
	// Active connections marked to close at their next response boundary.
	Active int `json:"active"`
	// Hijacked (upgraded) connections closed.
	Hijacked int `json:"hijacked"`
}

// Total returns the number of connections shed.
func (r ShedResult) Total() int { return r.Idle + r.Active + r.Hijacked }

// ConnTracker counts the connections of the HTTP servers it is registered
// with, by state, and sheds them gracefully. Register its ConnState and
// ConnContext methods with each server (Caddy's
// Server.RegisterConnState and RegisterConnContext); a tracker may serve
// several servers, and connections of a server from a previous config stay
// tracked until they close. It is safe for concurrent use; the per-request
// cost is a sync.Map load and an atomic store.
type ConnTracker struct {
	conns  sync.Map // net.Conn -> *trackedConn
	counts [numConnStates]atomic.Int64
	// closing and overdue count tracked connections in the shed states
	// shedClosing and shedOverdue.
	closing, overdue atomic.Int64

	// Totals since the tracker was created.
	shedIdle, shedActive, shedHijacked atomic.Uint64
	closedAtBoundary, forced           atomic.Uint64
	wsCloses                           wsCloseCounters

	shedMu sync.Mutex // one Shed or Sweep at a time
}

// connCtxKey is the context key under which ConnContext stores the
// connection's *trackedConn.
type connCtxKey struct{}

// load returns the tracked connection for c, creating it in state New.
func (t *ConnTracker) load(c net.Conn) *trackedConn {
	if v, ok := t.conns.Load(c); ok {
		return v.(*trackedConn)
	}
	tc := &trackedConn{conn: c, since: time.Now()}
	tc.state.Store(connNew)
	v, loaded := t.conns.LoadOrStore(c, tc)
	if !loaded {
		t.counts[connNew].Add(1)
	}
	return v.(*trackedConn)
}

// setState moves tc to state s, keeping the counts.
func (t *ConnTracker) setState(tc *trackedConn, s uint32) {
	old := tc.state.Swap(s)
	if old != s {
		t.counts[old].Add(-1)
		t.counts[s].Add(1)
	}
}

// ConnContext stores the connection's tracking entry in the connection's
// context, for Middleware. Register it with http.Server.ConnContext or
// Caddy's Server.RegisterConnContext.
func (t *ConnTracker) ConnContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connCtxKey{}, t.load(c))
}

// ConnState follows a connection through its states. Register it with
// http.Server.ConnState or Caddy's Server.RegisterConnState. An active
// connection that was shed is closed here when it becomes idle: its
// response has been written and flushed, and no other request has been
// read from it.
func (t *ConnTracker) ConnState(c net.Conn, s http.ConnState) {
	c, h2 := baseConn(c)
	if h2 && s != http.StateClosed {
		t.load(c).h2.Store(true)
	}
	switch s {
	case http.StateNew:
		t.load(c)
	case http.StateActive:
		t.setState(t.load(c), connActive)
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
func (t *ConnTracker) forget(c net.Conn) {
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
func (t *ConnTracker) Counts() ConnCounts {
	return ConnCounts{
		New:      int(t.counts[connNew].Load()),
		Active:   int(t.counts[connActive].Load()),
		Idle:     int(t.counts[connIdle].Load()),
		Hijacked: int(t.counts[connHijacked].Load()),
		Closing:  int(t.closing.Load()),
		Overdue:  int(t.overdue.Load()),
	}
}

// ShedTotals returns how many connections were shed since the tracker was
// created, by how, and how many of the active ones have been closed at a
// response boundary so far.
func (t *ConnTracker) ShedTotals() (shed ShedResult, closedAtBoundary uint64) {
	return ShedResult{
		Idle:     int(t.shedIdle.Load()),
		Active:   int(t.shedActive.Load()),
		Hijacked: int(t.shedHijacked.Load()),
	}, t.closedAtBoundary.Load()
}

// ForcedTotal returns how many shed connections Sweep closed since the
// tracker was created because they did not reach a response boundary
// within the boundary timeout.
func (t *ConnTracker) ForcedTotal() uint64 { return t.forced.Load() }

// Shed sheds up to n connections, gracefully: idle connections first
// (closed at once; a client that reuses one at that very moment sees the
// ordinary keep-alive race every HTTP client handles), then active
// connections (marked, then closed at their next response boundary), and
// hijacked connections (WebSockets and other upgraded streams) last,
// closed. New connections younger than 5 s are left alone: their first
// request may be on its way. Connections already shed are not counted
// again, even once they count toward Held again (Sweep). A WebSocket
// behind CloseHandler gets a close frame (going away) first.
func (t *ConnTracker) Shed(n int) ShedResult {
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
				tc.closeConn()
			}
		case connNew:
			if res.Idle < n && now.Sub(tc.since) >= newConnGrace && t.markClosing(tc) {
				res.Idle++
				tc.closeConn()
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
//   - a shed connection still open recountAfter (the app's `history`)
//     after it was shed counts toward Held again: it is evidently not
//     closing soon, and the node may shed others instead. It is not shed
//     a second time;
//   - with boundaryTimeout > 0, a shed connection still active (or
//     upgraded since) boundaryTimeout after it was shed is closed anyway,
//     cutting its response; an upgraded WebSocket behind CloseHandler gets
//     a close frame first.
//
// Zero recountAfter or boundaryTimeout turns that part off.
func (t *ConnTracker) Sweep(recountAfter, boundaryTimeout time.Duration) SweepResult {
	return t.sweep(time.Since(trackerEpoch), recountAfter, boundaryTimeout)
}

// sweep is Sweep at now (time since trackerEpoch).
func (t *ConnTracker) sweep(now, recountAfter, boundaryTimeout time.Duration) SweepResult {
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
	for range 8 {
		switch w := c.(type) {
		case interface{ NetConn() net.Conn }:
			c = w.NetConn()
			continue
		case interface{ Raw() net.Conn }:
			c = w.Raw()
			continue
		}
		break
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	return raw.Control(func(uintptr) {}) != nil
}

// ClosingConn reports whether the connection that carries r was shed and
// should close after this response.
func ClosingConn(r *http.Request) bool {
	tc, ok := r.Context().Value(connCtxKey{}).(*trackedConn)
	return ok && tc.closeAtBoundary()
}

// Middleware wraps next so that a response on a connection that was shed
// carries "Connection: close": HTTP/1.1 clients then open a new connection
// (through the outer load balancer) for their next request instead of
// racing the close, and Go's HTTP/2 server turns the header into a
// graceful GOAWAY. A request on a connection that is shed while its
// handler runs closes at the next idle transition instead.
func Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tc, ok := r.Context().Value(connCtxKey{}).(*trackedConn); ok && r.ProtoMajor >= 2 {
			tc.h2.Store(true)
		}
		if ClosingConn(r) {
			w.Header().Set("Connection", "close")
		}
		next.ServeHTTP(w, r)
	})
}
