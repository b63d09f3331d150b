package hoststate

import (
	"math"
	"testing"
)

// TestRecentPicks: picks count at once, fade out linearly over the bucket
// after theirs, and are gone two buckets on; a turn keeps the bucket
// boundaries where they were.
func TestRecentPicks(t *testing.T) {
	s := NewTable(Config{}).Stats("picks:80")
	const t0 = int64(1e12)
	for range 10 {
		s.CountPick(t0)
	}
	check := func(at int64, want float64) {
		t.Helper()
		if got := s.RecentPicks(at); math.Abs(got-want) > 1e-9 {
			t.Errorf("RecentPicks at t0%+.2f buckets = %v, want %v", float64(at-t0)/float64(pickBucket), got, want)
		}
	}
	check(t0, 10)
	check(t0+pickBucket/2, 10)
	check(t0+pickBucket*3/2, 5)
	check(t0+2*pickBucket, 0)
	at := t0 + pickBucket*6/5
	s.CountPick(at)
	check(at, 1+10*0.8)
	check(t0+2*pickBucket, 1) // the 10 faded out, the one is current
	s.ForgetPicks()
	check(at, 0)
	s.CountPick(t0 + 5*pickBucket) // long idle: nothing old carries over
	check(t0+5*pickBucket, 1)
}
