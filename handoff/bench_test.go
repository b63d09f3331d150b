package handoff

import (
	"io"
	"net"
	"testing"
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
