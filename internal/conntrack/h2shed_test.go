package conntrack

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// h2Server is a real HTTP/2 server on 127.0.0.1, h2c or TLS, behind a
// counting listener (below TLS, as the rebalance listener wrapper is in
// Caddy), with its own tracker; handlers write through WrapResponseWriter
// when wrap is set.
type h2Server struct {
	tracker *Tracker
	addr    string
	tls     *tls.Config // the client's, for TLS
}

func newH2Server(t *testing.T, secure, wrap bool) *h2Server {
	t.Helper()
	hs := &h2Server{tracker: NewTracker()}
	handler := http.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	if wrap {
		handler = closeMiddleware(handler)
	}
	srv := &http.Server{Handler: handler, ConnState: hs.tracker.ConnState, ConnContext: hs.tracker.ConnContext}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln = new(ByteCounters).Listener(ln, nil)
	if secure {
		certPEM, _, cert := lbxtest.Cert(t)
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(certPEM)
		hs.tls = &tls.Config{RootCAs: pool, ServerName: "localhost", NextProtos: []string{"h2"}}
		srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
		ln = tls.NewListener(ln, srv.TLSConfig)
	} else {
		p := new(http.Protocols)
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		srv.Protocols = p
	}
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	hs.addr = ln.Addr().String()
	return hs
}

// h2Client is a raw HTTP/2 client: it sees every frame the server sends.
type h2Client struct {
	t    *testing.T
	conn net.Conn
	fr   *http2.Framer
	hbuf bytes.Buffer
	enc  *hpack.Encoder
}

// dial connects, sends the preface and settings, and reads up to the
// server's settings.
func (hs *h2Server) dial(t *testing.T) *h2Client {
	t.Helper()
	var conn net.Conn
	var err error
	if hs.tls != nil {
		conn, err = tls.Dial("tcp", hs.addr, hs.tls)
	} else {
		conn, err = net.Dial("tcp", hs.addr)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	c := &h2Client{t: t, conn: conn, fr: http2.NewFramer(conn, conn)}
	c.enc = hpack.NewEncoder(&c.hbuf)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return c
}

// get sends a GET on stream id and reads its response to the end; it
// returns the GOAWAY frames that came meanwhile.
func (c *h2Client) get(id uint32) (goAways []goAway) {
	c.t.Helper()
	c.hbuf.Reset()
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":path", "/"}, {":authority", "localhost"}} {
		c.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.hbuf.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		c.t.Fatal(err)
	}
	for {
		f, err := c.next()
		if err != nil {
			c.t.Fatalf("stream %d: %v", id, err)
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			goAways = append(goAways, copyGoAway(f))
		case *http2.MetaHeadersFrame:
			if f.StreamID == id && f.StreamEnded() {
				return goAways
			}
		case *http2.DataFrame:
			if f.StreamID == id && f.StreamEnded() {
				return goAways
			}
		}
	}
}

// next returns the next frame other than settings, pings and window
// updates (it acknowledges settings and pings).
func (c *h2Client) next() (http2.Frame, error) {
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			return nil, err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				c.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				c.fr.WritePing(true, f.Data)
			}
		case *http2.WindowUpdateFrame:
		default:
			return f, nil
		}
	}
}

// untilClosed reads frames until the server closes the connection, and
// returns the GOAWAY frames and the error that ended the reads.
func (c *h2Client) untilClosed() (goAways []goAway, err error) {
	for {
		f, err := c.next()
		if err != nil {
			return goAways, err
		}
		if g, ok := f.(*http2.GoAwayFrame); ok {
			goAways = append(goAways, copyGoAway(g))
		} else {
			c.t.Errorf("unexpected %v", f.Header())
		}
	}
}

// goAway is a GOAWAY frame the client read (the framer reuses a frame's
// memory for the next one).
type goAway struct {
	lastStream uint32
	code       http2.ErrCode
	debug      string
}

func copyGoAway(f *http2.GoAwayFrame) goAway {
	return goAway{f.LastStreamID, f.ErrCode, string(f.DebugData())}
}

// describe formats GOAWAY frames.
func describe(gs []goAway) string {
	var b bytes.Buffer
	for _, g := range gs {
		fmt.Fprintf(&b, "[last stream %d, %v, %q] ", g.lastStream, g.code, g.debug)
	}
	return b.String()
}

// TestShedIdleHTTP2GoAway: an idle HTTP/2 connection, over h2c and TLS,
// that is shed gets exactly one GOAWAY (last stream 2^31-1, NO_ERROR, a
// well-formed frame between two others) from the tracker before anything
// else happens to it. A request the client had sent as the GOAWAY left
// (sent here just after it) is still served whole, and the connection is
// then closed by the tracker, since this client keeps it open. The server
// has no WrapResponseWriter: the tracker knows the connection is HTTP/2
// from ALPN or from the preface the counting listener read, not from a
// request.
func TestShedIdleHTTP2GoAway(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(map[bool]string{false: "h2c", true: "TLS"}[secure], func(t *testing.T) {
			hs := newH2Server(t, secure, false)
			c := hs.dial(t)
			if g := c.get(1); len(g) > 0 {
				t.Fatalf("GOAWAY before the shed: %s", describe(g))
			}
			waitIdle(t, hs.tracker)
			if r := hs.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
				t.Fatalf("Shed(1) = %+v; want one idle", r)
			}
			if c := hs.tracker.Counts(); c.Closing != 1 || c.Idle != 1 {
				t.Errorf("counts after the shed %+v; want the connection idle and closing", c)
			}
			f, err := c.next()
			if err != nil {
				t.Fatalf("after the shed: %v; want a GOAWAY", err)
			}
			goAways := []goAway{}
			if g, ok := f.(*http2.GoAwayFrame); ok {
				goAways = append(goAways, copyGoAway(g))
			} else {
				t.Fatalf("after the shed: %v; want a GOAWAY", f.Header())
			}
			goAways = append(goAways, c.get(3)...)
			more, err := c.untilClosed()
			goAways = append(goAways, more...)
			if len(goAways) != 1 || goAways[0] != (goAway{1<<31 - 1, http2.ErrCodeNo, goAwayDebug}) {
				t.Errorf("GOAWAY frames %s; want one with last stream 2147483647, NO_ERROR and %q", describe(goAways), goAwayDebug)
			}
			if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Errorf("the connection ended with %v; want the server's close (EOF)", err)
			}
			if n := hs.tracker.GoAwayTotal(); n != 1 {
				t.Errorf("GoAwayTotal = %d; want 1", n)
			}
			lbxtest.WaitFor(t, 5*time.Second, "the connection forgotten", func() (bool, string) {
				c := hs.tracker.Counts()
				return c.total() == 0 && c.Closing == 0, fmt.Sprintf("%+v", c)
			})
		})
	}
}

// TestShedIdleHTTP2Request: a request on a shed idle HTTP/2 connection
// before the tracker's GOAWAY goes out, through WrapResponseWriter, makes Go's
// server send its own GOAWAY (last stream: that request's), and the
// tracker then sends none: a second one with a higher stream ID would be
// a protocol error (grpc-go closes the connection on it). The connection
// is closed after that response.
func TestShedIdleHTTP2Request(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(map[bool]string{false: "h2c", true: "TLS"}[secure], func(t *testing.T) {
			hs := newH2Server(t, secure, true)
			c := hs.dial(t)
			c.get(1)
			waitIdle(t, hs.tracker)
			if r := hs.tracker.Shed(1); r != (ShedResult{Idle: 1}) {
				t.Fatalf("Shed(1) = %+v; want one idle", r)
			}
			goAways := c.get(3)
			more, err := c.untilClosed()
			goAways = append(goAways, more...)
			if len(goAways) != 1 || goAways[0].lastStream != 3 || goAways[0].code != http2.ErrCodeNo {
				t.Errorf("GOAWAY frames %s; want Go's server's one, last stream 3, NO_ERROR", describe(goAways))
			}
			if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Errorf("the connection ended with %v; want the server's close (EOF)", err)
			}
			if n := hs.tracker.GoAwayTotal(); n != 0 {
				t.Errorf("GoAwayTotal = %d; want 0", n)
			}
		})
	}
}

// waitIdle waits until tr's only connection is idle.
func waitIdle(t *testing.T, tr *Tracker) {
	t.Helper()
	lbxtest.WaitFor(t, 5*time.Second, "the connection idle", func() (bool, string) {
		c := tr.Counts()
		return c.Idle == 1 && c.total() == 1, fmt.Sprintf("%+v", c)
	})
}
