package conntrack

import (
	"time"
)

// DefaultIdleCloseAfter is how long a shed HTTP/1 connection must stay
// idle before the tracker closes it outright, unless SetIdleCloseAfter
// says otherwise: longer than the keep-alive pools of common clients
// (Go's http.Transport 90 s, nginx's upstream keepalive_timeout 60 s,
// libcurl 118 s), which drop the connection first, and shorter than
// Caddy's own idle_timeout (5 min), which would close it anyway.
const DefaultIdleCloseAfter = 2 * time.Minute

// dataSlack is how much earlier than the start of an idle period the
// kernel may date the last data received (TCP_INFO counts in jiffies, 1
// to 10 ms) before the data counts as having arrived during the period.
const dataSlack = 25 * time.Millisecond

// inputState is what readInput learnt of a connection's incoming bytes.
type inputState struct {
	// waiting is the number of bytes received and not yet read.
	waiting      int
	waitingKnown bool
	// sinceData is how long ago the last data arrived.
	sinceData      time.Duration
	sinceDataKnown bool
}

// requestArriving reports whether in shows bytes of a request arriving
// on a connection idle for idleFor: bytes waiting to be read, or data
// received during the idle period (net/http reads a request's first
// bytes as they come, and reports the connection active only once its
// header is whole).
func (in inputState) requestArriving(idleFor time.Duration) bool {
	return in.waitingKnown && in.waiting > 0 ||
		in.sinceDataKnown && in.sinceData+dataSlack < idleFor
}

// SetIdleCloseAfter sets how long a shed HTTP/1 connection must stay
// idle before the tracker closes it outright (see Shed); d <= 0 restores
// DefaultIdleCloseAfter. It applies to the idle periods that start
// after the call.
func (t *Tracker) SetIdleCloseAfter(d time.Duration) {
	if d <= 0 {
		d = DefaultIdleCloseAfter
	}
	t.idleCloseAfter.Store(int64(d))
}

// IdleCloseAfter returns the bound SetIdleCloseAfter set.
func (t *Tracker) IdleCloseAfter() time.Duration {
	if d := time.Duration(t.idleCloseAfter.Load()); d > 0 {
		return d
	}
	return DefaultIdleCloseAfter
}

// IdleCloseTotal returns how many shed connections the tracker closed
// outright after they stayed idle for IdleCloseAfter, since it was
// created.
func (t *Tracker) IdleCloseTotal() uint64 { return t.idleCloses.Load() }

// quietSince reports whether tc is open and without a request (idle, or
// new), and has not changed state since its gen was gen.
func (tc *trackedConn) quietSince(gen uint64) bool {
	s := tc.state.Load()
	return (s == connIdle || s == connNew) && tc.gen.Load() == gen && !tc.closed.Load()
}

// closeWhenQuiet closes tc, a shed HTTP/1 connection without a request
// in progress (idle, or new past newConnGrace), once it has been so for
// IdleCloseAfter, measured from the start of its idle period (from its
// accept for a new one), and only if no request is arriving on it: no
// bytes waiting on the socket, and no data received since the period
// started (requestArriving). Closing it any earlier would race a client
// that sends its next request on it at that moment, which a client that
// does not retry (Python's http.client, any POST) reports as an error;
// until then, a request on it gets "Connection: close" on its response
// (WrapResponseWriter) and the connection closes at that boundary.
//
// When a request is arriving it is left to net/http: the request
// becomes active (and comes back here at its next idle transition, if no
// Connection: close ended it), or net/http's header timeout closes it;
// the check is repeated every IdleCloseAfter meanwhile. Where the socket
// cannot be read (not Linux, or a listener wrapper that hides it), the
// connection is closed once idle for the bound without the check, which
// is the race of a server's own idle timeout of that length.
//
// One timer per idle period: a state change (a request) makes it do
// nothing.
func (t *Tracker) closeWhenQuiet(tc *trackedConn) {
	gen := tc.gen.Load()
	if tc.quietGen.Swap(gen+1) == gen+1 {
		return
	}
	idleFor := t.now() - time.Duration(tc.idleAt.Load())
	t.armQuiet(tc, gen, t.IdleCloseAfter()-idleFor)
}

// armQuiet checks tc, idle since gen, after delay (closeWhenQuiet).
func (t *Tracker) armQuiet(tc *trackedConn, gen uint64, delay time.Duration) {
	time.AfterFunc(max(delay, 0), func() {
		if !tc.quietSince(gen) {
			return
		}
		bound := t.IdleCloseAfter()
		idleFor := t.now() - time.Duration(tc.idleAt.Load())
		if idleFor < bound {
			// The bound was raised since the timer was armed.
			t.armQuiet(tc, gen, bound-idleFor)
			return
		}
		if readInput(tc.conn).requestArriving(idleFor) {
			t.inputSeen.Add(1)
			t.armQuiet(tc, gen, bound)
			return
		}
		if tc.quietSince(gen) {
			t.closeShed(tc, &t.idleCloses)
		}
	})
}
