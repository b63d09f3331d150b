package pickrate

import (
	"math"
	"testing"
)

// TestRecent: choices count at once, fade out linearly over the bucket
// after theirs, and are gone two buckets on; a turn keeps the bucket
// boundaries where they were.
func TestRecent(t *testing.T) {
	var c Counter
	const t0 = int64(1e12)
	for range 10 {
		c.Count(t0)
	}
	check := func(at int64, want float64) {
		t.Helper()
		if got := c.Recent(at); math.Abs(got-want) > 1e-9 {
			t.Errorf("Recent at t0%+.2f buckets = %v, want %v", float64(at-t0)/float64(Bucket), got, want)
		}
	}
	check(t0, 10)
	check(t0+Bucket/2, 10)
	check(t0+Bucket*3/2, 5)
	check(t0+2*Bucket, 0)
	at := t0 + Bucket*6/5
	c.Count(at)
	check(at, 1+10*0.8)
	check(t0+2*Bucket, 1) // the 10 faded out, the one is current
	c.Forget()
	check(at, 0)
	c.Count(t0 + 5*Bucket) // long idle: nothing old carries over
	check(t0+5*Bucket, 1)
}

// TestHeldTo: at factor 0.5 against 10 a member is held from 6 on.
func TestHeldTo(t *testing.T) {
	if HeldTo(0.5, 5.9, 10) || !HeldTo(0.5, 6, 10) {
		t.Fatal("HeldTo(0.5, ·, 10) does not hold from 6")
	}
	if HeldTo(0.1, 0, 0) || !HeldTo(0.1, 1, 0) {
		t.Fatal("at no traffic one choice must pass and the second be held")
	}
}
