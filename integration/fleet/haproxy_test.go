package fleet

import (
	"bufio"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// greeter is a loopback TCP server that greets every connection with its
// name and a newline, then echoes, counting the connections it accepted.
type greeter struct {
	name     string
	ln       net.Listener
	accepted atomic.Int32
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

// startGreeter starts a greeter named name on a free loopback port, closed
// with every connection it accepted when the test ends.
func startGreeter(t *testing.T, name string) *greeter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &greeter{name: name, ln: ln}
	g.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			g.accepted.Add(1)
			g.mu.Lock()
			g.conns = append(g.conns, c)
			g.mu.Unlock()
			g.wg.Go(func() {
				if _, err := io.WriteString(c, g.name+"\n"); err == nil {
					_, _ = io.Copy(c, c)
				}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		g.mu.Lock()
		for _, c := range g.conns {
			c.Close()
		}
		g.mu.Unlock()
		g.wg.Wait()
	})
	return g
}

// dialGreeting connects to addr and returns the connection and the name
// it was greeted with, or "" when the connection closed without one (no
// server to send it to).
func dialGreeting(t *testing.T, addr string) (net.Conn, string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatalf("dialing the front %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatalf("reading the greeting through %s: %v", addr, err)
	}
	return c, strings.TrimSpace(line)
}

// greetings opens n connections through addr, kept open, and returns the
// names that greeted them.
func greetings(t *testing.T, addr string, n int) []string {
	t.Helper()
	names := make([]string, n)
	for i := range names {
		_, names[i] = dialGreeting(t, addr)
	}
	return names
}

// count returns how many of names are name.
func count(names []string, name string) int {
	n := 0
	for _, s := range names {
		if s == name {
			n++
		}
	}
	return n
}

// TestHAProxyFront runs the real haproxy with two loopback backends, a
// and b: with no slot enabled a connection gets no server; Add enables a
// slot (a takes every connection, b none); with b added, leastconn sends
// b every new connection while a holds 4 and round robin sends b some;
// Remove stops new connections to a while those it holds go on; Close
// stops the process, whose PID is then gone.
func TestHAProxyFront(t *testing.T) {
	for _, balance := range []string{"leastconn", "roundrobin"} {
		t.Run(balance, func(t *testing.T) {
			h, err := StartHAProxy(t.TempDir(), balance)
			if errors.Is(err, ErrNoHAProxy) {
				t.Skipf("%v: the HAProxy front is not tested", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			closed := false
			t.Cleanup(func() {
				if !closed {
					_ = h.Close()
				}
			})
			a, b := startGreeter(t, "a"), startGreeter(t, "b")

			if _, name := dialGreeting(t, h.Addr()); name != "" {
				t.Fatalf("no server enabled, yet greeted by %q", name)
			}
			if err := h.Add(a.ln.Addr().String()); err != nil {
				t.Fatal(err)
			}
			held, name := dialGreeting(t, h.Addr())
			names := append(greetings(t, h.Addr(), 3), name)
			if count(names, "a") != 4 || b.accepted.Load() != 0 {
				t.Fatalf("a alone enabled: greetings %q, b accepted %d; want a 4 times, b 0", names, b.accepted.Load())
			}

			if err := h.Add(b.ln.Addr().String()); err != nil {
				t.Fatal(err)
			}
			names = greetings(t, h.Addr(), 4)
			switch {
			case balance == "leastconn" && count(names, "b") != 4:
				t.Errorf("leastconn, a holding 4 and b none: greetings %q; want b 4 times", names)
			case balance == "roundrobin" && count(names, "b") == 0:
				t.Errorf("round robin over a and b: greetings %q; want b among them", names)
			}

			aBefore := a.accepted.Load()
			if err := h.Remove(a.ln.Addr().String()); err != nil {
				t.Fatal(err)
			}
			if names := greetings(t, h.Addr(), 4); count(names, "b") != 4 || a.accepted.Load() != aBefore {
				t.Errorf("a removed: greetings %q, a accepted %d more; want b 4 times, a none", names, a.accepted.Load()-aBefore)
			}
			// What a held before its removal goes on: a graceful stop leaves
			// closing them to the node.
			if _, err := io.WriteString(held, "ping\n"); err != nil {
				t.Fatalf("writing on a connection a held before its removal: %v", err)
			}
			if echo, err := bufio.NewReader(held).ReadString('\n'); err != nil || echo != "ping\n" {
				t.Errorf("a connection a held before its removal: echo %q, %v; want \"ping\\n\"", echo, err)
			}

			if err := h.Remove("127.0.0.1:1"); err == nil {
				t.Error("removing a target never added: no error")
			}
			if err := h.Add("127.0.0.1:0"); err == nil {
				t.Error("adding port 0: no error")
			}

			pid := h.Pid()
			closed = true
			if err := h.Close(); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
				t.Errorf("haproxy pid %d after Close: kill -0 gives %v; want no such process", pid, err)
			}
			if c, err := net.DialTimeout("tcp", h.Addr(), time.Second); err == nil {
				c.Close()
				t.Errorf("the front %s still accepts after Close", h.Addr())
			}
		})
	}
}

// TestCheckFront: every front name is accepted, empty is random, and an
// unknown one is refused naming it.
func TestCheckFront(t *testing.T) {
	for _, name := range append([]string{""}, FrontNames...) {
		if err := CheckFront(name); err != nil {
			t.Errorf("CheckFront(%q): %v", name, err)
		}
	}
	if err := CheckFront("haproxy-random"); err == nil || !strings.Contains(err.Error(), `"haproxy-random"`) {
		t.Errorf("CheckFront(haproxy-random): %v; want an error naming it", err)
	}
	if IdealBalancer("") != IdealBalancer(FrontRandom) || IdealBalancer(FrontLeastConn) == IdealBalancer(FrontRoundRobin) {
		t.Error("IdealBalancer: empty is not random, or leastconn is round robin")
	}
}
