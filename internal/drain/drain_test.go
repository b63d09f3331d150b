package drain

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"
)

// epochClock runs the package clock from the Unix epoch, so that versions
// are the Lamport counter alone.
func epochClock(t *testing.T) { setClock(t, time.Unix(0, 0)) }

// setClock stops the package clock at at.
func setClock(t *testing.T, at time.Time) {
	old := now
	t.Cleanup(func() { now = old })
	now = func() time.Time { return at }
}

func TestSetAndLookup(t *testing.T) {
	epochClock(t)
	s := New()
	if _, ok := s.Lookup("10.0.0.1:80"); ok || s.Any() || s.Epoch() != 0 {
		t.Fatal("an empty store has an active entry")
	}
	e, err := s.Set("10.0.0.1:80", true, 100)
	if err != nil {
		t.Fatal(err)
	}
	if e.Version != 1 || !e.Drained || e.WeightPercent != 100 {
		t.Fatalf("entry %+v", e)
	}
	if st, ok := s.Lookup("10.0.0.1:80"); !ok || !st.Drained {
		t.Fatalf("lookup after drain: %+v %v", st, ok)
	}
	if _, err := s.Set("10.0.0.2:80", false, 50); err != nil {
		t.Fatal(err)
	}
	if st, _ := s.Lookup("10.0.0.2:80"); st.Drained || st.WeightPercent != 50 {
		t.Fatalf("reweight: %+v", st)
	}
	e, _ = s.Set("10.0.0.1:80", false, 100)
	if e.Version != 3 {
		t.Fatalf("undrain version %d; want 3", e.Version)
	}
	if _, ok := s.Lookup("10.0.0.1:80"); ok {
		t.Fatal("undrained address still active")
	}
	if _, ok := s.Get("10.0.0.1:80"); !ok {
		t.Fatal("the undrain was not kept")
	}
	if s.Epoch() != 3 {
		t.Fatalf("epoch %d; want 3", s.Epoch())
	}
}

func TestBounds(t *testing.T) {
	s := New()
	for _, addr := range []string{
		"", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:http", ":80",
		"unix//run/app.sock", "10.0.0.1:080", "a b:80", strings.Repeat("a", 255) + ":80",
	} {
		if _, err := s.Set(addr, true, 100); err == nil {
			t.Errorf("Set(%q) accepted", addr)
		}
	}
	for _, p := range []int{0, -1, 101} {
		if _, err := s.Set("10.0.0.1:80", false, p); err == nil || !strings.Contains(err.Error(), "percent") {
			t.Errorf("percent %d: %v", p, err)
		}
	}
	for _, addr := range []string{"10.0.0.1:80", "[::1]:8080", "backend.example.com:443"} {
		if _, err := s.Set(addr, true, 100); err != nil {
			t.Errorf("Set(%q): %v", addr, err)
		}
	}
	if len(s.Entries()) != 3 {
		t.Fatalf("%d entries", len(s.Entries()))
	}
}

func TestMergeKeepsNewer(t *testing.T) {
	epochClock(t)
	s := New()
	drain := Entry{Addr: "10.0.0.1:80", Drained: true, WeightPercent: 100, Version: 5, Origin: "b"}
	if ok, err := s.Merge(drain); !ok || err != nil {
		t.Fatalf("first merge: %v %v", ok, err)
	}
	older := drain
	older.Version, older.Drained = 4, false
	if ok, _ := s.Merge(older); ok {
		t.Fatal("an older entry replaced a newer one")
	}
	tie := drain
	tie.Origin, tie.Drained = "a", false
	if ok, _ := s.Merge(tie); ok {
		t.Fatal("a tie from a lower origin won")
	}
	tie.Origin = "c"
	if ok, _ := s.Merge(tie); !ok {
		t.Fatal("a tie from a higher origin lost")
	}
	if _, ok := s.Lookup("10.0.0.1:80"); ok {
		t.Fatal("undrain by tie not applied")
	}
	// the Lamport clock: a local change after a merge is newer than it
	e, _ := s.Set("10.0.0.1:80", true, 100)
	if e.Version != 6 {
		t.Fatalf("local version %d after merging 5; want 6", e.Version)
	}
	// an undrain tombstone keeps an old drain from coming back
	e, _ = s.Set("10.0.0.1:80", false, 100)
	if ok, _ := s.Merge(Entry{Addr: "10.0.0.1:80", Drained: true, WeightPercent: 100, Version: 6, Origin: "z"}); ok {
		t.Fatal("an older drain resurrected after the undrain")
	}
	if got, _ := s.Get("10.0.0.1:80"); got.Version != e.Version || got.Drained {
		t.Fatalf("entry %+v", got)
	}
	bad := []Entry{
		{Addr: "nope", WeightPercent: 100, Version: 1},
		{Addr: "10.0.0.1:80", WeightPercent: 0, Version: 10},
		{Addr: "10.0.0.1:80", WeightPercent: 101, Version: 10},
		{Addr: "10.0.0.1:80", Drained: true, WeightPercent: 50, Version: 10},
		{Addr: "10.0.0.1:80", WeightPercent: 100, Version: 0},
		{Addr: "10.0.0.1:80", WeightPercent: 100, Version: 10, Origin: strings.Repeat("o", 129)},
		{Addr: "10.0.0.1:80", WeightPercent: 100, Version: uint64(MaxAhead.Milliseconds()) + 1},
		{Addr: "10.0.0.1:80", WeightPercent: 100, Version: ^uint64(0)},
	}
	for _, b := range bad {
		if _, err := s.Merge(b); err == nil {
			t.Errorf("Merge(%+v) accepted", b)
		}
	}
}

func TestFullStoreForgetsOldestUndrain(t *testing.T) {
	s := New()
	base := time.Unix(1e9, 0)
	defer func(f func() time.Time) { now = f }(now)
	tick := 0
	now = func() time.Time { tick++; return base.Add(time.Duration(tick) * time.Second) }
	for i := range MaxEntries {
		if _, err := s.Set(fmt.Sprintf("10.0.%d.%d:80", i/256, i%256), true, 100); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Set("10.1.0.1:80", true, 100); err != ErrFull {
		t.Fatalf("full store of drains: %v", err)
	}
	s.Set("10.0.0.7:80", false, 100)
	s.Set("10.0.0.3:80", false, 100)
	if _, err := s.Set("10.1.0.1:80", true, 100); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Get("10.0.0.7:80"); ok {
		t.Fatal("the oldest undrain was kept")
	}
	if _, ok := s.Get("10.0.0.3:80"); !ok {
		t.Fatal("a newer undrain was forgotten")
	}
	if len(s.Entries()) != MaxEntries {
		t.Fatalf("%d entries", len(s.Entries()))
	}
}

// TestVersionOutlivesRestart: a store that starts empty gives its first
// change the wall clock's milliseconds, above the versions it gave before.
func TestVersionOutlivesRestart(t *testing.T) {
	t0 := time.Unix(1.8e9, 0)
	setClock(t, t0)
	s := New()
	e, _ := s.Set("10.0.0.1:80", true, 100)
	if e.Version != uint64(t0.UnixMilli()) {
		t.Fatalf("version %d is not from the clock", e.Version)
	}
	again := New() // the restarted process, a millisecond later
	setClock(t, t0.Add(time.Millisecond))
	u, _ := again.Set("10.0.0.1:80", false, 100)
	if !u.newer(e) {
		t.Fatalf("after the restart %d does not outrank %d", u.Version, e.Version)
	}
}

func TestSubscribe(t *testing.T) {
	s := New()
	var got []string
	cancel := s.Subscribe(func(c Change) { got = append(got, fmt.Sprintf("%s %v %v", c.Addr, c.Local, c.Was.Drained)) })
	s.Set("10.0.0.1:80", true, 100)
	s.Merge(Entry{Addr: "10.0.0.2:80", WeightPercent: 40, Version: 9, Origin: "b"})
	s.Merge(Entry{Addr: "10.0.0.2:80", WeightPercent: 40, Version: 9, Origin: "b"}) // not newer
	s.Set("10.0.0.1:80", false, 100)
	cancel()
	cancel()
	s.Set("10.0.0.3:80", true, 100)
	if want := "[10.0.0.1:80 true false 10.0.0.2:80 false false 10.0.0.1:80 true true]"; fmt.Sprint(got) != want {
		t.Fatalf("hooks saw %v; want %v", got, want)
	}
}

func TestAttach(t *testing.T) {
	s := New()
	if s.Propagated() || s.Origin() != "" {
		t.Fatal("propagated before attach")
	}
	d1 := s.Attach("edge-1")
	d2 := s.Attach("edge-1")
	d1()
	d1()
	if !s.Propagated() {
		t.Fatal("one detach twice detached both")
	}
	d2()
	if s.Propagated() {
		t.Fatal("still propagated")
	}
	e, _ := s.Set("10.0.0.1:80", true, 100)
	if e.Origin != "edge-1" {
		t.Fatalf("origin %q", e.Origin)
	}
}

func TestLookupDoesNotAllocate(t *testing.T) {
	s := New()
	s.Set("10.0.0.1:80", true, 100)
	if n := testing.AllocsPerRun(100, func() { s.Lookup("10.0.0.2:80") }); n != 0 {
		t.Fatalf("%v allocations", n)
	}
}

var testKey = bytes.Repeat([]byte{7}, KeySize)

func TestWireRoundTrip(t *testing.T) {
	in := []Entry{
		{Addr: "10.0.0.1:80", Drained: true, WeightPercent: 100, Version: 3, Origin: "edge-1"},
		{Addr: "[::1]:8080", WeightPercent: 25, Version: 1 << 40},
		{Addr: "b.example.com:443", WeightPercent: 100, Version: 7, Origin: strings.Repeat("n", 128)},
	}
	msg, n := Encode(in, testKey, MaxMessage)
	if n != 3 {
		t.Fatalf("encoded %d", n)
	}
	out, bad, err := Decode(msg, testKey)
	if err != nil || bad != 0 || len(out) != 3 {
		t.Fatalf("decode: %v bad=%d n=%d", err, bad, len(out))
	}
	for i := range in {
		if out[i] != in[i] {
			t.Errorf("entry %d: %+v; want %+v", i, out[i], in[i])
		}
	}
	// a limit keeps the message within it
	msg, n = Encode(in, testKey, 4+EntrySize(in[0])+EntrySize(in[1]))
	if n != 2 {
		t.Fatalf("encoded %d within the limit; want 2", n)
	}
	if out, _, _ := Decode(msg, testKey); len(out) != 2 {
		t.Fatalf("decoded %d", len(out))
	}
}

func TestWireRefusesForgery(t *testing.T) {
	in := []Entry{
		{Addr: "10.0.0.1:80", Drained: true, WeightPercent: 100, Version: 3, Origin: "edge-1"},
		{Addr: "10.0.0.2:80", Drained: true, WeightPercent: 100, Version: 3, Origin: "edge-1"},
	}
	msg, _ := Encode(in, testKey, MaxMessage)
	// the wrong key: every entry refused
	other := bytes.Repeat([]byte{8}, KeySize)
	if out, bad, err := Decode(msg, other); err != nil || bad != 2 || len(out) != 0 {
		t.Fatalf("wrong key: %v bad=%d kept=%d", err, bad, len(out))
	}
	// a changed field breaks its entry's signature only
	tampered := bytes.Clone(msg)
	i := bytes.Index(tampered, []byte("10.0.0.2"))
	tampered[i+7] = '3'
	out, bad, err := Decode(tampered, testKey)
	if err != nil || bad != 1 || len(out) != 1 || out[0].Addr != "10.0.0.1:80" {
		t.Fatalf("tampered: %v bad=%d %+v", err, bad, out)
	}
	// an entry out of bounds, even signed, is refused
	signed, _ := Encode([]Entry{{Addr: "nope", WeightPercent: 100, Version: 1}}, testKey, MaxMessage)
	if out, bad, _ := Decode(signed, testKey); bad != 1 || len(out) != 0 {
		t.Fatalf("signed out of bounds: bad=%d kept=%d", bad, len(out))
	}
	// malformed messages
	for name, m := range map[string][]byte{
		"empty":     nil,
		"magic":     append([]byte{'x'}, msg[1:]...),
		"truncated": msg[:len(msg)-1],
		"trailer":   append(bytes.Clone(msg), 0),
		"count":     append([]byte{'d', 1, 0, 3}, msg[4:]...),
		"too long":  make([]byte, MaxMessage+1),
	} {
		if out, _, err := Decode(m, testKey); err == nil || out != nil {
			t.Errorf("%s: decoded %d entries, err %v", name, len(out), err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	msg, _ := Encode([]Entry{
		{Addr: "10.0.0.1:80", Drained: true, WeightPercent: 100, Version: 3, Origin: "edge-1"},
		{Addr: "[::1]:8080", WeightPercent: 25, Version: 9},
	}, testKey, MaxMessage)
	f.Add(msg)
	f.Add([]byte{'d', 1, 0, 0})
	f.Add([]byte{'d', 1, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		out, bad, err := Decode(b, testKey)
		if err != nil {
			if out != nil || bad != 0 {
				t.Fatal("a refused message returned entries")
			}
			return
		}
		for _, e := range out {
			if e.check() != nil {
				t.Fatalf("decoded an entry out of bounds: %+v", e)
			}
		}
		// what decodes re-encodes to a message that decodes the same
		again, n := Encode(out, testKey, MaxMessage)
		if n != len(out) {
			t.Fatalf("re-encoded %d of %d", n, len(out))
		}
		back, _, err := Decode(again, testKey)
		if err != nil || len(back) != len(out) {
			t.Fatalf("round trip: %v", err)
		}
		s := New()
		for _, e := range out {
			s.Merge(e)
		}
	})
}
