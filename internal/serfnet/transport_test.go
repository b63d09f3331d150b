package serfnet

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"testing"
)

// FuzzDirectDecode: Decode never panics, reports a known result,
// and what it accepts encodes back to a message that decodes the same
// (the same bytes, in clear text).
func FuzzDirectDecode(f *testing.F) {
	key := []byte("0123456789abcdef0123456789abcdef")
	other := []byte("fedcba9876543210")
	for _, k := range [][]byte{nil, key} {
		for _, m := range []struct {
			from    string
			kind    byte
			payload string
		}{
			{"a", 0, ""},
			{"edge-1", 7, "hello"},
			{strings.Repeat("n", MaxNodeName), 255, strings.Repeat("p", 1000)},
		} {
			pkt, err := Encode(m.from, m.kind, []byte(m.payload), k)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(pkt, k != nil)
		}
	}
	f.Add([]byte{Magic}, false)
	f.Add([]byte{Magic, Version, 200, 'x'}, false)
	f.Add([]byte{Magic, Version + 1, 1, 'x', 1}, true)
	f.Fuzz(func(t *testing.T, pkt []byte, encrypted bool) {
		var keys, sealWith = [][]byte(nil), []byte(nil)
		if encrypted {
			keys, sealWith = [][]byte{other, key}, key
		}
		from, kind, payload, res := Decode(pkt, keys)
		if res >= NumResults || res == SendError || res == HandlerPanic {
			t.Fatalf("result %d", res)
		}
		if res != OK {
			return
		}
		again, err := Encode(from, kind, payload, sealWith)
		if err != nil {
			t.Fatalf("decoded %q %d %q, which does not encode: %v", from, kind, payload, err)
		}
		if !encrypted && !bytes.Equal(again, pkt) {
			t.Fatalf("decoded %x, encoded again %x", pkt, again)
		}
		from2, kind2, payload2, res2 := Decode(again, keys)
		if res2 != OK || from2 != from || kind2 != kind || !bytes.Equal(payload2, payload) {
			t.Fatalf("decoded %q %d %q, encoded and decoded again %q %d %q (%v)", from, kind, payload, from2, kind2, payload2, res2)
		}
	})
}

// TestDirectSameSource: a message counts as from a member only when its
// UDP source is the member's advertised IP and port; the IP compares
// across the IPv4-mapped form, and a TCP source (memberlist's stream
// transport) never matches.
func TestDirectSameSource(t *testing.T) {
	member := netip.MustParseAddrPort("192.0.2.7:7946")
	v6 := netip.MustParseAddrPort("[2001:db8::7]:7946")
	for _, c := range []struct {
		name string
		from net.Addr
		addr netip.AddrPort
		want bool
	}{
		{"same IP and port", &net.UDPAddr{IP: net.ParseIP("192.0.2.7"), Port: 7946}, member, true},
		{"IPv4 in 16 bytes", &net.UDPAddr{IP: net.IPv4(192, 0, 2, 7).To16(), Port: 7946}, member, true},
		{"IPv6", &net.UDPAddr{IP: net.ParseIP("2001:db8::7"), Port: 7946}, v6, true},
		{"another port", &net.UDPAddr{IP: net.ParseIP("192.0.2.7"), Port: 7947}, member, false},
		{"another IP", &net.UDPAddr{IP: net.ParseIP("192.0.2.8"), Port: 7946}, member, false},
		{"another IPv6", &net.UDPAddr{IP: net.ParseIP("2001:db8::8"), Port: 7946}, v6, false},
		{"TCP", &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 7946}, member, false},
		{"nil UDP", (*net.UDPAddr)(nil), member, false},
		{"nil", nil, member, false},
	} {
		if got := sameSource(c.from, c.addr); got != c.want {
			t.Errorf("%s: sameSource(%v, %v) = %v; want %v", c.name, c.from, c.addr, got, c.want)
		}
	}
}
