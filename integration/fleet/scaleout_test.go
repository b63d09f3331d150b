package fleet

import (
	"testing"
	"time"
)

// TestPhase2Split: at the reload only resets of new connections count as
// the reload's; an EOF there (a request lbx_handoff should have served)
// is one of the rest, as is a failure on a reused connection.
func TestPhase2Split(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	r := &ScaleOutResult{}
	r.Reload.Start, r.Reload.End = at(10*time.Second), at(11*time.Second)
	r.Kill.At = at(20 * time.Second)
	reset := ClientError{At: at(10500 * time.Millisecond), Fresh: true, Err: `Get "http://127.0.0.1:1/": read tcp 127.0.0.1:2->127.0.0.1:1: read: connection reset by peer`}
	pipe := ClientError{At: at(11900 * time.Millisecond), Fresh: true, Err: "write: broken pipe"}
	eof := ClientError{At: at(10500 * time.Millisecond), Fresh: true, Err: "EOF"}
	reused := ClientError{At: at(10500 * time.Millisecond), Fresh: false, Err: "read: connection reset by peer"}
	late := ClientError{At: at(12500 * time.Millisecond), Fresh: true, Err: "read: connection reset by peer"}
	killed := ClientError{At: at(21 * time.Second), Fresh: false, Err: "EOF"}
	r.Phase2Errors = []ClientError{reset, pipe, eof, reused, late, killed}

	atReload, afterKill, others := r.Phase2Split()
	if len(atReload) != 2 || atReload[0] != reset || atReload[1] != pipe {
		t.Errorf("at the reload: %v; want the reset and the broken pipe", atReload)
	}
	if len(afterKill) != 1 || afterKill[0] != killed {
		t.Errorf("after the kill: %v", afterKill)
	}
	if len(others) != 3 || others[0] != eof || others[1] != reused || others[2] != late {
		t.Errorf("others: %v; want the EOF, the reused connection's reset and the one past the window", others)
	}
}
