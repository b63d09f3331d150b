// Package tcplb is a random TCP load balancer on loopback, the outer
// balancer that lbx's rebalance tests and benchmarks put in front of
// their Caddy nodes. It uses the standard library only, so the benchmark
// command that links it stays free of Caddy.
package tcplb

import (
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"time"
)

// Balancer accepts TCP connections on 127.0.0.1 and pipes each to a node
// chosen at random (HAProxy's `balance random`, without health checks: a
// node that refuses the dial is skipped). It is the outer load balancer a
// shed client reconnects through.
type Balancer struct {
	// Addr is the address clients connect to.
	Addr string
	ln   net.Listener

	mu      sync.Mutex
	targets []string
	conns   map[net.Conn]struct{}
	wg      sync.WaitGroup
}

// Start listens on a free loopback port.
func Start() (*Balancer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	lb := &Balancer{Addr: ln.Addr().String(), ln: ln, conns: map[net.Conn]struct{}{}}
	lb.wg.Add(1)
	go lb.serve()
	return lb, nil
}

// Close stops accepting, closes every connection and waits for the
// pipes to end.
func (lb *Balancer) Close() {
	lb.ln.Close()
	lb.mu.Lock()
	for c := range lb.conns {
		c.Close()
	}
	lb.mu.Unlock()
	lb.wg.Wait()
}

// Add makes target (host:port) one of the nodes new connections go to.
func (lb *Balancer) Add(target string) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.targets = append(lb.targets, target)
}

// Remove takes target out of the choice (connections already piped to it
// stay).
func (lb *Balancer) Remove(target string) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.targets = slices.DeleteFunc(lb.targets, func(t string) bool { return t == target })
}

// track adds c to the open connections, or removes it.
func (lb *Balancer) track(c net.Conn, add bool) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	if add {
		lb.conns[c] = struct{}{}
	} else {
		delete(lb.conns, c)
	}
}

func (lb *Balancer) serve() {
	defer lb.wg.Done()
	for {
		c, err := lb.ln.Accept()
		if err != nil {
			return
		}
		lb.track(c, true)
		lb.wg.Add(1)
		go lb.pipe(c)
	}
}

func (lb *Balancer) pipe(c net.Conn) {
	defer lb.wg.Done()
	defer lb.track(c, false)
	defer c.Close()
	lb.mu.Lock()
	order := slices.Clone(lb.targets)
	lb.mu.Unlock()
	rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	var up net.Conn
	for _, tg := range order {
		var err error
		if up, err = net.DialTimeout("tcp", tg, 2*time.Second); err == nil {
			break
		}
	}
	if up == nil {
		return
	}
	lb.track(up, true)
	defer lb.track(up, false)
	defer up.Close()
	done := make(chan struct{}, 2)
	go func() { copyPlain(up, c); done <- struct{}{} }()
	go func() { copyPlain(c, up); done <- struct{}{} }()
	// Either side closing closes both: the node's close reaches the
	// client as the node's own would.
	<-done
	c.Close()
	up.Close()
	<-done
}

// copyPlain copies src to dst through a small buffer of its own. A plain
// io.Copy between two TCP connections splices, and every splice in
// progress holds a pipe (two more file descriptors): with thousands of
// idle keep-alive connections piped both ways, that is six descriptors a
// connection instead of two.
func copyPlain(dst io.Writer, src io.Reader) {
	buf := make([]byte, 4096)
	// The wrappers hide ReaderFrom and WriterTo, so CopyBuffer uses buf.
	_, _ = io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, buf)
}
