// Package fleet runs a fleet of real Caddy processes (this repository's
// cmd/caddy) on loopback, for the rebalance acceptance test and the
// benchmark command: nodes joined in a serf cluster, an outer balancer in
// front (a Front: a TCP balancer that gives each new connection to a
// random node, or HAProxy round robin or least connections), long-lived
// HTTP clients, a record of every node's connections over time, and a plot of
// it. Everything it starts is stopped by Close; every wait has a deadline.
package fleet

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"
)

// BuildCaddy builds github.com/caddy-lbx/lbx/cmd/caddy to path, with the
// go command run in dir (the current directory when empty), which must be
// inside the lbx module.
func BuildCaddy(ctx context.Context, dir, path string) error {
	return goBuild(ctx, dir, path, "github.com/caddy-lbx/lbx/cmd/caddy")
}

// BuildStockCaddy builds stock Caddy (github.com/caddyserver/caddy/v2/cmd/caddy,
// the version the lbx module requires, without lbx) to path, with the go
// command run in dir as for BuildCaddy.
func BuildStockCaddy(ctx context.Context, dir, path string) error {
	return goBuild(ctx, dir, path, "github.com/caddyserver/caddy/v2/cmd/caddy")
}

func goBuild(ctx context.Context, dir, path, pkg string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", path, pkg)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
	}
	return nil
}

// Proc is one child process: a node's `caddy run`, or the HAProxy front.
type Proc struct {
	cmd    *exec.Cmd
	log    *syncBuffer
	exited chan struct{} // closed when the process has exited; waitErr is set
	// waitErr is the process's exit, once exited is closed.
	waitErr error
}

// StartProc runs `bin run --config <dir>/Caddyfile` with caddyfile, its
// home, config and data directories in dir, and env added to the
// environment. Stop it with Kill or Stop.
func StartProc(bin, dir, caddyfile string, env ...string) (*Proc, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	cfgPath := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cfgPath, []byte(caddyfile), 0o600); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "run", "--config", cfgPath)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(),
		"HOME="+dir,
		"XDG_CONFIG_HOME="+filepath.Join(dir, "config"),
		"XDG_DATA_HOME="+filepath.Join(dir, "data"),
	)
	cmd.Env = append(cmd.Env, env...)
	return startCmd(cmd)
}

// startCmd starts cmd, its output in the Proc's log, and reaps it when it
// exits.
func startCmd(cmd *exec.Cmd) (*Proc, error) {
	p := &Proc{cmd: cmd, log: new(syncBuffer), exited: make(chan struct{})}
	cmd.Stdout = p.log
	cmd.Stderr = p.log
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %v", cmd.Path, err)
	}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// Pid returns the process ID.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.exited }

// WaitErr is how the process exited; valid once Done is closed.
func (p *Proc) WaitErr() error { return p.waitErr }

// Log returns what the process wrote to stdout and stderr so far.
func (p *Proc) Log() string { return p.log.String() }

// Signal sends sig to the process.
func (p *Proc) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Kill sends SIGKILL and waits up to 10 s for the process to exit.
func (p *Proc) Kill() error {
	if !p.Exited() {
		_ = p.cmd.Process.Kill()
	}
	select {
	case <-p.exited:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s (pid %d) still running 10s after SIGKILL", filepath.Base(p.cmd.Path), p.Pid())
	}
}

// syncBuffer is a bytes.Buffer safe for the process's output copier and
// readers to use at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
