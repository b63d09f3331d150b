package lbxtest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// SlowBodyResult is what a SlowBody client got.
type SlowBodyResult struct {
	Status  int
	Header  http.Header
	Body    string
	Close   bool          // the answer said Connection: close
	Elapsed time.Duration // from the request's first byte to the status line
	Sent    int           // body bytes written before the answer came
}

// SlowBody sends a POST of path to addr (host:port, on loopback) on a
// connection of its own, the headers at once and a body of size bytes
// ('x') in 20 pieces spread over the duration over, as a slow client
// does, and reads the answer, which may come before the body is complete.
// It stops writing once the answer came, and closes the connection. The
// answer must come within over plus 10s.
func SlowBody(addr, path string, size int, over time.Duration) (SlowBodyResult, error) {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return SlowBodyResult{}, err
	}
	defer conn.Close()
	start := time.Now()
	head := fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n", path, addr, size)
	if _, err := io.WriteString(conn, head); err != nil {
		return SlowBodyResult{}, err
	}
	const pieces = 20
	answered := make(chan struct{})
	sent := make(chan int, 1)
	go func() {
		n := 0
		defer func() { sent <- n }()
		tick := time.NewTicker(over / pieces)
		defer tick.Stop()
		for i := range pieces {
			k := size / pieces
			if i == pieces-1 {
				k = size - n
			}
			if i > 0 {
				select {
				case <-answered:
					return
				case <-tick.C:
				}
			}
			if _, err := io.WriteString(conn, strings.Repeat("x", k)); err != nil {
				return
			}
			n += k
		}
	}()
	_ = conn.SetReadDeadline(start.Add(over + 10*time.Second))
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	elapsed := time.Since(start)
	close(answered)
	if err != nil {
		conn.Close()
		<-sent
		return SlowBodyResult{}, err
	}
	b, err := io.ReadAll(res.Body)
	conn.Close()
	out := SlowBodyResult{Status: res.StatusCode, Close: res.Close, Header: res.Header, Body: string(b), Elapsed: elapsed, Sent: <-sent}
	return out, err
}
