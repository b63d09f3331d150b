package fleet

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Load is the clients a fleet run sends its requests with: *Clients (Go's
// transport, which resends an idempotent request that a closing
// keep-alive connection lost) or *NoRetry (clients that never resend).
type Load interface {
	// Opened returns the connections the clients have opened.
	Opened() int64
	// Stats returns the requests sent, the failures, and how many
	// requests were written twice.
	Stats() (requests int, errs []ClientError, retried int)
	// Close stops the clients and waits for them.
	Close()
}

// Opened implements Load.
func (cs *Clients) Opened() int64 { return cs.Connects.Load() }

// NoRetryMix is how many clients of each kind a NoRetry load runs.
type NoRetryMix struct {
	// GET and POST are Go RawClients sending GET, or POST with a small
	// body.
	GET, POST int
	// Python are Python http.client clients (POST with a small body), in
	// one python3 child process with a thread each.
	Python int
	// Every is each client's request period; Timeout bounds each request
	// (default 10 s).
	Every, Timeout time.Duration
	// BodyDelay is the Go POST clients' pause between a request's
	// headers and its body (RawClient.BodyDelay; 0: none).
	BodyDelay time.Duration
}

// Total returns the clients of every kind.
func (m NoRetryMix) Total() int { return m.GET + m.POST + m.Python }

// The no-retry client kinds, as reports name them, and the prefixes of
// their request ids.
const (
	ClientGoGET  = "Go raw GET"
	ClientGoPOST = "Go raw POST"
	ClientPython = "Python http.client POST"
)

var kindPrefix = map[string]string{ClientGoGET: "get", ClientGoPOST: "post", ClientPython: "py"}

// Tally is one kind of no-retry client's count.
type Tally struct {
	// Client is one of ClientGoGET, ClientGoPOST, ClientPython; Prefix
	// begins each of its request ids (for IDCounter.Check).
	Client, Prefix string
	Clients        int
	// Requests is the requests attempted, Sent those of them written on
	// an open connection.
	Requests, Sent int
	// Failures counts the failed requests by FailureKind.
	Failures map[string]int
	// Reused counts the failures on reused connections, and Stale those
	// of them whose connection had closed before the request was written
	// (RawResult.Stale).
	Reused, Stale int
	// Lost is the ids of requests sent that got no response.
	Lost []string
	// Samples are the first few failures, one line each.
	Samples []string
}

// Failed returns the failed requests.
func (t Tally) Failed() int {
	n := 0
	for _, v := range t.Failures {
		n += v
	}
	return n
}

// NoRetry is a load of keep-alive HTTP/1.1 clients that never resend a
// request: Go RawClients and Python's http.client. Each sends a request
// every period with its own id in IDHeader, and counts as a failure every
// request that got no full 200 "ok", on a reused connection too.
type NoRetry struct {
	opened atomic.Int64
	cancel context.CancelFunc
	wg     sync.WaitGroup
	py     *pyClients
	closed sync.Once

	mu      sync.Mutex
	tallies []*Tally
	errs    []ClientError
}

// StartNoRetry starts the clients of mix against addr, spread over the
// first period. python3 must be in PATH when mix has Python clients.
func StartNoRetry(addr string, mix NoRetryMix) (*NoRetry, error) {
	if mix.Timeout <= 0 {
		mix.Timeout = 10 * time.Second
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := &NoRetry{cancel: cancel}
	if mix.Python > 0 {
		t := n.tally(ClientPython, mix.Python)
		py, err := startPython(addr, mix, t.Prefix, n)
		if err != nil {
			cancel()
			return nil, err
		}
		n.py = py
	}
	for _, k := range []struct {
		client, method string
		count          int
	}{{ClientGoGET, http.MethodGet, mix.GET}, {ClientGoPOST, http.MethodPost, mix.POST}} {
		if k.count == 0 {
			continue
		}
		t := n.tally(k.client, k.count)
		for i := range k.count {
			n.wg.Go(func() { n.runRaw(ctx, addr, mix, t, k.method, i) })
		}
	}
	return n, nil
}

// tally adds a Tally for client.
func (n *NoRetry) tally(client string, clients int) *Tally {
	t := &Tally{Client: client, Prefix: kindPrefix[client], Clients: clients, Failures: map[string]int{}}
	n.mu.Lock()
	n.tallies = append(n.tallies, t)
	n.mu.Unlock()
	return t
}

// runRaw is one Go client: a request every period until ctx ends; the
// request in flight then finishes.
func (n *NoRetry) runRaw(ctx context.Context, addr string, mix NoRetryMix, t *Tally, method string, idx int) {
	c := &RawClient{Addr: addr, Timeout: mix.Timeout, BodyDelay: mix.BodyDelay}
	defer c.Close()
	var body []byte
	if method == http.MethodPost {
		body = []byte(strings.Repeat("x", 64))
	}
	select {
	case <-ctx.Done():
		return
	case <-time.After(rand.N(mix.Every)):
	}
	tick := time.NewTicker(mix.Every)
	defer tick.Stop()
	for seq := 0; ; seq++ {
		id := fmt.Sprintf("%s-%d-%d", t.Prefix, idx, seq)
		opened := c.Opened()
		r := c.Do(method, id, body)
		n.opened.Add(int64(c.Opened() - opened))
		errText := ""
		if r.Err != nil {
			errText = r.Err.Error()
		}
		n.record(t, time.Now(), r.Kind, !r.Reused, r.Stale, r.Sent, id, errText)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// record counts one request of t; kind is empty for a success.
func (n *NoRetry) record(t *Tally, at time.Time, kind string, fresh, stale, sent bool, id, errText string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	t.Requests++
	if sent {
		t.Sent++
	}
	if kind == "" {
		return
	}
	t.Failures[kind]++
	if !fresh {
		t.Reused++
	}
	if stale {
		t.Stale++
		errText += " (closed before the request)"
	}
	if sent && kind != KindStatus {
		t.Lost = append(t.Lost, id)
	}
	e := ClientError{At: at, Fresh: fresh, Err: kind + ": " + errText}
	n.errs = append(n.errs, e)
	if len(t.Samples) < 5 {
		t.Samples = append(t.Samples, e.String())
	}
}

// Opened implements Load.
func (n *NoRetry) Opened() int64 {
	o := n.opened.Load()
	if n.py != nil {
		o += n.py.opened.Load()
	}
	return o
}

// Stats implements Load; nothing is ever written twice.
func (n *NoRetry) Stats() (requests int, errs []ClientError, retried int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, t := range n.tallies {
		requests += t.Requests
	}
	return requests, slices.Clone(n.errs), 0
}

// Tallies returns each kind's count so far.
func (n *NoRetry) Tallies() []Tally {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]Tally, len(n.tallies))
	for i, t := range n.tallies {
		out[i] = *t
		out[i].Failures = map[string]int{}
		for k, v := range t.Failures {
			out[i].Failures[k] = v
		}
		out[i].Lost, out[i].Samples = slices.Clone(t.Lost), slices.Clone(t.Samples)
	}
	return out
}

// Close implements Load: no client starts another request; those in
// flight finish (each within its timeout), and the Python process exits.
// Closing again does nothing.
func (n *NoRetry) Close() {
	n.closed.Do(func() {
		n.cancel()
		n.wg.Wait()
		if n.py != nil {
			if err := n.py.close(); err != nil {
				n.mu.Lock()
				n.errs = append(n.errs, ClientError{At: time.Now(), Err: "python clients: " + err.Error()})
				n.mu.Unlock()
			}
		}
	})
}

// pythonScript is the Python http.client load (testdata/noretry_client.py).
//
//go:embed testdata/noretry_client.py
var pythonScript []byte

// pyClients is the python3 child process running pythonScript.
type pyClients struct {
	cmd    *exec.Cmd
	dir    string
	stdin  io.WriteCloser
	stderr *syncBuffer
	opened atomic.Int64
	done   chan error // the stdout reader's end, then the process's
}

// pyLine is one JSON line of pythonScript's output.
type pyLine struct {
	Opened, Requests int64
	Done             bool
	Sent             int
	Failures         []struct {
		At           float64
		Kind, ID     string
		Fresh, Stale bool
		Sent         bool
		Err          string
	}
}

// startPython starts pythonScript with mix.Python threads, its ids
// starting with prefix, recording into n's Python tally.
func startPython(addr string, mix NoRetryMix, prefix string, n *NoRetry) (*pyClients, error) {
	bin, err := exec.LookPath("python3")
	if err != nil {
		return nil, fmt.Errorf("Python clients need python3 in PATH: %w", err)
	}
	dir, err := os.MkdirTemp("", "lbx-noretry-py-")
	if err != nil {
		return nil, err
	}
	script := filepath.Join(dir, "noretry_client.py")
	if err := os.WriteFile(script, pythonScript, 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	p := &pyClients{dir: dir, stderr: new(syncBuffer), done: make(chan error, 1)}
	p.cmd = exec.Command(bin, script, addr, strconv.Itoa(mix.Python), strconv.FormatInt(mix.Every.Milliseconds(), 10),
		strconv.FormatFloat(mix.Timeout.Seconds(), 'f', -1, 64), prefix, http.MethodPost)
	p.cmd.Stderr = p.stderr
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting python3: %w", err)
	}
	t := n.tallies[len(n.tallies)-1]
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 64<<20)
		var last pyLine
		for sc.Scan() {
			var l pyLine
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				continue // not one of the script's lines
			}
			p.opened.Store(l.Opened)
			n.mu.Lock()
			reqs := t.Requests
			n.mu.Unlock()
			for _, f := range l.Failures {
				at := time.UnixMicro(int64(f.At * 1e6))
				n.record(t, at, f.Kind, f.Fresh, f.Stale, f.Sent, f.ID, f.Err)
			}
			n.mu.Lock()
			// The successes: the script's count includes the failures
			// just recorded.
			t.Requests = max(reqs+len(l.Failures), int(l.Requests))
			if l.Done {
				t.Sent = l.Sent
			}
			n.mu.Unlock()
			last = l
		}
		werr := p.cmd.Wait()
		if !last.Done {
			werr = errors.Join(errors.New("python3 ended without its final report"), werr, errors.New(p.stderr.String()))
		}
		p.done <- werr
	}()
	return p, nil
}

// close closes the script's standard input, which stops it, and waits up
// to its requests' timeout and 10 s more for it to exit; it kills it
// after that.
func (p *pyClients) close() error {
	defer os.RemoveAll(p.dir)
	_ = p.stdin.Close()
	select {
	case err := <-p.done:
		return err
	case <-time.After(25 * time.Second):
		_ = p.cmd.Process.Kill()
		return fmt.Errorf("python3 (pid %d) did not exit within 25s of its stdin closing; killed", p.cmd.Process.Pid)
	}
}
