package conntrack

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// counted returns a wrap for lbxtest.TCPPair: bc's counting listener.
func counted(bc *ByteCounters) func(net.Listener) net.Listener {
	return func(l net.Listener) net.Listener { return bc.Listener(l, nil) }
}

// TestCountingConnReadWrite: every byte read and written through an
// accepted connection is counted, exactly, including the ones of a
// connection that closed.
func TestCountingConnReadWrite(t *testing.T) {
	bc := new(ByteCounters)
	srv, cl := lbxtest.TCPPair(t, counted(bc))
	if _, ok := srv.(*countingConn); !ok {
		t.Fatalf("accepted %T; want a *countingConn", srv)
	}
	go func() {
		cl.Write(bytes.Repeat([]byte("a"), 100_000))
	}()
	if _, err := io.ReadFull(srv, make([]byte, 100_000)); err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, cl)
	for range 10 {
		if _, err := srv.Write(make([]byte, 7_001)); err != nil {
			t.Fatal(err)
		}
	}
	srv.Close()
	if got := bc.Totals(); got.In != 100_000 || got.Out != 70_010 || got.OutZeroCopy != 0 {
		t.Fatalf("totals %+v; want in 100000, out 70010", got)
	}
}

// TestCountingConnReadFrom: a file sent with ReadFrom (net/http's sendfile
// path for file_server) goes through the inner connection's ReadFrom in
// chunks, counted exactly; a LimitedReader's N is kept right; any other
// source is copied through Write, counted too.
func TestCountingConnReadFrom(t *testing.T) {
	bc := new(ByteCounters)
	srv, cl := lbxtest.TCPPair(t, counted(bc))
	const size = 3*zeroCopyChunk + 123
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	received := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(cl)
		received <- b
	}()
	rf := srv.(io.ReaderFrom)
	// A limited read of the file, as net/http's response.ReadFrom
	// passes it: 2 chunks and a bit.
	lr := &io.LimitedReader{R: f, N: 2*zeroCopyChunk + 5}
	n, err := rf.ReadFrom(lr)
	if err != nil || n != 2*zeroCopyChunk+5 || lr.N != 0 {
		t.Fatalf("ReadFrom(limited file) = %d, %v, N left %d; want %d, nil, 0", n, err, lr.N, 2*zeroCopyChunk+5)
	}
	// The rest of the file, unlimited, to EOF.
	n2, err := rf.ReadFrom(f)
	if err != nil || n2 != size-n {
		t.Fatalf("ReadFrom(file) = %d, %v; want %d", n2, err, size-n)
	}
	// The file two limits deep, as Caddy passes a file_server body
	// (net/http's limit to the length, Caddy's 64 KiB write chunk):
	// still zero-copy, and both limits are reduced.
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	outer := &io.LimitedReader{R: &io.LimitedReader{R: f, N: 100_000}, N: 65_536}
	if n, err := rf.ReadFrom(outer); n != 65_536 || err != nil || outer.N != 0 || outer.R.(*io.LimitedReader).N != 100_000-65_536 {
		t.Fatalf("ReadFrom(limit of a limit) = %d, %v; N left %d and %d", n, err, outer.N, outer.R.(*io.LimitedReader).N)
	}
	// Deeper than anyone nests limits: copied through Write.
	var deep io.Reader = f
	for range maxLimitDepth + 1 {
		deep = io.LimitReader(deep, 1000)
	}
	if n, err := rf.ReadFrom(deep); n != 1000 || err != nil {
		t.Fatalf("ReadFrom(deep limits) = %d, %v", n, err)
	}
	// Not a file: copied through Write.
	n3, err := rf.ReadFrom(bytes.NewReader([]byte("tail")))
	if err != nil || n3 != 4 {
		t.Fatalf("ReadFrom(bytes) = %d, %v", n3, err)
	}
	srv.Close()
	got := <-received
	want := slices.Concat(data, data[:65_536], data[65_536:66_536], []byte("tail"))
	if !bytes.Equal(got, want) {
		t.Fatalf("peer received %d bytes, not the %d of the file, its parts and the tail", len(got), len(want))
	}
	if tot := bc.Totals(); tot.Out != uint64(len(want)) || tot.OutZeroCopy != size+65_536 || tot.In != 0 {
		t.Fatalf("totals %+v; want out %d of which %d zero-copy", tot, len(want), size+65_536)
	}

	// A limited reader that is already exhausted sends nothing.
	if n, err := rf.ReadFrom(&io.LimitedReader{R: f, N: 0}); n != 0 || err != nil {
		t.Fatalf("ReadFrom(exhausted) = %d, %v", n, err)
	}
}

// plainConn is a net.Conn with neither ReadFrom nor CloseWrite.
type plainConn struct {
	net.Conn
	buf bytes.Buffer
}

func (p *plainConn) Write(b []byte) (int, error) { return p.buf.Write(b) }

// TestCountingConnNoReaderFrom: over a connection without ReadFrom, a
// file is copied through Write, counted, and CloseWrite says it cannot.
func TestCountingConnNoReaderFrom(t *testing.T) {
	bc := new(ByteCounters)
	inner := &plainConn{}
	c := &countingConn{Conn: inner, counters: bc}
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, 100_000), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if n, err := c.ReadFrom(f); n != 100_000 || err != nil {
		t.Fatalf("ReadFrom = %d, %v", n, err)
	}
	if tot := bc.Totals(); tot.Out != 100_000 || tot.OutZeroCopy != 0 || inner.buf.Len() != 100_000 {
		t.Fatalf("totals %+v, inner got %d", tot, inner.buf.Len())
	}
	if err := c.CloseWrite(); !errors.Is(err, errNoHalfClose) {
		t.Fatalf("CloseWrite = %v; want errNoHalfClose", err)
	}
	if err := c.CloseRead(); !errors.Is(err, errNoHalfClose) {
		t.Fatalf("CloseRead = %v; want errNoHalfClose", err)
	}
}

// TestCountingConnKeepsConnBehaviour: the wrapped connection unwraps to
// the socket (the tracker's closed-socket check works through it), half
// closes, and keeps deadlines.
func TestCountingConnKeepsConnBehaviour(t *testing.T) {
	srv, cl := lbxtest.TCPPair(t, counted(new(ByteCounters)))
	if _, ok := srv.(*countingConn).NetConn().(*net.TCPConn); !ok {
		t.Fatalf("NetConn() is %T; want the *net.TCPConn", srv.(*countingConn).NetConn())
	}
	// Deadlines reach the socket.
	srv.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	var ne net.Error
	if _, err := srv.Read(make([]byte, 1)); !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read past the deadline: %v; want a timeout", err)
	}
	srv.SetReadDeadline(time.Now().Add(20 * time.Second))
	// CloseWrite: the peer reads EOF, and can still write back.
	if err := srv.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("peer read after CloseWrite: %v; want EOF", err)
	}
	if _, err := cl.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(srv, make([]byte, 1)); err != nil {
		t.Fatalf("read after CloseWrite: %v", err)
	}
	// The tracker's closed-socket check unwraps it, bare or under TLS.
	if connClosed(srv) {
		t.Fatal("connClosed on an open connection")
	}
	if connClosed(tls.Server(srv, &tls.Config{})) {
		t.Fatal("connClosed on an open connection under TLS")
	}
	srv.Close()
	if !connClosed(srv) || !connClosed(tls.Server(srv, &tls.Config{})) {
		t.Fatal("connClosed does not see the closed socket through the wrapper")
	}
}

// TestListenerPlacement counts a listener below TLS (the TLS records on
// the wire) and passes TLS connections through above it (the accepted
// *tls.Conn itself, so that the handshake, ALPN and the data work),
// uncounted and reported to onTLS, one call per connection.
func TestListenerPlacement(t *testing.T) {
	certPEM, _, cert := lbxtest.Cert(t)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(certPEM)
	serverConf := &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
	clientConf := &tls.Config{RootCAs: pool, ServerName: "localhost", NextProtos: []string{"h2"}}

	// exchange does a TLS handshake and sends 10000 bytes each way.
	exchange := func(t *testing.T, srv, cl net.Conn) {
		t.Helper()
		tc, ok := srv.(*tls.Conn)
		if !ok {
			t.Fatalf("accepted %T; want a *tls.Conn (net/http needs it for HTTPS and HTTP/2)", srv)
		}
		ccl := tls.Client(cl, clientConf)
		done := make(chan error, 1)
		go func() {
			if _, err := ccl.Write(make([]byte, 10_000)); err != nil {
				done <- err
				return
			}
			_, err := io.ReadFull(ccl, make([]byte, 10_000))
			done <- err
		}()
		if _, err := io.ReadFull(tc, make([]byte, 10_000)); err != nil {
			t.Fatalf("server read: %v", err)
		}
		if p := tc.ConnectionState().NegotiatedProtocol; p != "h2" {
			t.Fatalf("ALPN %q; want h2", p)
		}
		if _, err := tc.Write(make([]byte, 10_000)); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("client: %v", err)
		}
	}

	t.Run("before tls", func(t *testing.T) {
		bc := new(ByteCounters)
		var reported atomic.Int32
		srv, cl := lbxtest.TCPPair(t, func(l net.Listener) net.Listener {
			return tls.NewListener(bc.Listener(l, func() { reported.Add(1) }), serverConf)
		})
		exchange(t, srv, cl)
		// The server's tls.Conn sits on the counted connection.
		if _, ok := srv.(*tls.Conn).NetConn().(*countingConn); !ok {
			t.Fatalf("under the tls.Conn: %T", srv.(*tls.Conn).NetConn())
		}
		tot := bc.Totals()
		// 10000 bytes of data each way, plus the handshake and TLS
		// record overhead: bounded.
		if tot.In < 10_000 || tot.In > 10_000+4096 || tot.Out < 10_000 || tot.Out > 10_000+4096 {
			t.Fatalf("totals %+v; want 10000 to 14096 each way", tot)
		}
		if tot.TLSUncounted != 0 || reported.Load() != 0 {
			t.Fatalf("uncounted %d, %d reported", tot.TLSUncounted, reported.Load())
		}
	})

	t.Run("after tls", func(t *testing.T) {
		bc := new(ByteCounters)
		var reported atomic.Int32
		for i := range 3 {
			srv, cl := lbxtest.TCPPair(t, func(l net.Listener) net.Listener {
				return bc.Listener(tls.NewListener(l, serverConf), func() { reported.Add(1) })
			})
			exchange(t, srv, cl)
			if got := bc.Totals(); got.In != 0 || got.Out != 0 || got.TLSUncounted != uint64(i+1) || reported.Load() != int32(i+1) {
				t.Fatalf("connection %d: totals %+v, %d reported; want nothing counted, %d passed through and reported",
					i+1, got, reported.Load(), i+1)
			}
		}
	})
}

// nopConn is a connection whose Read and Write return at once: the
// benchmark measures the wrapper alone.
type nopConn struct{ net.Conn }

func (nopConn) Read(p []byte) (int, error)  { return len(p), nil }
func (nopConn) Write(p []byte) (int, error) { return len(p), nil }

// BenchmarkCountingConn measures what the wrapper adds to a Read or Write
// call (an atomic add), against the bare connection, on one goroutine and
// on all of them (which share the counters).
func BenchmarkCountingConn(b *testing.B) {
	buf := make([]byte, 4096)
	var bare net.Conn = nopConn{}
	var counted net.Conn = &countingConn{Conn: nopConn{}, counters: new(ByteCounters)}
	for _, bc := range []struct {
		name string
		conn net.Conn
		op   func(net.Conn, []byte) (int, error)
	}{
		{"Read/bare", bare, net.Conn.Read},
		{"Read/counted", counted, net.Conn.Read},
		{"Write/bare", bare, net.Conn.Write},
		{"Write/counted", counted, net.Conn.Write},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				bc.op(bc.conn, buf)
			}
		})
		b.Run(bc.name+"/parallel", func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				buf := make([]byte, 4096)
				for pb.Next() {
					bc.op(bc.conn, buf)
				}
			})
		})
	}
}

// BenchmarkCountingConnTCPWrite writes 16 KiB per call to a loopback TCP
// connection drained by another goroutine, bare and through the wrapper:
// the atomic add next to a real write.
func BenchmarkCountingConnTCPWrite(b *testing.B) {
	for _, counted := range []bool{false, true} {
		name := "bare"
		if counted {
			name = "counted"
		}
		b.Run(name, func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			drained := make(chan struct{})
			go func() {
				defer close(drained)
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				io.Copy(io.Discard, c)
			}()
			raw, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			var c net.Conn = raw
			if counted {
				c = &countingConn{Conn: raw, counters: new(ByteCounters)}
			}
			buf := make([]byte, 16<<10)
			b.SetBytes(int64(len(buf)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			c.Close()
			<-drained
		})
	}
}

// TestCountingConnH2Preface: the wrapper tells a cleartext HTTP/2
// connection by the client preface it reads first, however the reads
// split it, and anything else (HTTP/1, a near miss, the preface later in
// the stream) is not one.
func TestCountingConnH2Preface(t *testing.T) {
	for _, tc := range []struct {
		name   string
		chunks []string
		want   bool
	}{
		{"whole, with frames after it", []string{h2Preface + "\x00\x00\x00\x04\x00\x00\x00\x00\x00"}, true},
		{"split", []string{"P", "RI * HTTP/2", ".0\r\n\r\nSM\r", "\n\r\n", "more"}, true},
		{"HTTP/1", []string{"GET / HTTP/1.1\r\nHost: a\r\n\r\n"}, false},
		{"near miss", []string{"PRI * HTTP/2.0\r\n\r\nSN\r\n\r\n"}, false},
		{"preface later", []string{"GET / HTTP/1.1\r\n\r\n", h2Preface}, false},
		{"preface unfinished", []string{h2Preface[:10]}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			server, client := net.Pipe()
			defer server.Close()
			cc := &countingConn{Conn: server, counters: new(ByteCounters)}
			go func() {
				defer client.Close()
				for _, c := range tc.chunks {
					if _, err := io.WriteString(client, c); err != nil {
						return
					}
				}
			}()
			if _, err := io.Copy(io.Discard, cc); err != nil {
				t.Fatal(err)
			}
			if got := sawH2Preface(cc); got != tc.want {
				t.Errorf("sawH2Preface = %v; want %v", got, tc.want)
			}
			if got := sawH2Preface(tls.Server(cc, &tls.Config{})); got != tc.want {
				t.Errorf("through a TLS wrapper: sawH2Preface = %v; want %v", got, tc.want)
			}
		})
	}
}
