package latdist

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// Every latency falls in a bucket whose edges hold it, and buckets are
// at most one eighth of a doubling wide.
func TestBuckets(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 100_000 {
		ns := int64(r.ExpFloat64() * float64(time.Duration(r.IntN(1000)+1)*time.Millisecond))
		i := index(ns)
		if ns > upper(i) || (i > 0 && ns < upper(i-1)) {
			t.Fatalf("%d ns in bucket %d, (%d, %d]", ns, i, upper(i-1), upper(i))
		}
		if i > 0 && i < numBuckets-1 && float64(upper(i)-upper(i-1)) > float64(upper(i-1))/subBuckets+1 {
			t.Fatalf("bucket %d is (%d, %d]: wider than 1/%d", i, upper(i-1), upper(i), subBuckets)
		}
	}
	if index(-1) != 0 || index(0) != 0 || index(1<<62) != numBuckets-1 {
		t.Fatal("edges: negative, zero or huge latencies outside the first or last bucket")
	}
}

// Quantiles read from the histogram are within a bucket (12.5%) above the
// exact ones, and never below, for a long-tailed distribution.
func TestQuantileNearExact(t *testing.T) {
	d := New(time.Hour)
	r := rand.New(rand.NewPCG(3, 4))
	var all []int64
	for range 20_000 {
		// 2 ms typical, one in twenty frozen for 20-60 ms
		ns := int64(time.Millisecond) + int64(r.ExpFloat64()*float64(time.Millisecond))
		if r.IntN(20) == 0 {
			ns += int64(20*time.Millisecond) + r.Int64N(int64(40*time.Millisecond))
		}
		all = append(all, ns)
		d.Observe(1, ns)
	}
	slices.Sort(all)
	for _, q := range []float64{0.5, 0.9, 0.95, 0.99} {
		exact := all[int(q*float64(len(all)))-1]
		got, n := d.Quantile(1, q)
		if n != uint64(len(all)) {
			t.Fatalf("read from %d answers; want %d", n, len(all))
		}
		if got < exact || float64(got) > float64(exact)*1.125 {
			t.Errorf("p%v: %v; exact %v", q*100, time.Duration(got), time.Duration(exact))
		}
	}
}

// Old answers are forgotten: a reading covers the current window and the
// one before, and after two idle periods nothing.
func TestWindowsForget(t *testing.T) {
	const p = int64(time.Second)
	d := New(time.Second)
	for range 100 {
		d.Observe(1, int64(50*time.Millisecond))
	}
	for range 100 {
		d.Observe(p+2, int64(time.Millisecond))
	}
	if got, n := d.Quantile(p+3, 0.99); n != 200 || got < int64(50*time.Millisecond) {
		t.Fatalf("both windows: p99 %v of %d; want the slow answers still counted (200)", time.Duration(got), n)
	}
	if got, n := d.Quantile(2*p+3, 0.99); n != 100 || got > int64(2*time.Millisecond) {
		t.Fatalf("a period later: p99 %v of %d; want only the fast answers (100)", time.Duration(got), n)
	}
	if _, n := d.Quantile(5*p, 0.99); n != 0 {
		t.Fatalf("after idle periods: %d answers; want none", n)
	}
}

func BenchmarkObserve(b *testing.B) {
	d := New(time.Second)
	b.RunParallel(func(pb *testing.PB) {
		ns := int64(0)
		for pb.Next() {
			ns += 997
			d.Observe(1, ns%int64(10*time.Millisecond))
		}
	})
}
