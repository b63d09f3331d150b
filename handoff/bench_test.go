package handoff

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// benchmarkNewConns measures a new connection's round trip through ln:
// dial, one byte each way, close. Each connection is served by its own
// goroutine, as net/http does.
func benchmarkNewConns(b *testing.B, ln net.Listener) {
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var buf [1]byte
				if _, err := io.ReadFull(c, buf[:]); err == nil {
					c.Write(buf[:])
				}
			}()
		}
	}()
	addr := ln.Addr().String()
	b.ResetTimer()
	for range b.N {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		var buf [1]byte
		if _, err := c.Write([]byte{1}); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf[:]); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}

// BenchmarkNewConnPlain is the baseline: a plain listener.
func BenchmarkNewConnPlain(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	benchmarkNewConns(b, ln)
}

// BenchmarkNewConnHandoff is the same through lbx_handoff's listener: the
// accept loop, the hub's queue and the connection wrapper.
func BenchmarkNewConnHandoff(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	benchmarkNewConns(b, attach(ln))
}

// benchmarkKeptAlivePOSTs measures a POST and its response on one
// kept-alive connection to an HTTP server on ln, set up as Caddy's (HTTP/1
// and cleartext HTTP/2): what following each request's framing costs.
func benchmarkKeptAlivePOSTs(b *testing.B, ln net.Listener) {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(w, r.Body)
	})}
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	go srv.Serve(ln)
	defer srv.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	req := []byte("POST /x HTTP/1.1\r\nHost: bench\r\nUser-Agent: bench\r\nContent-Type: text/plain\r\nContent-Length: 16\r\n\r\n0123456789abcdef")
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(req); err != nil {
			b.Fatal(err)
		}
		res, err := http.ReadResponse(br, nil)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, res.Body); err != nil {
			b.Fatal(err)
		}
		res.Body.Close()
	}
}

// BenchmarkKeptAlivePlain is the baseline: a plain listener.
func BenchmarkKeptAlivePlain(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	benchmarkKeptAlivePOSTs(b, ln)
}

// BenchmarkKeptAliveHandoff is the same through lbx_handoff's listener.
func BenchmarkKeptAliveHandoff(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	benchmarkKeptAlivePOSTs(b, attach(ln))
}

// memConn is a connection in memory: every read returns req, writes are
// discarded.
type memConn struct {
	net.Conn
	req []byte
}

func (c *memConn) Read(p []byte) (int, error)       { return copy(p, c.req), nil }
func (c *memConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *memConn) SetReadDeadline(time.Time) error  { return nil }
func (c *memConn) SetWriteDeadline(time.Time) error { return nil }
func (c *memConn) Close() error                     { return nil }
func (c *memConn) SetDeadline(t time.Time) error    { return nil }

// benchmarkRequestCalls makes, on c, the calls net/http makes on a
// connection for a kept-alive request without the socket: a read of the
// request, a write of the response, and the deadlines around them.
func benchmarkRequestCalls(b *testing.B, c net.Conn) {
	buf := make([]byte, 4096)
	res := []byte("HTTP/1.1 200 OK\r\nContent-Length: 16\r\nContent-Type: text/plain\r\n\r\n0123456789abcdef")
	for range b.N {
		if _, err := c.Read(buf); err != nil {
			b.Fatal(err)
		}
		c.Write(res)
		c.SetWriteDeadline(time.Time{})
		c.SetReadDeadline(time.Time{})
	}
}

var benchRequest = []byte("POST /x HTTP/1.1\r\nHost: bench\r\nUser-Agent: bench\r\nContent-Type: text/plain\r\nContent-Length: 16\r\n\r\n0123456789abcdef")

// BenchmarkRequestCallsPlain is the baseline: the calls on the connection
// itself.
func BenchmarkRequestCallsPlain(b *testing.B) {
	benchmarkRequestCalls(b, &memConn{req: benchRequest})
}

// BenchmarkRequestCallsHandoff is the same through lbx_handoff's
// connection, which follows each request's framing.
func BenchmarkRequestCallsHandoff(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	l := attach(ln)
	defer l.Close()
	benchmarkRequestCalls(b, &conn{Conn: &memConn{req: benchRequest}, l: l, started: true})
}
