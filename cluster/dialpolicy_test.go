package cluster

import (
	"context"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/caddyopt"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestDialPolicySynthetic: synthetic members (data only: nothing is
// dialed) at each kind of address the policy refuses, with and without
// the loopback exemption and the allowlists; the reason is in the
// skipped list and counted.
func TestDialPolicySynthetic(t *testing.T) {
	mem := func(name, ip, port string) Member {
		return Member{Name: name, Addr: net.ParseIP(ip), Status: StatusAlive, Tags: map[string]string{"http_port": port}}
	}
	members := []Member{
		mem("ok", "10.0.0.1", "8080"),
		mem("ok6", "2001:db8::1", "8080"),
		mem("lo", "127.0.0.1", "8080"),
		mem("lo6", "::1", "8080"),
		mem("ll", "169.254.10.1", "8080"),
		mem("ll6", "fe80::1", "8080"),
		mem("llm", "224.0.0.251", "8080"),
		mem("llm6", "ff02::1", "8080"),
		mem("mc", "239.1.2.3", "8080"),
		mem("any", "0.0.0.0", "8080"),
		mem("any6", "::", "8080"),
		mem("bc", "255.255.255.255", "8080"),
		mem("mapped-lo", "::ffff:127.0.0.1", "8080"),
		mem(strings.Repeat("n", 20000), "10.0.0.2", "8080"),
		mem("bad\x00name", "10.0.0.3", "8080"),
		mem("bad\xffutf8", "10.0.0.4", "8080"),
		mem("admin", "127.0.0.1", "2019"),
		mem("port9000", "10.0.0.5", "9000"),
		mem("net", "10.1.0.1", "8080"),
	}
	want := map[string]string{
		"lo": "loopback", "lo6": "loopback", "mapped-lo": "loopback",
		"ll": "link_local", "ll6": "link_local", "llm": "link_local", "llm6": "link_local",
		"mc": "multicast", "any": "unspecified", "any6": "unspecified", "bc": "broadcast",
		"nnnn": "bad_name", "bad": "bad_name", "admin": "loopback",
	}
	run := func(s *Selector) (picked map[string]bool, reasons map[string]string) {
		t.Helper()
		if err := s.Validate(); err != nil {
			t.Fatal(err)
		}
		p, skipped := s.Select(members, nil)
		picked = map[string]bool{}
		for _, x := range p {
			picked[x.Name] = true
		}
		reasons = map[string]string{}
		for _, sk := range skipped {
			name, rest, _ := strings.Cut(strings.TrimPrefix(sk, "member "), ":")
			if len(name) > maxNodeName+3 {
				t.Errorf("skipped reason quotes a name of %d bytes", len(name))
			}
			i, j := strings.Index(rest, "("), strings.Index(rest, ")")
			if i < 0 || j < i {
				t.Fatalf("skipped %q has no reason", sk)
			}
			key := name
			for _, p := range []string{"nnnn", "bad"} {
				if strings.HasPrefix(name, p) {
					key = p
				}
			}
			reasons[key] = rest[i+1 : j]
		}
		return picked, reasons
	}

	before := refusedCounts[refusedLinkLocal].Load()
	picked, reasons := run(&Selector{PortTag: "http_port"})
	for name, reason := range want {
		if reasons[name] != reason {
			t.Errorf("no allowlist: member %s refused for %q; want %q", name, reasons[name], reason)
		}
	}
	for _, name := range []string{"ok", "ok6", "port9000", "net"} {
		if !picked[name] {
			t.Errorf("member %s not picked (%q)", name, reasons[name])
		}
	}
	if got := refusedCounts[refusedLinkLocal].Load() - before; got != 4 {
		t.Errorf("link_local counted %d times; want 4", got)
	}

	// Bound to loopback: loopback members are picked, but never the
	// default admin endpoint (localhost:2019).
	loop := &Selector{PortTag: "http_port", app: &App{bindHost: "127.0.0.1"}}
	picked, reasons = run(loop)
	if !picked["lo"] || !picked["lo6"] || !picked["mapped-lo"] {
		t.Errorf("cluster bound to loopback: loopback members not picked: %v", reasons)
	}
	if reasons["admin"] != "admin_endpoint" || reasons["ll"] != "link_local" {
		t.Errorf("cluster bound to loopback: admin %q, link-local %q; want admin_endpoint and link_local", reasons["admin"], reasons["ll"])
	}

	// The allowlists.
	picked, reasons = run(&Selector{PortTag: "http_port", AllowNetworks: []string{"10.0.0.0/24", "2001:db8::1"}, AllowPorts: []string{"8000-8099"}})
	if !picked["ok"] || !picked["ok6"] || reasons["net"] != "network_not_allowed" || reasons["port9000"] != "port_not_allowed" {
		t.Errorf("allowlists: picked %v, reasons %v", picked, reasons)
	}
}

// TestOwnListenerDetection: a listener Caddy opens (its listener pool,
// as for its sites and admin endpoint) is found at its address, and
// through a wildcard listener at every local IP; once closed it is not.
func TestOwnListenerDetection(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	for _, listen := range []string{"127.0.0.1", "localhost", ""} {
		port := lbxtest.FreePort(t)
		na, err := caddy.ParseNetworkAddress(listen + ":" + strconv.Itoa(port))
		if err != nil {
			t.Fatal(err)
		}
		ln, err := na.Listen(context.Background(), 0, net.ListenConfig{})
		if err != nil {
			t.Fatal(err)
		}
		if !isOwnListener(lo, port) {
			t.Errorf("listening on %q:%d: 127.0.0.1:%d not detected", listen, port, port)
		}
		if isOwnListener(lo, port+1) && caddy.ListenerUsage("tcp", "127.0.0.1:"+strconv.Itoa(port+1)) == 0 {
			t.Errorf("listening on %q:%d: port %d detected too", listen, port, port+1)
		}
		if isOwnListener(netip.MustParseAddr("192.0.2.1"), port) {
			t.Errorf("listening on %q:%d: a foreign IP detected as local", listen, port)
		}
		ln.(net.Listener).Close()
		if isOwnListener(lo, port) {
			t.Errorf("%q:%d still detected once closed", listen, port)
		}
	}
	// Every member but this node itself: this node's own site is a
	// member address like any other when it is Self.
	port := lbxtest.FreePort(t)
	na, _ := caddy.ParseNetworkAddress("127.0.0.1:" + strconv.Itoa(port))
	ln, err := na.Listen(context.Background(), 0, net.ListenConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.(net.Listener).Close()
	s := &Selector{Port: strconv.Itoa(port), app: &App{bindHost: "127.0.0.1"}}
	ms := []Member{
		{Name: "self", Addr: net.IPv4(127, 0, 0, 1), Status: StatusAlive, Self: true},
		{Name: "other", Addr: net.IPv4(127, 0, 0, 1), Status: StatusAlive},
	}
	picked, skipped := s.Select(ms, nil)
	if len(picked) != 1 || picked[0].Name != "self" || len(skipped) != 1 || !strings.Contains(skipped[0], "(own_listener)") {
		t.Errorf("own site: picked %v, skipped %q; want self picked and other refused as own_listener", picked, skipped)
	}
}

// TestRefusalsLogOncePerMinute: a refusal that lasts is counted and
// logged once per refusalQuiet, shown while seen, and gone a minute
// after it was last seen.
func TestRefusalsLogOncePerMinute(t *testing.T) {
	var rs refusals
	k := refusalKey{name: "m", dial: "10.0.0.1:1", reason: refusedPort}
	before := refusedCounts[refusedPort].Load()
	t0 := time.Unix(1000, 0)
	for i := range 120 {
		rs.note(nil, k, t0.Add(time.Duration(i)*time.Second))
	}
	if got := refusedCounts[refusedPort].Load() - before; got != 2 {
		t.Errorf("a refusal seen every second for 2 minutes counted %d times; want 2", got)
	}
	if v := rs.byMember(t0.Add(2 * time.Minute)); len(v["m"]) != 1 || v["m"][0].Reason != "port_not_allowed" {
		t.Errorf("view: %v", v)
	}
	if v := rs.byMember(t0.Add(4 * time.Minute)); len(v) != 0 {
		t.Errorf("view a minute after the last refusal: %v; want empty", v)
	}
	for i := range 2 * maxRefusals {
		rs.note(nil, refusalKey{name: "churn", dial: "10.0.0.1:" + strconv.Itoa(i), reason: refusedPort}, t0)
	}
	if n := len(rs.m); n > maxRefusals {
		t.Errorf("%d refusals remembered; want at most %d", n, maxRefusals)
	}
}

// TestAllowOptions: allow_networks and allow_ports in the Caddyfile and
// in Validate, with their errors.
func TestAllowOptions(t *testing.T) {
	for _, tc := range []struct {
		in, err string
	}{
		{"allow_networks 10.0.0.0/8 fd00::/8 192.0.2.7", ""},
		{"allow_ports 8080 8000-8099", ""},
		{"allow_networks 10.0.0.0/33", `allow_networks "10.0.0.0/33": want a CIDR`},
		{"allow_networks", "allow_networks"},
		{"allow_ports 0", `allow_ports "0": want a port or a range lo-hi`},
		{"allow_ports 9000-8000", `allow_ports "9000-8000"`},
		{"allow_ports x-1", `allow_ports "x-1"`},
	} {
		d := caddyfile.NewTestDispenser(tc.in)
		d.Next()
		var s Selector
		ok, err := s.UnmarshalOption(d, "dynamic serf", caddyopt.NewOnce("dynamic serf"))
		if !ok {
			t.Fatalf("%q: not an option", tc.in)
		}
		if (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%q: error %v; want %q", tc.in, err, tc.err)
		}
	}
	s := Selector{Port: "80", AllowPorts: []string{"70000"}}
	if err := s.Validate(); err == nil || !strings.Contains(err.Error(), `allow_ports "70000"`) {
		t.Errorf("Validate: %v", err)
	}
	s = Selector{Port: "80", AllowNetworks: []string{"example.com"}}
	if err := s.Validate(); err == nil || !strings.Contains(err.Error(), `allow_networks "example.com"`) {
		t.Errorf("Validate: %v", err)
	}
}

// TestShownName: names are cut to 128 bytes of valid UTF-8 in views.
func TestShownName(t *testing.T) {
	if got := shownName(strings.Repeat("é", 100)); len(got) > maxNodeName+len("…") || !strings.HasSuffix(got, "…") {
		t.Errorf("200 bytes of é shown as %d bytes: %q", len(got), got)
	}
	if got := shownName("a\xffb"); got != "a\uFFFDb" {
		t.Errorf("invalid UTF-8 shown as %q", got)
	}
	if got := shownName("front-1"); got != "front-1" {
		t.Errorf("a good name changed: %q", got)
	}
}
