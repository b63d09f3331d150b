package rebalance

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// Sizes of the upgraded stream in TestThroughputCaddy: what the client
// sends, what the backend answers.
const (
	upgradeUp   = 4 << 20
	upgradeDown = 700_000
)

// headerSlack bounds the bytes an HTTP/1.1 request or response adds to
// its body (request line, status line, headers) in these tests.
const headerSlack = 1024

// throughputBackend is the upstream of TestThroughputCaddy: /upload
// answers the number of body bytes it read; /upgrade switches protocols,
// reads upgradeUp bytes, answers upgradeDown bytes and closes.
func throughputBackend(t *testing.T) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("/upload", func(w http.ResponseWriter, r *http.Request) {
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		fmt.Fprint(w, n)
	})
	mux.HandleFunc("/upgrade", func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("backend hijack: %v", err)
			return
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(30 * time.Second))
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: lbx-test\r\n\r\n")
		if err := brw.Flush(); err != nil {
			return
		}
		if _, err := io.ReadFull(brw, make([]byte, upgradeUp)); err != nil {
			t.Errorf("backend reading the upgraded stream: %v", err)
			return
		}
		conn.Write(bytes.Repeat([]byte("d"), upgradeDown))
	})
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	return ts.Listener.Addr().String()
}

// sendfileChunk is the most bytes the counting connection lets one
// sendfile call move (conntrack's zeroCopyChunk): the test files span
// one or several.
const sendfileChunk = 1 << 20

// wireBytes counts the bytes a client reads and writes: the client's own
// view of the wire, against which the server's counters are checked.
type wireBytes struct{ in, out atomic.Uint64 }

// totals returns what w counted, as the server's counters name it: the
// client's out is the server's in.
func (w *wireBytes) totals() conntrack.ByteTotals {
	return conntrack.ByteTotals{In: w.in.Load(), Out: w.out.Load()}
}

// wireConn is a client connection counting its bytes into a wireBytes.
type wireConn struct {
	net.Conn
	bytes *wireBytes
}

func (c wireConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.bytes.in.Add(uint64(n))
	return n, err
}

func (c wireConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.bytes.out.Add(uint64(n))
	return n, err
}

// countingClient returns an HTTP client whose connections count their
// bytes into bc (the client's view of the wire) and the number of
// connections it dialed. One connection per host, so requests reuse it.
func countingClient(t *testing.T, bc *wireBytes, tlsConf *tls.Config) (*http.Client, *atomic.Int32) {
	dials := new(atomic.Int32)
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			dials.Add(1)
			return wireConn{Conn: c, bytes: bc}, nil
		},
		TLSClientConfig:    tlsConf,
		ForceAttemptHTTP2:  tlsConf != nil,
		MaxConnsPerHost:    1,
		DisableCompression: true,
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}, dials
}

// delta returns b − a.
func delta(a, b conntrack.ByteTotals) conntrack.ByteTotals {
	return conntrack.ByteTotals{In: b.In - a.In, Out: b.Out - a.Out, OutZeroCopy: b.OutZeroCopy - a.OutZeroCopy, TLSUncounted: b.TLSUncounted - a.TLSUncounted}
}

// TestThroughputCaddy loads a real Caddy with three servers on loopback:
// plain HTTP and HTTPS with `listener_wrappers [rebalance, tls]`, and an
// HTTPS server with the wrapper after tls (listed alone: Caddy puts tls
// first). Real clients download files (file_server: sendfile on the plain
// server), upload bodies (reverse_proxy), and run an upgraded stream
// through reverse_proxy. The server's counters must move by exactly what
// the clients' own connections counted (plain HTTP), or within a TLS
// alert (HTTPS), and lie between the body bytes and the body bytes plus a
// bounded overhead. The misplaced server serves HTTPS and HTTP/2 and
// counts nothing. The node gossips the throughput, and the admin view and
// metrics show the totals.
func TestThroughputCaddy(t *testing.T) {
	root := t.TempDir()
	files := map[string]int{"a.bin": sendfileChunk + 17, "b.bin": 3*sendfileChunk + 123, "c.bin": 10_000}
	content := map[string][]byte{}
	for name, size := range files {
		b := make([]byte, size)
		for i := range b {
			b[i] = byte(i*31 + len(name))
		}
		content[name] = b
		if err := os.WriteFile(filepath.Join(root, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	backend := throughputBackend(t)
	certPEM, keyPEM, _ := lbxtest.Cert(t)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(certPEM)
	tlsConf := &tls.Config{RootCAs: pool, ServerName: "localhost"}

	plainPort, securePort, misplacedPort, gossipPort := freePort(t), freePort(t), freePort(t), freePort(t)
	routes := fmt.Sprintf(`[
		{"match": [{"path": ["/upload", "/upgrade"]}], "handle": [{"handler": "reverse_proxy", "upstreams": [{"dial": %q}]}]},
		{"handle": [{"handler": "file_server", "root": %q}]}
	]`, backend, root)
	jsonString := func(b []byte) string { s, _ := json.Marshal(string(b)); return string(s) }
	cfg := fmt.Sprintf(`{
		"admin": {"disabled": true},
		"storage": {"module": "file_system", "root": %q},
		"apps": {
			"tls": {"certificates": {"load_pem": [{"certificate": %s, "key": %s}]}},
			"http": {"servers": {
				"plain": {
					"listen": ["127.0.0.1:%d"],
					"listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "tls"}],
					"routes": %s
				},
				"secure": {
					"listen": ["127.0.0.1:%d"],
					"listener_wrappers": [{"wrapper": "rebalance"}, {"wrapper": "tls"}],
					"tls_connection_policies": [{}],
					"automatic_https": {"disable": true},
					"routes": %s
				},
				"misplaced": {
					"listen": ["127.0.0.1:%d"],
					"listener_wrappers": [{"wrapper": "rebalance"}],
					"tls_connection_policies": [{}],
					"automatic_https": {"disable": true},
					"routes": %s
				}
			}},
			"cluster": {"node_name": "bytes-node", "bind": "127.0.0.1:%d"}, "rebalance": {"metric": "throughput", "interval": "100ms", "history": "100ms"}
		}
	}`, t.TempDir(), jsonString(certPEM), jsonString(keyPEM), plainPort, routes, securePort, routes, misplacedPort, routes, gossipPort)
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { caddy.Stop() })
	conns := runningConns(t)
	tracker, traffic := conns.tracker, conns.counters
	// Nothing is shed here: every connection counts toward Held.
	baseConns := tracker.Counts().Held()

	// settle waits until every connection of a phase is gone, so that
	// the server writes nothing more for it.
	settle := func(t *testing.T) {
		t.Helper()
		lbxtest.WaitFor(t, 10*time.Second, "the phase's connections closed", func() (bool, string) {
			tracker.Sweep(0, 0)
			c := tracker.Counts()
			return c.Held() <= baseConns, fmt.Sprintf("%+v (before: %d)", c, baseConns)
		})
	}

	// download and upload run the requests of a phase on one keep-alive
	// connection and return the body bytes each way.
	download := func(t *testing.T, cl *http.Client, base string, proto int) (body int64) {
		t.Helper()
		for _, name := range []string{"a.bin", "b.bin", "c.bin"} {
			resp, err := cl.Get(base + "/" + name)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || !bytes.Equal(b, content[name]) {
				t.Fatalf("GET %s: %d, %d bytes, %v", name, resp.StatusCode, len(b), err)
			}
			if resp.ProtoMajor != proto {
				t.Fatalf("GET %s over %s; want HTTP/%d", name, resp.Proto, proto)
			}
			body += int64(len(b))
		}
		return body
	}
	upload := func(t *testing.T, cl *http.Client, base string) (body int64) {
		t.Helper()
		for _, size := range []int{200_000, 1_500_000} {
			resp, err := cl.Post(base+"/upload", "application/octet-stream", bytes.NewReader(make([]byte, size)))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || string(b) != strconv.Itoa(size) {
				t.Fatalf("POST /upload: %d %q; want 200 %d", resp.StatusCode, b, size)
			}
			body += int64(size)
		}
		return body
	}
	const requests = 5
	var fileBytes int64
	for _, n := range files {
		fileBytes += int64(n)
	}

	t.Run("HTTP/1.1 keep-alive, sendfile", func(t *testing.T) {
		before := traffic.Totals()
		var client wireBytes
		cl, dials := countingClient(t, &client, nil)
		base := fmt.Sprintf("http://127.0.0.1:%d", plainPort)
		down := download(t, cl, base, 1)
		up := upload(t, cl, base)
		cl.CloseIdleConnections()
		settle(t)
		// The server read exactly what the client wrote and wrote
		// exactly what the client read.
		lbxtest.WaitFor(t, 10*time.Second, "server totals equal the client's", func() (bool, string) {
			d, c := delta(before, traffic.Totals()), client.totals()
			return d.In == c.Out && d.Out == c.In, fmt.Sprintf("server %+v, client %+v", d, c)
		})
		d := delta(before, traffic.Totals())
		if d.Out < uint64(down) || d.Out > uint64(down)+requests*headerSlack {
			t.Errorf("out %d; want between the %d body bytes and %d more", d.Out, down, requests*headerSlack)
		}
		if d.In < uint64(up) || d.In > uint64(up)+requests*headerSlack {
			t.Errorf("in %d; want between the %d body bytes and %d more", d.In, up, requests*headerSlack)
		}
		// file_server's bodies went through sendfile (net/http copies up
		// to 512 bytes of a body before switching to ReadFrom).
		if d.OutZeroCopy < uint64(fileBytes)-3*512 || d.OutZeroCopy > uint64(fileBytes) {
			t.Errorf("zero-copy out %d; want the file bytes (%d), at most 512 fewer per file", d.OutZeroCopy, fileBytes)
		}
		if n := dials.Load(); n != 1 {
			t.Errorf("%d connections; want 1 (keep-alive)", n)
		}
		t.Logf("server %+v for %d body bytes down, %d up", d, down, up)
	})

	t.Run("TLS and HTTP/2", func(t *testing.T) {
		before := traffic.Totals()
		var client wireBytes
		cl, dials := countingClient(t, &client, tlsConf)
		base := fmt.Sprintf("https://127.0.0.1:%d", securePort)
		down := download(t, cl, base, 2)
		up := upload(t, cl, base)
		cl.CloseIdleConnections()
		settle(t)
		// The server read what the client wrote; it may have written a
		// closing alert or GOAWAY the client never read.
		lbxtest.WaitFor(t, 10*time.Second, "server totals match the client's", func() (bool, string) {
			d, c := delta(before, traffic.Totals()), client.totals()
			return d.In == c.Out && d.Out >= c.In && d.Out <= c.In+256, fmt.Sprintf("server %+v, client %+v", d, c)
		})
		d := delta(before, traffic.Totals())
		// TLS records and HTTP/2 frames add under 0.5%; the handshake and
		// headers a few kilobytes.
		if lim := uint64(down) + uint64(down)/100 + 16<<10; d.Out < uint64(down) || d.Out > lim {
			t.Errorf("out %d; want between the %d body bytes and %d", d.Out, down, lim)
		}
		if lim := uint64(up) + uint64(up)/100 + 16<<10; d.In < uint64(up) || d.In > lim {
			t.Errorf("in %d; want between the %d body bytes and %d", d.In, up, lim)
		}
		if d.TLSUncounted != 0 {
			t.Errorf("%d TLS connections not counted on the well-placed server", d.TLSUncounted)
		}
		if n := dials.Load(); n != 1 {
			t.Errorf("%d connections; want 1", n)
		}
		t.Logf("server %+v for %d body bytes down, %d up; client %+v", d, down, up, client.totals())
	})

	t.Run("upgraded stream through reverse_proxy", func(t *testing.T) {
		before := traffic.Totals()
		var client wireBytes
		raw, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", plainPort))
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		raw.SetDeadline(time.Now().Add(30 * time.Second))
		c := wireConn{Conn: raw, bytes: &client}
		io.WriteString(c, "GET /upgrade HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: lbx-test\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %v %v", resp, err)
		}
		// reverse_proxy writes the 101 before it hijacks the connection,
		// so the client can read it before the tracker counts the hijack.
		lbxtest.WaitFor(t, 5*time.Second, "the stream is tracked as hijacked", func() (bool, string) {
			h := tracker.Counts().Hijacked
			return h >= 1, fmt.Sprintf("%d hijacked connections tracked", h)
		})
		// Send the stream in small steps until the node has gossiped a
		// throughput above zero, then the rest at once.
		var n *node
		nodes.Range(func(_, v any) bool {
			if v.(*node).name == "bytes-node" {
				n = v.(*node)
			}
			return true
		})
		if n == nil {
			t.Fatal("no node")
		}
		// gossiped returns the node's load tag: the throughput and the
		// report's sequence number.
		gossiped := func() (float64, int) {
			raw := selfTags(n)[shed.LoadTag]
			metric, load, ok := shed.ParseLoadTag(raw)
			f := strings.Fields(raw)
			if !ok || metric != metricThroughput {
				return -1, -1
			}
			seq, _ := strconv.Atoi(f[2])
			return load, seq
		}
		// The earlier phases' bytes are out of the node's window first:
		// a report of 0 made after them.
		_, seq0 := gossiped()
		lbxtest.WaitFor(t, 5*time.Second, "the node gossips a throughput of 0", func() (bool, string) {
			load, seq := gossiped()
			return load == 0 && seq > seq0+1, fmt.Sprintf("gossips %v (report %d, %d at the start)", load, seq, seq0)
		})
		var seen float64
		sent := 0
		chunk := make([]byte, 16<<10)
		for sent+len(chunk) < upgradeUp && seen == 0 {
			if _, err := c.Write(chunk); err != nil {
				t.Fatal(err)
			}
			sent += len(chunk)
			time.Sleep(10 * time.Millisecond)
			load, _ := gossiped()
			seen = max(load, 0)
		}
		if seen == 0 {
			t.Error("the node never gossiped a throughput above 0 during the stream")
		}
		t.Logf("gossiped %s after %d bytes of the stream", formatLoad(metricThroughput, seen), sent)
		if _, err := c.Write(make([]byte, upgradeUp-sent)); err != nil {
			t.Fatal(err)
		}
		// The backend answers and closes; reverse_proxy half-closes the
		// client's side (CloseWrite through the wrapper): EOF after the
		// answer.
		got, err := io.ReadAll(br)
		if err != nil || len(got) != upgradeDown {
			t.Fatalf("read %d bytes of the answer, %v; want %d then EOF", len(got), err, upgradeDown)
		}
		c.Close()
		settle(t)
		lbxtest.WaitFor(t, 10*time.Second, "server totals equal the client's", func() (bool, string) {
			d, c := delta(before, traffic.Totals()), client.totals()
			return d.In == c.Out && d.Out == c.In, fmt.Sprintf("server %+v, client %+v", d, c)
		})
		d := delta(before, traffic.Totals())
		if d.In < upgradeUp || d.In > upgradeUp+headerSlack || d.Out < upgradeDown || d.Out > upgradeDown+headerSlack {
			t.Errorf("server %+v; want in %d and out %d, plus at most %d of headers each", d, upgradeUp, upgradeDown, headerSlack)
		}
	})

	t.Run("wrapper after tls", func(t *testing.T) {
		before := traffic.Totals()
		var client wireBytes
		cl, _ := countingClient(t, &client, tlsConf)
		down := download(t, cl, fmt.Sprintf("https://127.0.0.1:%d", misplacedPort), 2)
		cl.CloseIdleConnections()
		settle(t)
		d := delta(before, traffic.Totals())
		if d.In != 0 || d.Out != 0 || d.TLSUncounted != 1 {
			t.Errorf("server %+v; want nothing counted and 1 TLS connection passed through", d)
		}
		t.Logf("HTTPS and HTTP/2 through the misplaced wrapper: %d body bytes, %+v counted", down, d)
	})

	t.Run("admin view and metrics", func(t *testing.T) {
		lbxtest.WaitFor(t, 5*time.Second, "the admin view shows the totals and a throughput decision", func() (bool, string) {
			want := traffic.Totals()
			for _, nv := range buildRebalanceView().Nodes {
				if nv.Name != "bytes-node" {
					continue
				}
				b := nv.Bytes
				ok := nv.Metric == metricThroughput && b.Counting && b.In == want.In && b.Out == want.Out &&
					b.InHuman != "" && strings.HasSuffix(nv.Decision.LocalHuman, "B/s")
				return ok, fmt.Sprintf("%+v, decision %+v", b, nv.Decision)
			}
			return false, "no bytes-node"
		})
	})
}
