package fleet

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// IDCounter is the backend of no-retry runs: it answers "ok" to every
// request after reading its body, and counts each IDHeader it sees, so
// that a run can tell a request lost (the client got no response) from
// one the backend served, and find any the backend served twice.
type IDCounter struct {
	mu   sync.Mutex
	seen map[string]int
}

// NewIDCounter returns an empty counter.
func NewIDCounter() *IDCounter { return &IDCounter{seen: map[string]int{}} }

// ServeHTTP implements http.Handler.
func (c *IDCounter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		return // the request never fully arrived: not served
	}
	c.Count(r.Header.Get(IDHeader))
	_, _ = io.WriteString(w, "ok")
}

// Count records that the backend served id (nothing for an empty one).
func (c *IDCounter) Count(id string) {
	if id == "" {
		return
	}
	c.mu.Lock()
	c.seen[id]++
	c.mu.Unlock()
}

// Seen returns how many times the backend served id.
func (c *IDCounter) Seen(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.seen[id]
}

// IDCheck is what the backend's count says of one kind of client's
// requests.
type IDCheck struct {
	// Lost is the requests sent that got no response; Reached those of
	// them the backend served anyway (the client cannot know it did).
	Lost, Reached int
	// Duplicated is the ids the backend served more than once.
	Duplicated int
}

// Check compares the ids starting with prefix+"-" that the backend saw
// with lost, the ids of that prefix that were sent and got no response.
func (c *IDCounter) Check(prefix string, lost []string) IDCheck {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := IDCheck{Lost: len(lost)}
	for _, id := range lost {
		if c.seen[id] > 0 {
			r.Reached++
		}
	}
	for id, n := range c.seen {
		if n > 1 && strings.HasPrefix(id, prefix+"-") {
			r.Duplicated++
		}
	}
	return r
}

// Backend is an HTTP server on loopback serving an IDCounter.
type Backend struct {
	// Addr is its host:port.
	Addr string
	// Counter counts the ids it served.
	Counter *IDCounter

	srv  *http.Server
	done chan error
}

// StartBackend starts a Backend on a free loopback port. Its idle
// timeout is long, so that it never closes a proxy's kept-alive
// connection under a request: the runs measure the front's and the
// nodes' closes, not the backend's.
func StartBackend() (*Backend, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	b := &Backend{Addr: ln.Addr().String(), Counter: NewIDCounter(), done: make(chan error, 1)}
	b.srv = &http.Server{Handler: b.Counter, IdleTimeout: 10 * time.Minute, ReadHeaderTimeout: 30 * time.Second}
	go func() { b.done <- b.srv.Serve(ln) }()
	return b, nil
}

// Close stops the backend, waiting up to 5 s for the requests in flight.
func (b *Backend) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := b.srv.Shutdown(ctx)
	if serr := <-b.done; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}
