package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"time"
)

// runBurn is `bench burn -goroutines N`, the competing process of
// `bench graceful -burn N`: N goroutines that spin until the process is
// killed, to saturate the CPU the nodes and clients share. It never
// returns on its own.
func runBurn(args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench burn", flag.ContinueOnError)
	fs.SetOutput(stderr)
	n := fs.Int("goroutines", 2, "busy-looping goroutines")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n < 1 || *n > 64 {
		return fmt.Errorf("-goroutines %d: want 1 to 64", *n)
	}
	runtime.GOMAXPROCS(*n)
	for range *n {
		go func() {
			for {
			}
		}()
	}
	select {}
}

// startBurn starts `bench burn` as a child process (this binary again)
// with n busy goroutines, and returns the function that stops it by its
// PID. The kernel kills the child if the benchmark dies first.
func startBurn(n int) (stop func(), err error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "burn", "-goroutines", strconv.Itoa(n))
	cmd.SysProcAttr = sysProcAttr()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the competing process: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// A burner that cannot start (a bad flag) exits at once.
	select {
	case err := <-exited:
		return nil, errors.Join(errors.New("the competing process exited at once"), err)
	case <-time.After(200 * time.Millisecond):
	}
	return func() {
		_ = cmd.Process.Kill() // by its PID
		<-exited
	}, nil
}
