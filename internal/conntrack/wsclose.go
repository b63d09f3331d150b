package conntrack

import (
	"encoding/binary"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// This file makes shedding an upgraded WebSocket graceful. reverse_proxy
// hijacks the client connection for a protocol switch and copies bytes
// both ways; closing the socket under it ends the stream with an error
// as far as the client can tell (a close code 1006, "abnormal"). Through
// WrapResponseWriter the hijacked connection is wrapped in a wsConn, which
// follows the server-to-client frame stream, so that a shed sends a
// Close frame (1001, going away) between two frames: RFC 6455 §5.4 lets
// a control frame go between any two frames, even between the fragments
// of a message, so frame boundaries are all that matters.

// wsFrameLinger bounds the first wait of a graceful close: for the frame
// being written when the stream was shed to end. A client that reads
// nothing for that long holds the write, and gets the connection closed
// without a close frame. It is generous because a slow reader is not a
// dead one: one second proved too short for a client merely starved of
// CPU (TestWebSocketShedThroughCaddy under -race).
const wsFrameLinger = 5 * time.Second

// wsCloseLinger bounds the second wait: after the close frame, for the
// client to close its end before the server does.
const wsCloseLinger = time.Second

// closeFrameGoingAway is an unmasked (server-to-client) Close frame with
// status code 1001, going away: FIN and opcode 0x8, payload length 2,
// the code in network byte order (RFC 6455 §5.5.1, §7.4.1).
var closeFrameGoingAway = []byte{0x88, 0x02, 0x03, 0xe9}

// frameTracker follows the frames of one direction of a WebSocket stream
// (RFC 6455 §5.2) across arbitrary write chunking, to tell whether the
// bytes seen so far end exactly at a frame boundary. It reads headers
// (2 to 14 bytes) and skips payloads, so its cost is per frame, not per
// byte. It validates nothing: bytes that are not a WebSocket stream make
// it see frames of arbitrary lengths, never a panic.
type frameTracker struct {
	hdr     [14]byte // the header being read
	n       int      // bytes of hdr read so far; 0 between frames
	need    int      // the header's length, known once its 2nd byte is in
	payload uint64   // payload bytes of the current frame still to come
}

// atBoundary reports whether the bytes fed so far end a frame (or none
// was fed).
func (f *frameTracker) atBoundary() bool { return f.n == 0 && f.payload == 0 }

// feed consumes p and returns how many bytes it consumed: all of them, or
// with stop set, those up to the first frame boundary it reaches.
func (f *frameTracker) feed(p []byte, stop bool) int {
	i := 0
	for i < len(p) {
		if f.payload > 0 {
			if rest := uint64(len(p) - i); rest < f.payload {
				f.payload -= rest
				return len(p)
			}
			i += int(f.payload)
			f.payload = 0
			if stop {
				return i
			}
			continue
		}
		if f.n < 2 {
			f.hdr[f.n] = p[i]
			f.n++
			i++
			if f.n < 2 {
				continue
			}
			f.need = frameHeaderLen(f.hdr[1])
		} else {
			k := copy(f.hdr[f.n:f.need], p[i:])
			f.n += k
			i += k
		}
		if f.n == f.need {
			f.payload = framePayloadLen(f.hdr[:f.n])
			f.n = 0
			if f.payload == 0 && stop {
				return i
			}
		}
	}
	return i
}

// frameHeaderLen returns the length of a frame header whose second byte
// is b1: 2 bytes, then 2 or 8 of extended payload length (7-bit length
// 126 or 127), then 4 of masking key if the mask bit is set (servers do
// not mask, but the rule costs nothing).
func frameHeaderLen(b1 byte) int {
	n := 2
	switch b1 & 0x7f {
	case 126:
		n += 2
	case 127:
		n += 8
	}
	if b1&0x80 != 0 {
		n += 4
	}
	return n
}

// framePayloadLen returns the payload length a complete frame header h
// announces.
func framePayloadLen(h []byte) uint64 {
	switch l := h[1] & 0x7f; l {
	case 126:
		return uint64(binary.BigEndian.Uint16(h[2:4]))
	case 127:
		return binary.BigEndian.Uint64(h[2:10])
	default:
		return uint64(l)
	}
}

// Phases of a wsConn, in order.
const (
	wsOpen    uint32 = iota // frames pass through
	wsWaiting               // shed: the close frame goes at the next frame boundary
	wsSending               // the close frame is being written
	wsSent                  // written: later writes are dropped until the close
	wsClosed                // the connection is closed
)

// wsCloseCounters count how shed WebSocket streams whose frames a wsConn
// follows ended (one Tracker's).
type wsCloseCounters struct {
	frame, afterFrameEnd, noFrame atomic.Uint64
}

// WebSocketCloses says how the WebSocket streams shed whose upgrade went
// through WrapResponseWriter (Caddy's rebalance_close) ended, since the
// tracker was created.
type WebSocketCloses struct {
	// CloseFrame streams got a close frame with code 1001 (going away)
	// before their connection closed.
	CloseFrame uint64 `json:"close_frame"`
	// AfterFrameEnd of those were in the middle of a frame when shed:
	// the close frame went out as soon as that frame ended.
	AfterFrameEnd uint64 `json:"after_frame_end"`
	// WithoutFrame streams were closed without one: the frame being
	// written did not end within 1 s (a stalled writer or client), or the
	// proxy ended the stream first.
	WithoutFrame uint64 `json:"without_frame"`
}

// WebSocketCloses returns how the WebSocket streams shed through
// WrapResponseWriter ended so far. A stream shed less than about a second
// ago may not be counted yet (a close frame is counted just after it is
// written).
func (t *Tracker) WebSocketCloses() WebSocketCloses {
	return WebSocketCloses{
		CloseFrame:    t.wsCloses.frame.Load(),
		AfterFrameEnd: t.wsCloses.afterFrameEnd.Load(),
		WithoutFrame:  t.wsCloses.noFrame.Load(),
	}
}

// wsConn is the client connection of an upgraded WebSocket stream, as
// handed to the handler that hijacked it through WrapResponseWriter
// (Caddy's reverse_proxy copies the backend's frames into it). It follows
// the frames written to the client and serializes writes, so that
// closeGracefully can put a Close frame between two frames and nothing
// after it.
type wsConn struct {
	net.Conn
	// frameLinger and linger are wsFrameLinger and wsCloseLinger (tests
	// shorten them).
	frameLinger, linger time.Duration

	phase  atomic.Uint32
	counts *wsCloseCounters // set by closeGracefully before phase leaves wsOpen

	mu       sync.Mutex   // held across each write: a close frame never lands inside another frame
	frames   frameTracker // guarded by mu
	looked   bool         // guarded by mu: the close logic saw where the stream was
	midFrame bool         // guarded by mu: it was inside a frame then
}

// newWSConn wraps conn, just hijacked at a frame boundary (right after
// the 101 response).
func newWSConn(conn net.Conn) *wsConn {
	return &wsConn{Conn: conn, frameLinger: wsFrameLinger, linger: wsCloseLinger}
}

// Write writes p to the client. Once the stream is shed it writes only
// up to the end of the frame in progress, then the close frame, and
// drops everything after it while reporting success, so that the copier
// neither interleaves nor logs errors; once the connection is closed it
// fails with net.ErrClosed, which ends the copier.
func (c *wsConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.phase.Load() {
	case wsOpen:
		n, err := c.Conn.Write(p)
		c.frames.feed(p[:n], false)
		return n, err
	case wsWaiting:
		c.look()
		if !c.frames.atBoundary() {
			k := c.frames.feed(p, true)
			if n, err := c.Conn.Write(p[:k]); err != nil {
				return n, err
			}
			if !c.frames.atBoundary() {
				return len(p), nil // k == len(p): the frame goes on
			}
		}
		c.sendClose()
		return len(p), nil
	case wsSending, wsSent:
		return len(p), nil
	}
	return 0, net.ErrClosed
}

// Read reads from the client. After the close frame, the client's end of
// the connection closing (or failing) closes the server's at once.
func (c *wsConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && c.phase.Load() == wsSent {
		c.shut(wsSent, nil)
	}
	return n, err
}

// errNoCloseWrite is CloseWrite's error when the connection cannot close
// only its write half: the copier then ends the stream.
var errNoCloseWrite = errors.New("rebalance: connection cannot close its write half")

// CloseWrite closes the write half when the wrapped connection can (a
// TCP connection, as hijacked without an access log): reverse_proxy
// passes the backend's end of stream on that way.
func (c *wsConn) CloseWrite() error {
	cw, ok := c.Conn.(interface{ CloseWrite() error })
	if !ok {
		return errNoCloseWrite
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return cw.CloseWrite()
}

// Close closes the connection (the proxy ends the stream). A stream shed
// and still waiting for its frame to end is counted as closed without a
// close frame.
func (c *wsConn) Close() error {
	switch c.phase.Swap(wsClosed) {
	case wsWaiting, wsSending:
		c.counts.noFrame.Add(1)
	}
	return c.Conn.Close()
}

// closeGracefully starts closing the stream: a close frame at the next
// frame boundary (at once if the stream is at one), the connection closed
// linger later or when the client closes first; without a boundary within
// frameLinger, the connection is closed without a frame. It does not block
// (the tracker calls it while shedding) and runs at most once per
// connection (the tracker's closed flag sees to it); counts receive the
// outcome.
func (c *wsConn) closeGracefully(counts *wsCloseCounters) {
	c.counts = counts
	if !c.phase.CompareAndSwap(wsOpen, wsWaiting) {
		return // the proxy closed it already
	}
	// The deadline must not need mu: a write stalled on a client that
	// does not read holds it, and closing the connection is what frees it.
	time.AfterFunc(c.frameLinger, func() {
		if !c.shut(wsWaiting, &c.counts.noFrame) {
			c.shut(wsSending, &c.counts.noFrame)
		}
	})
	// An idle stream at a boundary gets its frame now, not at the next
	// write; a goroutine, since mu may be held by a write in progress.
	go c.closeIfAtBoundary()
}

// closeIfAtBoundary sends the close frame if the stream is shed and at a
// frame boundary; otherwise the write that ends the frame sends it.
func (c *wsConn) closeIfAtBoundary() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.phase.Load() != wsWaiting {
		return
	}
	c.look()
	if c.frames.atBoundary() {
		c.sendClose()
	}
}

// look records, the first time the close logic runs, whether the stream
// was inside a frame. The caller holds mu.
func (c *wsConn) look() {
	if !c.looked {
		c.looked = true
		c.midFrame = !c.frames.atBoundary()
	}
}

// sendClose writes the close frame and arranges for the connection to
// close linger later. The caller holds mu, at a frame boundary.
func (c *wsConn) sendClose() {
	if !c.phase.CompareAndSwap(wsWaiting, wsSending) {
		return
	}
	if _, err := c.Conn.Write(closeFrameGoingAway); err != nil {
		c.shut(wsSending, &c.counts.noFrame)
		return
	}
	if !c.phase.CompareAndSwap(wsSending, wsSent) {
		return // the deadline closed it meanwhile, and counted it
	}
	c.counts.frame.Add(1)
	if c.midFrame {
		c.counts.afterFrameEnd.Add(1)
	}
	time.AfterFunc(c.linger, func() { c.shut(wsSent, nil) })
}

// shut closes the connection if it is in phase from, and reports whether
// it did; it adds one to count (if any) first, so that whoever sees the
// connection close sees it counted.
func (c *wsConn) shut(from uint32, count *atomic.Uint64) bool {
	if !c.phase.CompareAndSwap(from, wsClosed) {
		return false
	}
	if count != nil {
		count.Add(1)
	}
	_ = c.Conn.Close()
	return true
}

// isWebSocketUpgrade reports whether r asks for an HTTP/1.1 upgrade to
// WebSocket (RFC 6455 §4.1: Upgrade: websocket, Connection: upgrade).
// HTTP/2 WebSockets (extended CONNECT, RFC 8441) are streams of an HTTP/2
// connection, not hijacked.
func isWebSocketUpgrade(r *http.Request) bool {
	return r.ProtoMajor == 1 && headerHasToken(r.Header["Connection"], "upgrade") &&
		headerHasToken(r.Header["Upgrade"], "websocket")
}

// headerHasToken reports whether a comma-separated header's values
// contain token, compared case-insensitively.
func headerHasToken(values []string, token string) bool {
	for _, v := range values {
		for part := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(part), token) {
				return true
			}
		}
	}
	return false
}
