package hoststate

import (
	"math"
	"testing"
	"time"
)

// feed records n attempts at exact virtual times, every 1/rate apart from
// *now, failing one in every `every` (0: none), and advances *now.
func feed(tb *Table, s *Stats, now *int64, n, every int, gap time.Duration) {
	for i := range n {
		*now += int64(gap)
		start := *now - int64(time.Millisecond)
		s.BeginAt(start)
		o := Success
		if every > 0 && i%every == every-1 {
			o = Failure
		}
		tb.ObserveAt(s, start, *now, o)
	}
}

// TestFailureRatioFollowsRecentAttempts: the ratio reads the share of
// recent attempts that failed (20% failing reads about 0.2), and once the
// host stops failing it falls back towards 0 within a few decay times,
// by successes and by time alone. Without the counting in observe it
// stays 0 throughout.
func TestFailureRatioFollowsRecentAttempts(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	s := tb.Stats(t.Name())
	now := int64(time.Hour)
	if r := s.FailureRatio(now); r != 0 {
		t.Fatalf("a new host's failure ratio is %v; want 0", r)
	}
	feed(tb, s, &now, 2000, 5, time.Millisecond) // 2 s at 1000/s, 20% failing
	if r := s.FailureRatio(now); math.Abs(r-0.2) > 0.03 {
		t.Fatalf("failure ratio after 20%% failures is %.3f; want 0.2 ± 0.03", r)
	}
	if got := s.Snapshot(now).FailureRatio; got != s.FailureRatio(now) {
		t.Fatalf("Snapshot.FailureRatio = %v, FailureRatio = %v", got, s.FailureRatio(now))
	}
	healed := now
	feed(tb, s, &now, 5*int(failureDecay/time.Millisecond), 0, time.Millisecond)
	if r := s.FailureRatio(now); r > 0.2*math.Exp(-4) {
		t.Fatalf("failure ratio %v after 5 decay times of successes; want below %.4f", r, 0.2*math.Exp(-4))
	}
	// nobody tries it: the ratio fades with time alone
	quiet := s.FailureRatio(healed + int64(10*failureDecay))
	if quiet >= 0.01 {
		t.Fatalf("failure ratio %v after 10 quiet decay times; want below 0.01", quiet)
	}
	// one failure of a host that answered nothing recently is not a ratio of 1
	s2 := tb.Stats(t.Name() + "-2")
	now2 := int64(time.Hour)
	feed(tb, s2, &now2, 1, 1, time.Millisecond)
	if r := s2.FailureRatio(now2); r > 0.5+1e-9 {
		t.Fatalf("one failure alone reads as ratio %v; want at most 0.5", r)
	}
}

// TestAnswerMedianSurvivesEjection: the issue's "an ejected upstream
// reports a latency of 0". Ejection forgets the estimate (the host
// returns as new), but AnswerMedian keeps the speed it last answered
// at, and SelectionLatency reads +Inf while it is ejected. Without
// answerNs, AnswerMedian would be 0 here.
func TestAnswerMedianSurvivesEjection(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	s := tb.Stats(t.Name())
	now := int64(time.Hour)
	if snap := s.Snapshot(now); snap.AnswerMedian != 0 {
		t.Fatalf("never answered, AnswerMedian = %v; want 0", snap.AnswerMedian)
	}
	for range 9 {
		now += int64(time.Millisecond)
		start := now - int64(30*time.Millisecond)
		s.BeginAt(start)
		tb.ObserveAt(s, start, now, Success)
	}
	if snap := s.Snapshot(now); snap.AnswerMedian != 30*time.Millisecond || snap.Estimate != 30*time.Millisecond {
		t.Fatalf("AnswerMedian %v, Estimate %v; want both 30ms", snap.AnswerMedian, snap.Estimate)
	}
	if l := tb.SelectionLatency(s, now); l < float64(30*time.Millisecond) || math.IsInf(l, 1) {
		t.Fatalf("SelectionLatency of a healthy 30ms host = %v", l)
	}
	// fast failures, then ejection
	for range 5 {
		now += int64(time.Millisecond)
		s.BeginAt(now - 1000)
		tb.ObserveAt(s, now-1000, now, Failure)
	}
	if _, _, ok := s.Eject(now, time.Minute, func(int64) time.Duration { return 30 * time.Second }, ReasonConsecutiveFailures); !ok {
		t.Fatal("Eject refused")
	}
	snap := s.Snapshot(now + 1)
	if snap.Estimate != 0 {
		t.Fatalf("Estimate after ejection = %v; the estimate is expected to be forgotten", snap.Estimate)
	}
	if snap.AnswerMedian != 30*time.Millisecond {
		t.Fatalf("AnswerMedian of an ejected host = %v; want the 30ms it answered at", snap.AnswerMedian)
	}
	if snap.FailureRatio < 0.3 {
		t.Fatalf("FailureRatio after 5 failures in 14 attempts = %v; want about 0.33", snap.FailureRatio)
	}
	if l := tb.SelectionLatency(s, now+1); !math.IsInf(l, 1) {
		t.Fatalf("SelectionLatency of an ejected host = %v; want +Inf", l)
	}
	if l := tb.SelectionLatency(s, now+int64(31*time.Second)); math.IsInf(l, 1) || l <= 0 {
		t.Fatalf("SelectionLatency after the ejection ended = %v; want finite", l)
	}
}

// TestShareCap: a host failing 10% of its attempts is over its share once
// it has taken more than 0.9 × 0.9 of the attempts per unit of weight of the
// busiest host that is not failing, and not below that; a weight of 3
// triples what it may take; when every host fails there is no reference
// and nobody is capped; a rested host is never capped. Without the cap
// (OverShare always false) the first check fails.
func TestShareCap(t *testing.T) {
	tb := NewTable(Config{})
	defer tb.Release()
	now := int64(time.Hour)
	// record counts n attempts at now (so nothing decays), one in
	// every `every` failing (0: none)
	record := func(s *Stats, n, every int) {
		for i := range n {
			o := Success
			if every > 0 && i%every == every-1 {
				o = Failure
			}
			s.BeginAt(now)
			tb.ObserveAt(s, now, now, o)
		}
	}
	healthy, slow, flaky := tb.Stats(t.Name()+"-a"), tb.Stats(t.Name()+"-b"), tb.Stats(t.Name()+"-c")
	record(healthy, 1000, 0)
	record(slow, 100, 0)
	record(flaky, 1000, 10)
	ref := func(inv ...float64) func() float64 {
		return func() float64 {
			hosts := []*Stats{healthy, slow, flaky}
			return ShareReference(now, 3, func(i int) (*Stats, float64) { return hosts[i], inv[i] })
		}
	}
	if r := flaky.FailureRatio(now); math.Abs(r-0.1) > 0.001 {
		t.Fatalf("flaky's failure ratio %.4f; want 0.1 (100 of 1000)", r)
	}
	if r := ref(1, 1, 1)(); math.Abs(r-1000) > 1e-6 {
		t.Fatalf("share reference %v; want 1000, the healthy host's attempts", r)
	}
	if !tb.OverShare(flaky, now, 1, ref(1, 1, 1)) {
		t.Errorf("flaky (1000 attempts, 10%% failing) is not over its share of a healthy host's 1000 × 0.81")
	}
	if tb.OverShare(flaky, now, 1.0/3, ref(1, 1, 1.0/3)) {
		t.Errorf("flaky of weight 3 (333 attempts per unit) is over its share of 1000 × 0.81")
	}
	// half failing: held to 0.9 × 0.5 = 0.45 of the reference, so 400
	// attempts are within its share and 500 are not
	half := tb.Stats(t.Name() + "-d")
	record(half, 400, 2)
	if tb.OverShare(half, now, 1, ref(1, 1, 1)) {
		t.Errorf("a host failing half of 400 attempts is over its share of 1000 × 0.45")
	}
	record(half, 100, 2)
	if !tb.OverShare(half, now, 1, ref(1, 1, 1)) {
		t.Errorf("a host failing half of 500 attempts is within its share of 1000 × 0.45")
	}
	if tb.OverShare(healthy, now, 1, ref(1, 1, 1)) {
		t.Errorf("a host that never failed is over its share")
	}
	if got := tb.QueueCharge(flaky, now, 1, ref(1, 1, 1)); !math.IsInf(got, 1) {
		t.Errorf("QueueCharge of a host over its share = %v; want +Inf", got)
	}
	if got, want := tb.QueueCharge(flaky, now, 1.0/3, ref(1, 1, 1.0/3)), flaky.FailurePrice(now); got != want {
		t.Errorf("QueueCharge of a host within its share = %v; want its price %v", got, want)
	}
	if got := tb.QueueCharge(healthy, now, 1, func() float64 { t.Fatal("reference asked for a healthy host"); return 0 }); got != 1 {
		t.Errorf("QueueCharge of a healthy host = %v; want 1", got)
	}
	// every host failing: no reference, no cap
	record(healthy, 100, 1)
	record(slow, 100, 1)
	if r := ref(1, 1, 1)(); r != 0 {
		t.Errorf("share reference with every host failing = %v; want 0", r)
	}
	if tb.OverShare(flaky, now, 1, ref(1, 1, 1)) {
		t.Errorf("flaky is capped although every host fails")
	}
	// rested: nothing in flight and nothing finished for the horizon
	later := now + int64(time.Minute)
	if tb.OverShare(flaky, later, 1, func() float64 { return 1e-9 }) {
		t.Errorf("a rested host is capped")
	}
}
