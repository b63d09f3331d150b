package hoststate

import (
	"testing"
	"time"
)

const ms = int64(time.Millisecond)

func TestWindowMedian(t *testing.T) {
	var w window
	if got := w.median(0); got != 0 {
		t.Fatalf("empty window: %d", got)
	}
	w.add(10, 3*ms)
	if got := w.median(0); got != 3*ms {
		t.Fatalf("one answer is its own median: %d", got)
	}
	w.add(11, 5*ms)
	if got := w.median(0); got != 4*ms {
		t.Fatalf("two answers: the mean of the middle pair, got %d", got)
	}
	w.add(12, 100*ms)
	if got := w.median(0); got != 5*ms {
		t.Fatalf("three answers: %d", got)
	}
}

// steadyWindow returns a window full of 4 ms answers, one every 4 ms, and
// the time of the last.
func steadyWindow() (w window, at int64) {
	for range windowSize {
		at += 4 * ms
		w.add(at, 4*ms)
	}
	return w, at
}

// TestWindowOutvotesAStall: the answers one stall held back arrive together
// after it; a window of normal answers outvotes them.
func TestWindowOutvotesAStall(t *testing.T) {
	w, at := steadyWindow()
	for _, l := range []int64{150, 146, 142, 138, 134, 130, 126} { // a 150 ms stall releases 7 answers
		at += ms / 10
		w.add(at, l*ms)
	}
	if got := w.median(0); got != 4*ms {
		t.Fatalf("seven stalled answers among sixteen moved the median to %v", time.Duration(got))
	}
}

// TestWindowBelievesPersistentSlowness: a host that became ten times slower
// is believed after just over half a window of slow answers.
func TestWindowBelievesPersistentSlowness(t *testing.T) {
	w, at := steadyWindow()
	n := 0
	for w.median(0) < 20*ms {
		at += 40 * ms
		w.add(at, 40*ms)
		if n++; n > windowSize {
			t.Fatal("a full window of slow answers did not move the median")
		}
	}
	if n > windowSize/2+1 {
		t.Fatalf("took %d slow answers to believe the host is slow", n)
	}
}

// TestWindowHorizon: answers older than the horizon do not count, so a host
// answering again after a quiet spell is judged by its new answers alone.
func TestWindowHorizon(t *testing.T) {
	var w window
	for i := range windowSize {
		w.add(int64(i)*ms, 40*ms) // slow, long ago
	}
	w.add(2000*ms, 4*ms) // recovered
	if got := w.median(2000*ms - int64(time.Second)); got != 4*ms {
		t.Fatalf("answers older than the horizon still count: median %v", time.Duration(got))
	}
	if got := w.median(0); got != 40*ms {
		t.Fatalf("without a horizon the old answers outvote the new one: %v", time.Duration(got))
	}
}

func TestFailurePenalty(t *testing.T) {
	for streak, want := range map[int64]float64{-1: 1, 0: 1, 1: 2, 2: 4, 5: 32, 10: 1024, 11: 1024, 1 << 40: 1024} {
		if got := failurePenalty(streak); got != want {
			t.Errorf("failurePenalty(%d) = %v, want %v", streak, got, want)
		}
	}
}

func TestStalledFor(t *testing.T) {
	if got := stalledFor(100, 10, 20, 0); got != 0 {
		t.Fatalf("nothing in flight is no stall: %d", got)
	}
	if got := stalledFor(100, 10, 20, 2); got != 80 {
		t.Fatalf("busy since 20, nothing finished since 10: stalled 80, got %d", got)
	}
	if got := stalledFor(100, 60, 20, 2); got != 40 {
		t.Fatalf("last finished at 60: stalled 40, got %d", got)
	}
	if got := stalledFor(10, 60, 20, 2); got != 0 {
		t.Fatalf("a clock behind the last answer is no stall: %d", got)
	}
}
