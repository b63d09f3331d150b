package handoff

import (
	"crypto/tls"
	"net"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestUnmarshalCaddyfile(t *testing.T) {
	for _, c := range []struct{ in, err string }{
		{"lbx_handoff", ""},
		{"lbx_handoff on", `lbx_handoff listener wrapper: unexpected argument "on"; it takes none, at Testfile:1`},
		{"lbx_handoff {\n\tdelay 1s\n}", `lbx_handoff listener wrapper: unexpected block; it takes no options, at Testfile:1`},
	} {
		err := new(Wrapper).UnmarshalCaddyfile(caddyfile.NewTestDispenser(c.in))
		if c.err == "" && err != nil || c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%q: %v; want %q", c.in, err, c.err)
		}
	}
}

func provisioned(t *testing.T) *Wrapper {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	t.Cleanup(cancel)
	w := new(Wrapper)
	if err := w.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	return w
}

// A wrapper after tls would hand over connections whose TLS belongs to the
// old config: it passes the listener through.
func TestAfterTLSPassesThrough(t *testing.T) {
	w := provisioned(t)
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	tlsLn := tls.NewListener(raw, &tls.Config{})
	if got := w.WrapListener(tlsLn); got != tlsLn {
		t.Errorf("after tls: WrapListener gave %T; want the TLS listener itself", got)
	}
	if got := w.WrapListener(raw); got == raw {
		t.Error("before tls: WrapListener gave the listener itself; want it wrapped")
	}
	w.Cleanup()
}

// Cleanup closes the listeners a config wrapped (a config that failed to
// start) and is safe to call again, and on a wrapper never provisioned.
func TestCleanupClosesWhatItWrapped(t *testing.T) {
	w := provisioned(t)
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := w.WrapListener(raw)
	if err := w.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Accept(); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("Accept after Cleanup: %v; want closed", err)
	}
	if _, err := net.Dial("tcp", raw.Addr().String()); err == nil {
		t.Error("the socket still accepts after Cleanup")
	}
	if err := w.Cleanup(); err != nil {
		t.Errorf("second Cleanup: %v", err)
	}
	if err := new(Wrapper).Cleanup(); err != nil {
		t.Errorf("Cleanup before Provision: %v", err)
	}
}
