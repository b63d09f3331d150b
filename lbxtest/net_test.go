package lbxtest

import (
	"net"
	"testing"
)

// TestListenersOnPort: the count WaitOneListener relies on sees a
// listening socket, and no longer once it closes.
func TestListenersOnPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	n, ok := ListenersOnPort(port)
	if !ok {
		ln.Close()
		t.Skip("no /proc/net/tcp here")
	}
	if n != 1 {
		t.Errorf("listening: %d sockets counted on port %d; want 1", n, port)
	}
	ln.Close()
	if n, _ := ListenersOnPort(port); n != 0 {
		t.Errorf("closed: %d sockets counted on port %d; want 0", n, port)
	}
}
