package fleet

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Clients are long-lived HTTP/1.1 clients: each holds one keep-alive
// connection through the balancer and sends a request every period; when
// the connection closes, the next request opens a new one (through the
// balancer).
type Clients struct {
	// Connects counts the connections opened (not reused).
	Connects atomic.Int64

	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	reqs    int
	errs    []ClientError
	retried int
}

// ClientError is one failed request.
type ClientError struct {
	// At is when the request returned.
	At time.Time
	// Fresh is true when the request's last attempt went out on a new
	// connection. Go's transport writes an idempotent request again on a
	// new connection when a reused one closes under it, so a failure on
	// a reused connection is not the ordinary keep-alive race.
	Fresh bool
	// Err is the error, or the unexpected status and body.
	Err string
}

// ReloadReset reports whether e is the one loss a reload of a node still
// causes with lbx_handoff (as every fleet node runs): a request on a new
// connection that Linux reset ("connection reset by peer", or "broken
// pipe" on the write) because it was still queued on the old config's
// SO_REUSEPORT socket when that closed. net.ipv4.tcp_migrate_req=1 moves
// those; the harness does not set it. A request closed unanswered (EOF)
// is not one: lbx_handoff serves those with the new config.
func (e ClientError) ReloadReset() bool {
	return e.Fresh && (strings.Contains(e.Err, "connection reset by peer") || strings.Contains(e.Err, "broken pipe"))
}

// String returns the error with its time and connection.
func (e ClientError) String() string {
	conn := "reused connection"
	if e.Fresh {
		conn = "new connection"
	}
	return fmt.Sprintf("%s: %s (%s)", e.At.Format("15:04:05.000"), e.Err, conn)
}

// StartClients starts n clients sending GET / to addr every period, each
// expecting 200 "ok". The clients are spread over the first period.
func StartClients(addr string, n int, every time.Duration) *Clients {
	ctx, cancel := context.WithCancel(context.Background())
	cs := &Clients{cancel: cancel}
	for range n {
		cs.wg.Add(1)
		go func() {
			defer cs.wg.Done()
			tr := &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1, DisableCompression: true}
			defer tr.CloseIdleConnections()
			cl := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			select {
			case <-ctx.Done():
				return
			case <-time.After(rand.N(every)):
			}
			tick := time.NewTicker(every)
			defer tick.Stop()
			for {
				cs.one(ctx, cl, "http://"+addr+"/")
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
			}
		}()
	}
	return cs
}

// Close stops every client and waits for them.
func (cs *Clients) Close() {
	cs.cancel()
	cs.wg.Wait()
}

// Stats returns the requests sent, the errors (one line each) and how many
// requests Go's transport wrote twice: it retries an idempotent request
// transparently when a keep-alive connection's close crossed it on the
// wire (RFC 9112 §9.3.1), before any of it reached the server.
func (cs *Clients) Stats() (requests int, errs []ClientError, retried int) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return cs.reqs, append([]ClientError(nil), cs.errs...), cs.retried
}

func (cs *Clients) one(ctx context.Context, cl *http.Client, url string) {
	var writes atomic.Int32
	var fresh atomic.Bool
	tctx := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) {
			fresh.Store(!i.Reused)
			if !i.Reused {
				cs.Connects.Add(1)
			}
		},
		WroteRequest: func(httptrace.WroteRequestInfo) { writes.Add(1) },
	})
	req, _ := http.NewRequestWithContext(tctx, http.MethodGet, url, nil)
	res, err := cl.Do(req)
	var body []byte
	if err == nil {
		body, err = io.ReadAll(res.Body)
		res.Body.Close()
	}
	if ctx.Err() != nil {
		return // the run is over
	}
	cs.mu.Lock()
	defer cs.mu.Unlock()
	cs.reqs++
	if writes.Load() > 1 {
		cs.retried++
	}
	failed := ClientError{At: time.Now(), Fresh: fresh.Load()}
	switch {
	case err != nil:
		failed.Err = err.Error()
	case res.StatusCode != http.StatusOK || string(body) != "ok":
		failed.Err = fmt.Sprintf("status %d, body %.40q", res.StatusCode, body)
	default:
		return
	}
	cs.errs = append(cs.errs, failed)
}
