package conntrack

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// wsFrame returns a server-to-client frame: header and a payload of
// length n, every byte fill; masked adds a masking key (client frames).
func wsFrame(fin bool, opcode byte, n int, masked bool, fill byte) []byte {
	b0 := opcode & 0x0f
	if fin {
		b0 |= 0x80
	}
	var mask byte
	if masked {
		mask = 0x80
	}
	var h []byte
	switch {
	case n < 126:
		h = []byte{b0, mask | byte(n)}
	case n <= 0xffff:
		h = binary.BigEndian.AppendUint16([]byte{b0, mask | 126}, uint16(n))
	default:
		h = binary.BigEndian.AppendUint64([]byte{b0, mask | 127}, uint64(n))
	}
	if masked {
		h = append(h, 1, 2, 3, 4)
	}
	p := make([]byte, n)
	for i := range p {
		p[i] = fill
	}
	return append(h, p...)
}

// wsStream concatenates frames and returns, for every offset 0..len, whether
// it is a frame boundary.
func wsStream(frames ...[]byte) (stream []byte, boundary []bool) {
	boundary = []bool{true}
	for _, f := range frames {
		stream = append(stream, f...)
		for range len(f) - 1 {
			boundary = append(boundary, false)
		}
		boundary = append(boundary, true)
	}
	return stream, boundary
}

// nextBoundary returns the first frame boundary after offset i.
func nextBoundary(boundary []bool, i int) int {
	for j := i + 1; j < len(boundary); j++ {
		if boundary[j] {
			return j
		}
	}
	return -1
}

// TestFrameTrackerForms feeds streams with every header form (7-bit,
// 16-bit and 64-bit payload lengths at their edges, masked or not,
// control frames between the fragments of a message) split in two
// (at every offset near a frame boundary) and byte by byte: the tracker is at a boundary exactly
// where a frame ends, and feeding with stop ends at the next boundary.
func TestFrameTrackerForms(t *testing.T) {
	for _, tc := range []struct {
		name   string
		frames [][]byte
	}{
		{"empty payload", [][]byte{wsFrame(true, 2, 0, false, 0)}},
		{"7-bit: 1", [][]byte{wsFrame(true, 2, 1, false, 1)}},
		{"7-bit: 125", [][]byte{wsFrame(true, 1, 125, false, 'a')}},
		{"16-bit: 126", [][]byte{wsFrame(true, 2, 126, false, 126)}},
		{"16-bit: 127", [][]byte{wsFrame(true, 2, 127, false, 127)}},
		{"16-bit: 65535", [][]byte{wsFrame(true, 2, 65535, false, 0xff)}},
		{"64-bit: 65536", [][]byte{wsFrame(true, 2, 65536, false, 0x7f)}},
		{"64-bit: 70000", [][]byte{wsFrame(true, 2, 70000, false, 0x81)}},
		{"masked, every form", [][]byte{wsFrame(true, 2, 5, true, 5), wsFrame(true, 2, 300, true, 3), wsFrame(true, 2, 66000, true, 6)}},
		{"close frame", [][]byte{closeFrameGoingAway}},
		{"fragments with control frames between", [][]byte{
			wsFrame(false, 1, 200, false, 't'), wsFrame(true, 9, 4, false, 'p'), wsFrame(false, 0, 0, false, 0),
			wsFrame(true, 10, 0, false, 0), wsFrame(true, 0, 70000, false, 'c'),
		}},
		{"many small", [][]byte{wsFrame(true, 2, 0, false, 0), wsFrame(true, 2, 1, false, 1), wsFrame(true, 2, 2, false, 2), wsFrame(true, 2, 0, false, 0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stream, boundary := wsStream(tc.frames...)
			// In two at every offset near a frame boundary (headers and
			// their edges), and every 997th inside long payloads.
			near := make([]bool, len(boundary))
			for i, b := range boundary {
				if b {
					for j := max(0, i-16); j <= min(len(boundary)-1, i+16); j++ {
						near[j] = true
					}
				}
			}
			for i := range len(stream) + 1 {
				if !near[i] && i%997 != 0 {
					continue
				}
				var f frameTracker
				if n := f.feed(stream[:i], false); n != i {
					t.Fatalf("feed(%d bytes) consumed %d", i, n)
				}
				if f.atBoundary() != boundary[i] {
					t.Fatalf("after %d of %d bytes: atBoundary %v; want %v", i, len(stream), f.atBoundary(), boundary[i])
				}
				if i < len(stream) {
					g := f
					want := nextBoundary(boundary, i) - i
					if n := g.feed(stream[i:], true); n != want || !g.atBoundary() {
						t.Fatalf("from %d: feed with stop consumed %d (at boundary %v); want %d", i, n, g.atBoundary(), want)
					}
				}
				f.feed(stream[i:], false)
				if !f.atBoundary() {
					t.Fatalf("split at %d: not at a boundary at the end", i)
				}
			}
			// Byte by byte.
			var f frameTracker
			for i := range stream {
				f.feed(stream[i:i+1], false)
				if f.atBoundary() != boundary[i+1] {
					t.Fatalf("byte by byte, after %d bytes: atBoundary %v; want %v", i+1, f.atBoundary(), boundary[i+1])
				}
			}
		})
	}
}

// randomFrames returns n frames of random kinds and lengths covering
// every header form.
func randomFrames(rng *rand.Rand, n int) [][]byte {
	var frames [][]byte
	for range n {
		var size int
		switch rng.IntN(4) {
		case 0:
			size = rng.IntN(126)
		case 1:
			size = 126 + rng.IntN(0xffff-126+1)
		case 2:
			size = 0x10000 + rng.IntN(100000)
		default:
			size = []int{0, 125, 126, 0xffff, 0x10000}[rng.IntN(5)]
		}
		frames = append(frames, wsFrame(rng.IntN(2) == 0, byte(rng.IntN(3)), size, rng.IntN(8) == 0, byte(rng.Uint32())))
	}
	return frames
}

// TestFrameTrackerRandomSplits feeds random streams in random chunks
// (1 byte to 200 kB) and checks the boundary after every chunk.
func TestFrameTrackerRandomSplits(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for run := range 200 {
		stream, boundary := wsStream(randomFrames(rng, 1+rng.IntN(12))...)
		var f frameTracker
		for off := 0; off < len(stream); {
			var k int
			switch rng.IntN(3) {
			case 0:
				k = 1 + rng.IntN(16)
			case 1:
				k = 1 + rng.IntN(4096)
			default:
				k = 1 + rng.IntN(200000)
			}
			k = min(k, len(stream)-off)
			f.feed(stream[off:off+k], false)
			off += k
			if f.atBoundary() != boundary[off] {
				t.Fatalf("run %d: after %d of %d bytes: atBoundary %v; want %v", run, off, len(stream), f.atBoundary(), boundary[off])
			}
		}
	}
}

// FuzzFrameTracker: any bytes, cut anywhere, leave the tracker in the
// same state as fed at once, and never panic.
func FuzzFrameTracker(f *testing.F) {
	f.Add(wsFrame(true, 2, 300, false, 1), uint64(7))
	f.Add(append(wsFrame(false, 1, 70000, false, 2), closeFrameGoingAway...), uint64(12345))
	f.Add([]byte{0x82, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, uint64(1))
	f.Fuzz(func(t *testing.T, data []byte, seed uint64) {
		var whole, cut frameTracker
		if n := whole.feed(data, false); n != len(data) {
			t.Fatalf("consumed %d of %d", n, len(data))
		}
		rng := rand.New(rand.NewPCG(seed, seed))
		for off := 0; off < len(data); {
			k := min(1+rng.IntN(20), len(data)-off)
			cut.feed(data[off:off+k], false)
			off += k
		}
		if whole != cut {
			t.Fatalf("cut %+v, whole %+v", cut, whole)
		}
		// With stop, consuming piece by piece reaches the same state.
		var stopped frameTracker
		for off := 0; off < len(data); {
			n := stopped.feed(data[off:], true)
			if n <= 0 {
				t.Fatalf("feed with stop consumed %d at %d", n, off)
			}
			off += n
		}
		if stopped != whole {
			t.Fatalf("stopped %+v, whole %+v", stopped, whole)
		}
	})
}

// wsPair returns the server end of a loopback TCP connection wrapped in
// a wsConn whose both waits are linger, and the client end.
func wsPair(t *testing.T, linger time.Duration) (*wsConn, net.Conn) {
	t.Helper()
	server, client := lbxtest.TCPPair(t, nil)
	ws := newWSConn(server)
	ws.frameLinger, ws.linger = linger, linger
	t.Cleanup(func() { ws.Close() })
	return ws, client
}

// clientFrame is a frame as the client parsed it.
type clientFrame struct {
	opcode  byte
	payload []byte
}

// readClientFrames parses frames from r until the close frame or an
// error, then reads on to the end of the stream: it returns the frames,
// the close code (0 if none), and what ended the stream after it.
func readClientFrames(r io.Reader) (frames []clientFrame, code int, err error) {
	return readFramesUntilClose(r, true)
}

// readFramesUntilClose is readClientFrames, which with toEnd unset stops
// right after the close frame.
func readFramesUntilClose(r io.Reader, toEnd bool) (frames []clientFrame, code int, err error) {
	br := bufio.NewReader(r)
	for {
		var h [2]byte
		if _, err := io.ReadFull(br, h[:]); err != nil {
			return frames, 0, err
		}
		if h[1]&0x80 != 0 {
			return frames, 0, errors.New("masked server frame")
		}
		n := uint64(h[1] & 0x7f)
		switch n {
		case 126:
			var b [2]byte
			if _, err := io.ReadFull(br, b[:]); err != nil {
				return frames, 0, err
			}
			n = uint64(binary.BigEndian.Uint16(b[:]))
		case 127:
			var b [8]byte
			if _, err := io.ReadFull(br, b[:]); err != nil {
				return frames, 0, err
			}
			n = binary.BigEndian.Uint64(b[:])
		}
		p := make([]byte, n)
		if _, err := io.ReadFull(br, p); err != nil {
			return frames, 0, fmt.Errorf("frame %d cut: %w", len(frames), err)
		}
		frames = append(frames, clientFrame{opcode: h[0] & 0x0f, payload: p})
		if h[0]&0x0f == 8 {
			if len(p) != 2 {
				return frames, 0, fmt.Errorf("close payload %x", p)
			}
			if !toEnd {
				return frames, int(binary.BigEndian.Uint16(p)), nil
			}
			extra, err := io.ReadAll(br)
			if len(extra) > 0 {
				return frames, 0, fmt.Errorf("%d bytes after the close frame", len(extra))
			}
			return frames, int(binary.BigEndian.Uint16(p)), err
		}
	}
}

// copyReads reads ws until it fails, as the proxy's copier does.
func copyReads(ws *wsConn) chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		io.Copy(io.Discard, ws)
	}()
	return done
}

// TestWSConnCloseAtBoundary: a shed stream at a frame boundary gets the
// close frame at once, with nothing after it; the server closes as soon
// as the client does.
func TestWSConnCloseAtBoundary(t *testing.T) {
	ws, client := wsPair(t, time.Hour) // the client's close, not the linger, ends it
	reads := copyReads(ws)
	stream, _ := wsStream(wsFrame(true, 2, 10, false, 1), wsFrame(true, 1, 300, false, 'x'))
	if _, err := ws.Write(stream); err != nil {
		t.Fatal(err)
	}
	var counts wsCloseCounters
	ws.closeGracefully(&counts)
	frames, code, err := readFramesUntilClose(client, false)
	if code != 1001 || len(frames) != 3 {
		t.Fatalf("client got %d frames, close code %d, %v; want 2 frames and a 1001 close", len(frames), code, err)
	}
	// Later writes are dropped and reported written.
	if n, err := ws.Write([]byte("after")); n != 5 || err != nil {
		t.Errorf("write after the close frame: %d, %v; want 5, nil", n, err)
	}
	client.Close()
	<-reads
	lbxtest.WaitFor(t, 5*time.Second, "the server end closed", func() (bool, string) {
		return ws.phase.Load() == wsClosed, fmt.Sprint("phase ", ws.phase.Load())
	})
	if n, err := ws.Write([]byte("x")); n != 0 || !errors.Is(err, net.ErrClosed) {
		t.Errorf("write after the close: %d, %v; want net.ErrClosed", n, err)
	}
	lbxtest.WaitFor(t, 5*time.Second, "counted", func() (bool, string) {
		f, a, nf := counts.frame.Load(), counts.afterFrameEnd.Load(), counts.noFrame.Load()
		return f == 1 && a == 0 && nf == 0, fmt.Sprintf("%d close frames (%d after a frame end), %d without; want 1, 0, 0", f, a, nf)
	})
}

// TestWSConnCloseMidFrame: a stream shed in the middle of a frame (at
// every kind of cut: inside the header, inside the payload) finishes
// that frame, then gets the close frame; the rest of the write that
// ended the frame, and later writes, are dropped.
func TestWSConnCloseMidFrame(t *testing.T) {
	big := wsFrame(false, 2, 70000, false, 'b')
	for _, cut := range []int{1, 2, 5, 9, 10, 11, 5000, len(big) - 1} {
		t.Run(fmt.Sprint("cut at ", cut), func(t *testing.T) {
			ws, client := wsPair(t, time.Hour)
			got := make(chan error, 1)
			var frames []clientFrame
			var code int
			go func() {
				var err error
				frames, code, err = readClientFrames(client)
				got <- err
			}()
			if _, err := ws.Write(big[:cut]); err != nil {
				t.Fatal(err)
			}
			var counts wsCloseCounters
			ws.closeGracefully(&counts)
			// The writer goes on: the end of the frame, more frames.
			rest, _ := wsStream(wsFrame(true, 9, 3, false, 'p'), wsFrame(true, 0, 20, false, 'c'))
			rest = append(slices.Clone(big[cut:]), rest...)
			for off := 0; off < len(rest); off += 700 {
				p := rest[off:min(off+700, len(rest))]
				if n, err := ws.Write(p); n != len(p) || err != nil {
					t.Fatalf("write: %d of %d, %v", n, len(p), err)
				}
			}
			ws.Close() // the proxy ends the stream: the client sees the end
			if err := <-got; err != nil {
				t.Fatalf("client: %v", err)
			}
			if len(frames) != 2 || len(frames[0].payload) != 70000 || frames[0].payload[69999] != 'b' || code != 1001 {
				t.Fatalf("client got %d frames (first %d bytes), close code %d; want the whole frame, then a 1001 close", len(frames), len(frames[0].payload), code)
			}
			if f, a, nf := counts.frame.Load(), counts.afterFrameEnd.Load(), counts.noFrame.Load(); f != 1 || a != 1 || nf != 0 {
				t.Errorf("counts: %d close frames (%d after a frame end), %d without; want 1, 1, 0", f, a, nf)
			}
		})
	}
}

// TestWSConnStalledWriter: a stream shed mid-frame whose writer never
// finishes the frame is closed without a close frame once the frame
// linger has passed.
func TestWSConnStalledWriter(t *testing.T) {
	ws, client := wsPair(t, 100*time.Millisecond)
	if _, err := ws.Write(wsFrame(true, 2, 1000, false, 's')[:500]); err != nil {
		t.Fatal(err)
	}
	var counts wsCloseCounters
	ws.closeGracefully(&counts)
	frames, code, err := readClientFrames(client)
	if len(frames) != 0 || code != 0 || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("client: %d frames, code %d, %v; want the frame cut by the close, no close frame", len(frames), code, err)
	}
	if f, nf := counts.frame.Load(), counts.noFrame.Load(); f != 0 || nf != 1 {
		t.Errorf("counts: %d close frames, %d without; want 0, 1", f, nf)
	}
	if _, err := ws.Write([]byte("late")); !errors.Is(err, net.ErrClosed) {
		t.Errorf("write after the close: %v; want net.ErrClosed", err)
	}
}

// TestWSConnStalledClient: a client that stops reading leaves a write
// blocked (holding the write lock) mid-frame; the shed does not block,
// and the frame linger closes the connection, which ends the blocked write.
func TestWSConnStalledClient(t *testing.T) {
	server, client := net.Pipe() // a write blocks until the client reads
	defer client.Close()
	ws := newWSConn(server)
	ws.frameLinger = 100 * time.Millisecond
	defer ws.Close()
	wrote := make(chan error, 1)
	go func() {
		_, err := ws.Write(wsFrame(true, 2, 1000, false, 'z'))
		wrote <- err
	}()
	// The client reads a little of the frame, then stalls.
	if _, err := io.ReadFull(client, make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	var counts wsCloseCounters
	ws.closeGracefully(&counts) // must return although the write holds the lock
	if err := <-wrote; err == nil {
		t.Fatal("the stalled write succeeded; want it ended by the close")
	}
	lbxtest.WaitFor(t, 5*time.Second, "counted without a frame", func() (bool, string) {
		return counts.noFrame.Load() == 1 && counts.frame.Load() == 0, fmt.Sprint(counts.noFrame.Load(), " without, ", counts.frame.Load(), " with")
	})
	// The goroutine waiting for the lock ends too (TestMain checks).
}

// TestWSConnLinger: after the close frame, a client that keeps its end
// open is closed on after the linger.
func TestWSConnLinger(t *testing.T) {
	ws, client := wsPair(t, 100*time.Millisecond)
	var counts wsCloseCounters
	ws.closeGracefully(&counts)
	frames, code, err := readClientFrames(client) // reads to the end of the stream
	if len(frames) != 1 || code != 1001 || err != nil {
		t.Fatalf("client: %d frames, code %d, %v; want the close frame, then the end", len(frames), code, err)
	}
	if ws.phase.Load() != wsClosed {
		t.Errorf("phase %d; want closed", ws.phase.Load())
	}
}

// TestWSConnProxyClosesFirst: the proxy ending a shed stream before its
// frame ends counts as closed without a close frame.
func TestWSConnProxyClosesFirst(t *testing.T) {
	ws, _ := wsPair(t, time.Hour)
	if _, err := ws.Write(wsFrame(true, 2, 1000, false, 's')[:3]); err != nil {
		t.Fatal(err)
	}
	var counts wsCloseCounters
	ws.closeGracefully(&counts)
	ws.Close()
	if f, nf := counts.frame.Load(), counts.noFrame.Load(); f != 0 || nf != 1 {
		t.Errorf("counts: %d close frames, %d without; want 0, 1", f, nf)
	}
	ws.closeGracefully(&counts) // a second call on a closed stream does nothing
	if nf := counts.noFrame.Load(); nf != 1 {
		t.Errorf("%d without a frame after a second call; want 1", nf)
	}
}

// TestWrapResponseWriterHijack runs upgrades through WrapResponseWriter
// on a real server and sheds them: a WebSocket answered 101 through the
// writer gets
// a frame-following connection (the buffered writer too) and a 1001
// close frame when shed; a WebSocket hijacked without a 101 through the
// writer, and a non-WebSocket upgrade, get the plain connection, closed.
func TestWrapResponseWriterHijack(t *testing.T) {
	tr := NewTracker()
	wrapped := make(chan bool, 1)
	midFrame := make(chan bool, 1)
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/raw" {
			w.Header().Set("Upgrade", r.Header.Get("Upgrade"))
			w.Header().Set("Connection", "Upgrade")
			w.WriteHeader(http.StatusSwitchingProtocols)
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		_, isWS := conn.(*wsConn)
		wrapped <- isWS
		if r.URL.Path == "/raw" {
			brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		}
		// A frame and half of another through the buffered writer, the
		// rest on the conn: the frame count must see both.
		second := wsFrame(true, 1, 300, false, 'c')
		brw.Write(wsFrame(true, 1, 5, false, 'h'))
		brw.Write(second[:100])
		brw.Flush()
		if ws, ok := conn.(*wsConn); ok {
			ws.mu.Lock()
			midFrame <- !ws.frames.atBoundary()
			ws.mu.Unlock()
		}
		conn.Write(second[100:])
		io.Copy(io.Discard, conn)
	})
	srv := &http.Server{
		Handler:     closeMiddleware(next),
		ConnState:   tr.ConnState,
		ConnContext: tr.ConnContext,
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ln) }()
	defer func() { srv.Close(); <-done }()

	for _, tc := range []struct {
		path, upgrade string
		wantWS        bool
	}{
		{"/ws", "websocket", true},
		{"/raw", "websocket", false},
		{"/echo", "echo", false},
	} {
		t.Run(tc.path[1:], func(t *testing.T) {
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\nUpgrade: %s\r\nConnection: Upgrade\r\n\r\n", tc.path, tc.upgrade)
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
				t.Fatalf("upgrade: %v %v", resp, err)
			}
			if got := <-wrapped; got != tc.wantWS {
				t.Fatalf("handler got a frame-following connection: %v; want %v", got, tc.wantWS)
			}
			if tc.wantWS && !<-midFrame {
				t.Fatal("bytes written through the buffered writer bypassed the frame count")
			}
			lbxtest.WaitFor(t, 5*time.Second, "hijacked", func() (bool, string) {
				cnt := tr.Counts()
				return cnt.Hijacked == 1, fmt.Sprintf("%+v", cnt)
			})
			// Both frames arrive before the shed.
			var first [2]clientFrame
			for i := range first {
				fr, _, err := readClientFrames(io.LimitReader(br, int64(len(wsFrame(true, 1, []int{5, 300}[i], false, 0)))))
				if len(fr) != 1 {
					t.Fatalf("frame %d: %v", i, err)
				}
				first[i] = fr[0]
			}
			if r := tr.Shed(1); r != (ShedResult{Hijacked: 1}) {
				t.Fatalf("Shed(1) = %+v", r)
			}
			frames, code, err := readClientFrames(br)
			if tc.wantWS {
				if len(frames) != 1 || code != 1001 || err != nil {
					t.Fatalf("after the shed: %d frames, code %d, %v; want a 1001 close frame, then the end", len(frames), code, err)
				}
			} else if len(frames) != 0 || code != 0 || !errors.Is(err, io.EOF) {
				t.Fatalf("after the shed: %d frames, code %d, %v; want the connection closed", len(frames), code, err)
			}
		})
	}
	lbxtest.WaitFor(t, 5*time.Second, "the tracker counts one close frame", func() (bool, string) {
		c := tr.WebSocketCloses()
		return c.CloseFrame == 1 && c.WithoutFrame == 0, fmt.Sprintf("%+v", c)
	})
}
