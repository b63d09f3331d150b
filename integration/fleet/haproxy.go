package fleet

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrNoHAProxy is StartHAProxy's error when the haproxy binary is not
// installed: a test skips on it, the benchmark stops with it.
var ErrNoHAProxy = errors.New("haproxy is not installed (apt-get install haproxy)")

// HAProxySlots is how many nodes an HAProxy front can take: its backend is
// a server-template of this many servers, every one disabled until Add
// gives it a node. 32 holds the largest scale-out (-from 8: 18 nodes).
const HAProxySlots = 32

// haproxyConfig is the front's configuration: TCP mode on loopback, a
// backend of HAProxySlots disabled servers and an admin Runtime API on a
// unix socket. The timeouts let an idle keep-alive client sit for an hour
// (a shorter timeout would close connections the rebalancer did not
// shed); a refused connect is retried and, on the last retry, sent to
// another server (option redispatch), as a refused dial is skipped by
// tcplb. maxconn is set rather than derived from the file limit, so a
// benchmark's thousands of clients are not turned away by a low default.
const haproxyConfig = `global
    maxconn 8000
    stats socket %[1]s level admin

defaults
    mode tcp
    timeout connect 1s
    timeout client 1h
    timeout server 1h
    retries 2
    option redispatch 1

frontend fe
    bind %[2]s
    default_backend be

backend be
    balance %[3]s
    server-template n 1-%[4]d 127.0.0.1:1 disabled
`

// HAProxy is a Front that runs the haproxy binary as a child process.
// Add gives a node a free server slot through the Runtime API (set server
// addr, then state ready) and Remove puts its slot in maintenance (state
// maint): no new connection reaches it and those it holds stay, as they do
// with drain, which only differs for persistent (sticky) traffic this
// backend does not have. A node keeps its slot when removed, so a restart
// on the same address takes the same server, whose leastconn count the
// old process's connections are still leaving.
type HAProxy struct {
	addr, sock string
	proc       *Proc

	mu    sync.Mutex // serialises slot changes and their commands
	slots map[string]int
}

// haproxyBinary returns the haproxy binary: on PATH, or where Debian's
// package puts it, which a user's PATH often lacks (/usr/sbin).
func haproxyBinary() (string, error) {
	if p, err := exec.LookPath("haproxy"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/haproxy"); err == nil {
		return "/usr/sbin/haproxy", nil
	}
	return "", ErrNoHAProxy
}

// StartHAProxy starts haproxy in the foreground (-db, no master-worker)
// with balance (roundrobin or leastconn), listening on a free loopback
// port, its configuration and Runtime API socket in dir, and waits up to
// 10 s for both to answer.
func StartHAProxy(dir, balance string) (*HAProxy, error) {
	if balance != "roundrobin" && balance != "leastconn" {
		return nil, fmt.Errorf("haproxy balance %q: want roundrobin or leastconn", balance)
	}
	bin, err := haproxyBinary()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	h := &HAProxy{addr: fmt.Sprintf("127.0.0.1:%d", port), sock: filepath.Join(dir, "haproxy.sock"), slots: map[string]int{}}
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, haproxyConfig, h.sock, h.addr, balance, HAProxySlots), 0o600); err != nil {
		return nil, err
	}
	if h.proc, err = startCmd(exec.Command(bin, "-f", cfg, "-db")); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if h.proc.Exited() {
			return nil, fmt.Errorf("haproxy -f %s exited: %v\n%s", cfg, h.proc.WaitErr(), h.proc.Log())
		}
		_, err := h.command("show info")
		if err == nil {
			var c net.Conn
			if c, err = net.DialTimeout("tcp", h.addr, time.Second); err == nil {
				c.Close()
				return h, nil
			}
		}
		if time.Now().After(deadline) {
			_ = h.proc.Kill()
			return nil, fmt.Errorf("haproxy (pid %d) not answering on %s and %s within 10s: %v\n%s", h.proc.Pid(), h.addr, h.sock, err, h.proc.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Addr implements Front.
func (h *HAProxy) Addr() string { return h.addr }

// Pid returns the haproxy process's ID.
func (h *HAProxy) Pid() int { return h.proc.Pid() }

// Add implements Front: target (127.0.0.1:port) gets its slot, or the
// next free one, and the slot is made ready.
func (h *HAProxy) Add(target string) error {
	host, port, err := net.SplitHostPort(target)
	if err != nil {
		return fmt.Errorf("haproxy front: target %q: %v", target, err)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("haproxy front: target %q: port %q is not 1 to 65535", target, port)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	slot, ok := h.slots[target]
	if !ok {
		if len(h.slots) == HAProxySlots {
			return fmt.Errorf("haproxy front: no free slot for %s: all %d taken", target, HAProxySlots)
		}
		slot = len(h.slots) + 1
		// A successful change ends "by 'stats socket command'" whether or
		// not the address changed; anything else is an error message.
		cmd := fmt.Sprintf("set server be/n%d addr %s port %s", slot, host, port)
		if reply, err := h.command(cmd); err != nil || !strings.HasSuffix(reply, "by 'stats socket command'") {
			return fmt.Errorf("haproxy front: %s: %q, %v", cmd, reply, err)
		}
		h.slots[target] = slot
	}
	return h.setState(slot, "ready")
}

// Remove implements Front: target's slot goes into maintenance.
func (h *HAProxy) Remove(target string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	slot, ok := h.slots[target]
	if !ok {
		return fmt.Errorf("haproxy front: removing %s, which was never added", target)
	}
	return h.setState(slot, "maint")
}

// setState sets slot's state; HAProxy answers an empty line when it did.
func (h *HAProxy) setState(slot int, state string) error {
	cmd := fmt.Sprintf("set server be/n%d state %s", slot, state)
	if reply, err := h.command(cmd); err != nil || reply != "" {
		return fmt.Errorf("haproxy front: %s: %q, %v", cmd, reply, err)
	}
	return nil
}

// command sends one Runtime API command on a connection of its own (the
// socket answers one command and closes, unless told to prompt) and
// returns the reply, trimmed.
func (h *HAProxy) command(cmd string) (string, error) {
	c, err := net.DialTimeout("unix", h.sock, 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return "", err
	}
	if _, err := io.WriteString(c, cmd+"\n"); err != nil {
		return "", err
	}
	reply, err := io.ReadAll(c)
	return strings.TrimSpace(string(reply)), err
}

// Close implements Front: SIGTERM (HAProxy's hard stop, which closes
// every connection at once), then SIGKILL if the process is still there
// 5 s later.
func (h *HAProxy) Close() error {
	if err := h.proc.Signal(syscall.SIGTERM); err != nil && !h.proc.Exited() {
		return fmt.Errorf("haproxy (pid %d): %v", h.proc.Pid(), err)
	}
	select {
	case <-h.proc.Done():
		return nil
	case <-time.After(5 * time.Second):
		return h.proc.Kill()
	}
}
