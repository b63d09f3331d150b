package integration

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// keptAliveRun is what clients that keep their connections saw over a
// storm of reloads.
type keptAliveRun struct {
	sent, answered, reused, failed, newResets int64
	duplicated, reachedBackend                int
	lastFailure                               string
}

// reloadUnderKeptAlivePOSTs reloads Caddy (a reverse proxy to a backend
// that counts request ids; listener_wrappers as given, or Caddy's own if
// empty) reloads times under clients that each keep one connection and
// send POSTs with unique ids on it, one after the other, never twice.
func reloadUnderKeptAlivePOSTs(t *testing.T, wrappers string, clients, reloads int) keptAliveRun {
	e := newEnv(t)
	var (
		seenMu sync.Mutex
		seen   = map[string]int{}
	)
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		seenMu.Lock()
		seen[string(id)]++
		seenMu.Unlock()
		w.Write(id)
	}))
	defer backend.Close()
	listenerWrappers := ""
	if wrappers != "" {
		listenerWrappers = "\t\tlistener_wrappers {\n" + wrappers + "\t\t}\n"
	}
	config := func(gen int) string {
		// Caddy's default grace period: Shutdown waits for every
		// connection, and closes idle ones as they become idle.
		return fmt.Sprintf("{\n\tskip_install_trust\n\tadmin %s\n\thttp_port %d\n\thttps_port %d\n\tdefault_bind 127.0.0.1\n\tauto_https off\n\tservers {\n\t\tprotocols h1 h2c\n%s\t}\n}\n:%d {\n\theader X-Gen %d\n\treverse_proxy %s\n}\n",
			adminAddr, httpPort, httpsPort, listenerWrappers, httpPort, gen, strings.TrimPrefix(backend.URL, "http://"))
	}
	load := func(gen int) { e.loadCaddyfile(config(gen)) }
	load(0)

	addr := fmt.Sprintf("127.0.0.1:%d", httpPort)
	var (
		run                                       keptAliveRun
		sent, answered, reused, failed, newResets atomic.Int64
		lastFailure                               atomic.Value
		wg                                        sync.WaitGroup
	)
	stop := make(chan struct{})
	for i := range clients {
		wg.Go(func() {
			var (
				c     net.Conn
				br    *bufio.Reader
				fresh bool
			)
			defer func() {
				if c != nil {
					c.Close()
				}
			}()
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if c == nil {
					var err error
					if c, err = net.Dial("tcp", addr); err != nil {
						c = nil
						if errors.Is(err, syscall.ECONNRESET) {
							newResets.Add(1)
							continue
						}
						failed.Add(1)
						lastFailure.Store(err.Error())
						return
					}
					br, fresh = bufio.NewReader(c), true
				}
				id := fmt.Sprintf("%d-%d", i, n)
				sent.Add(1)
				c.SetDeadline(time.Now().Add(20 * time.Second))
				closes := false
				_, err := fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(id), id)
				var got []byte
				if err == nil {
					var res *http.Response
					if res, err = http.ReadResponse(br, nil); err == nil {
						got, err = io.ReadAll(res.Body)
						res.Body.Close()
						closes = res.Close
					}
				}
				switch {
				case err == nil && string(got) == id:
					answered.Add(1)
					if !fresh {
						reused.Add(1)
					}
				case fresh && (errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)):
					// A new connection queued on the old socket as it
					// closed: Linux resets it unless
					// net.ipv4.tcp_migrate_req is 1 (docs/handoff.md).
					newResets.Add(1)
					closes = true
				default:
					failed.Add(1)
					lastFailure.Store(fmt.Sprintf("POST %s (reused %v): %q, %v", id, !fresh, got, err))
					closes = true
				}
				fresh = false
				if closes {
					c.Close()
					c = nil
				}
			}
		})
	}
	for gen := 1; gen <= reloads; gen++ {
		// Let the clients send between reloads, bounded.
		deadline := time.Now().Add(20 * time.Second)
		for want := answered.Load() + int64(clients)*2; answered.Load() < want && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		load(gen)
	}
	close(stop)
	wg.Wait()

	seenMu.Lock()
	defer seenMu.Unlock()
	for _, n := range seen {
		if n > 1 {
			run.duplicated++
		}
	}
	run.sent, run.answered, run.reused, run.failed, run.newResets = sent.Load(), answered.Load(), reused.Load(), failed.Load(), newResets.Load()
	run.reachedBackend = len(seen)
	if s, ok := lastFailure.Load().(string); ok {
		run.lastFailure = s
	}
	t.Logf("%d reloads, %d clients: %d POSTs sent, %d answered (%d on reused connections), %d failed, %d new connections reset, %d duplicated, %d reached the backend (last failure: %s)",
		reloads, clients, run.sent, run.answered, run.reused, run.failed, run.newResets, run.duplicated, run.reachedBackend, run.lastFailure)
	return run
}

// With lbx_handoff, a storm of reloads loses no POST sent on a kept-alive
// connection, and none reaches the backend twice.
func TestReloadsLoseNoKeptAlivePOST(t *testing.T) {
	run := reloadUnderKeptAlivePOSTs(t, "\t\t\tlbx_handoff\n\t\t\ttls\n", 16, 40)
	if run.failed > 0 || run.duplicated > 0 {
		t.Errorf("%d POSTs failed and %d reached the backend twice; want none (last failure: %s)", run.failed, run.duplicated, run.lastFailure)
	}
	if int64(run.reachedBackend) < run.answered || run.reused == 0 {
		t.Errorf("%d POSTs answered, %d reached the backend, %d on reused connections; want every answered one at the backend, and reuse", run.answered, run.reachedBackend, run.reused)
	}
}

// What the test above guards against: stock Caddy, under the same storm,
// fails POSTs on kept-alive connections. It runs only with
// LBX_RELOAD_STOCK=1 (a measurement, for docs/handoff.md).
func TestReloadsStockLosesKeptAlivePOST(t *testing.T) {
	if os.Getenv("LBX_RELOAD_STOCK") != "1" {
		t.Skip("a measurement of stock Caddy: set LBX_RELOAD_STOCK=1")
	}
	run := reloadUnderKeptAlivePOSTs(t, "", 16, 40)
	if run.failed == 0 {
		t.Errorf("stock Caddy failed no POST in %d sent: the storm did not reproduce what lbx_handoff fixes", run.sent)
	}
	if run.duplicated > 0 {
		t.Errorf("%d POSTs reached the backend twice", run.duplicated)
	}
}
