package conntrack

import (
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// readInput reports what the kernel knows of c's incoming bytes: how
// many are waiting to be read (SIOCINQ, FIONREAD on a socket) and, on a
// TCP socket, how long ago the last data segment arrived (TCP_INFO's
// tcpi_last_data_recv, in milliseconds). It unwraps TLS, PROXY-protocol
// and counting wrappers down to the socket (findConn); a connection that
// hides it (net.Pipe, a wrapper without NetConn) reads as unknown.
func readInput(c net.Conn) inputState {
	sc, ok := findConn[syscall.Conn](c)
	if !ok {
		return inputState{}
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return inputState{}
	}
	var in inputState
	cerr := raw.Control(func(fd uintptr) {
		if n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
			in.waiting, in.waitingKnown = n, true
		}
		if ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			in.sinceData, in.sinceDataKnown = time.Duration(ti.Last_data_recv)*time.Millisecond, true
		}
	})
	if cerr != nil {
		return inputState{}
	}
	return in
}
