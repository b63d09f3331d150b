package handoff

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"testing"
)

// FuzzFollowRequests feeds a byte stream, cut into reads at fuzzed
// places, to the request follower, and checks it against net/http's own
// parser: wherever the follower has not given up (stays), every request
// start it records is one where net/http begins a request too. A follower
// that disagreed would hand a newer server a stream cut in the middle of
// a request: the rest of a body read as a request.
func FuzzFollowRequests(f *testing.F) {
	f.Add([]byte("GET / HTTP/1.1\r\nHost: a\r\n\r\n"), []byte{5, 9})
	f.Add([]byte("POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\nHost: a\r\n\r\n"), []byte{52, 0, 30})
	f.Add([]byte("POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"), []byte{48})
	f.Add([]byte("POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd"), []byte{})
	f.Add([]byte("POST /p HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), []byte{20})
	f.Add([]byte("GET / HTTP/1.0\r\n\r\n"), []byte{1})
	f.Add([]byte("PUT /x HTTP/1.1\r\nHost: a\r\ncontent-length: 007\r\n\r\n1234567PUT /y HTTP/1.1\r\nHost: a\r\nContent-Length:2\r\n\r\nxy"), []byte{40, 14, 4})
	f.Fuzz(func(t *testing.T, stream, cuts []byte) {
		if len(stream) > 1<<16 {
			return
		}
		c := &conn{}
		var starts []int64 // of requests the follower began, while it followed
		rest := stream
		for i := 0; len(rest) > 0 && !c.stays.Load(); i++ {
			n := len(rest)
			if i < len(cuts) {
				n = min(n, int(cuts[i])+1)
			}
			c.mu.Lock()
			c.track(rest[:n])
			if !c.stays.Load() {
				if c.offset != int64(len(stream)-len(rest)+n) {
					t.Fatalf("offset %d after reading %d bytes", c.offset, len(stream)-len(rest)+n)
				}
				if c.req.begun && (len(starts) == 0 || starts[len(starts)-1] != c.req.start) {
					starts = append(starts, c.req.start)
				}
				if c.req.headDone && c.req.end < c.offset {
					t.Fatalf("request at %d ends at %d, before the %d bytes read", c.req.start, c.req.end, c.offset)
				}
			}
			c.mu.Unlock()
			rest = rest[n:]
		}

		// Where net/http begins requests, in the same stream, up to the
		// first it refuses.
		rd := bytes.NewReader(stream)
		br := bufio.NewReader(rd)
		consumed := func() int64 { return int64(len(stream) - rd.Len() - br.Buffered()) }
		var want []int64
		for len(want) <= len(starts) {
			at := consumed()
			req, err := http.ReadRequest(br)
			if err != nil {
				break
			}
			want = append(want, at)
			_, err = io.Copy(io.Discard, req.Body)
			if err != nil || req.ProtoMinor != 1 || req.Close {
				break // its end is not where a next request follows
			}
		}
		for i, s := range starts {
			if i >= len(want) {
				// net/http refused an earlier request, or this one: it
				// answers 400 and closes, and the write makes the
				// connection stay.
				break
			}
			if s != want[i] {
				t.Fatalf("request %d: the follower began it at %d, net/http at %d (follower %v, net/http %v)",
					i, s, want[i], starts, want)
			}
		}
	})
}
