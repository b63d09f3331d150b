package monoclock

import (
	"testing"
	"time"
)

// TestReadingsShareOneScale: Now, Latest and At read the same clock, in
// order, and At of a time.Now falls between the Now readings around it.
func TestReadingsShareOneScale(t *testing.T) {
	before := Now()
	if got := Latest(); got < before {
		t.Fatalf("Latest() = %d after Now() = %d; want at least that", got, before)
	}
	at := At(time.Now())
	after := Now()
	if at < before || at > after {
		t.Fatalf("At(time.Now()) = %d; want it within [%d, %d]", at, before, after)
	}
	if d := At(time.Now().Add(time.Minute)) - Now(); d < int64(59*time.Second) || d > int64(time.Minute) {
		t.Fatalf("At(a minute from now) - Now() = %v; want about a minute", time.Duration(d))
	}
}

// TestLatestWithoutNow: Latest does not read the clock; it returns what
// the last Now published.
func TestLatestWithoutNow(t *testing.T) {
	n := Now()
	deadline := time.Now().Add(5 * time.Second)
	for At(time.Now()) == n {
		if time.Now().After(deadline) {
			t.Fatal("the clock did not advance in 5s")
		}
	}
	if got := Latest(); got != n {
		t.Fatalf("Latest() = %d; want the last Now reading %d", got, n)
	}
}
