package hoststate

import (
	"math"
	"testing"
	"time"
)

const ms = float64(time.Millisecond)

func TestNextEstimatePeakReplaces(t *testing.T) {
	got := nextEstimate(2*ms, 50*ms, 0, 10e9)
	if got != 50*ms {
		t.Fatalf("a slower sample must replace the estimate: got %v", got/ms)
	}
}

func TestNextEstimateFirstSample(t *testing.T) {
	if got := nextEstimate(0, 3*ms, 0, 10e9); got != 3*ms {
		t.Fatalf("first sample must become the estimate: got %v", got/ms)
	}
}

func TestNextEstimateFasterSampleBlends(t *testing.T) {
	tau := 10e9
	// 1 s after the last update a faster sample moves the estimate by
	// 1-exp(-0.1) ≈ 9.5% of the difference (more than minBlend).
	got := nextEstimate(100*ms, 0, 1e9, tau)
	want := 100 * ms * math.Exp(-0.1)
	if math.Abs(got-want) > 1 {
		t.Fatalf("got %v ms, want %v ms", got/ms, want/ms)
	}
	// Back-to-back samples (dt=0) still carry the minimum weight.
	if got, want := nextEstimate(100*ms, 1*ms, 0, tau), 100*ms-99*ms/16; math.Abs(got-want) > 1 {
		t.Fatalf("dt=0: got %v ms, want %v ms", got/ms, want/ms)
	}
	// A long gap lets the new sample dominate.
	if got := nextEstimate(100*ms, 1*ms, 100e9, tau); math.Abs(got-1*ms) > 0.01*ms {
		t.Fatalf("after 10 tau the sample must dominate, got %v", got/ms)
	}
}

func TestDecayTowardTarget(t *testing.T) {
	tau := 10e9
	if got := decayToward(80*ms, 2*ms, 0); got != 80*ms {
		t.Fatalf("no time passed, no decay: %v", got/ms)
	}
	half := decayToward(82*ms, 2*ms, math.Ln2)
	if math.Abs(half-42*ms) > 0.001*ms {
		t.Fatalf("one half-life must halve the distance to target: %v", half/ms)
	}
	far := decayToward(82*ms, 2*ms, 20)
	if math.Abs(far-2*ms) > 0.001*ms {
		t.Fatalf("long idle must reach the target: %v", far/ms)
	}
	// Decay never overshoots below the target (so an idle host never
	// becomes a magnet).
	for _, dt := range []float64{1e6, 1e9, 1e10, 1e12} {
		if got := decayToward(82*ms, 2*ms, dt/tau); got < 2*ms {
			t.Fatalf("overshoot at dt=%v: %v", dt, got/ms)
		}
	}
	// A fast host regresses up to the pool's typical latency, not beyond.
	if got := decayToward(1*ms, 2*ms, 20); math.Abs(got-2*ms) > 0.001*ms {
		t.Fatalf("fast idle host must regress to target: %v", got/ms)
	}
}

func TestFailureSample(t *testing.T) {
	cap := 10e9
	// fast failure: charged twice the estimate
	if got := failureSample(0.1*ms, 3*ms, cap); got != 6*ms {
		t.Fatalf("fast failure: got %v ms, want 6", got/ms)
	}
	// slow failure (a timeout): charged what it really took
	if got := failureSample(5000*ms, 3*ms, cap); got != 5000*ms {
		t.Fatalf("slow failure: got %v ms", got/ms)
	}
	// penalty capped
	if got := failureSample(1*ms, 8e9, cap); got != cap {
		t.Fatalf("penalty must be capped: got %v", got)
	}
	// repeated fast failures grow the estimate geometrically
	est := 2 * ms
	for range 5 {
		est = nextEstimate(est, failureSample(0.05*ms, est, cap), 0, 10e9)
	}
	if est != 64*ms {
		t.Fatalf("five fast failures from 2ms: got %v ms, want 64", est/ms)
	}
}

func TestExpNeg(t *testing.T) {
	for _, x := range []float64{0, 1e-9, 1e-4, 0.01, 1.0 / 64, 0.0157, 0.1, 0.5, 0.6931, 0.6932, 1, 1.4, 5, 50, 300, 699, 701, 1e6} {
		got, want := expNeg(x), math.Exp(-x)
		if x < 1.0/64 && math.Abs(got-want) > 1e-6 {
			t.Fatalf("expNeg(%v) = %v, want %v", x, got, want)
		}
		if math.Abs(got-want) > 5e-6*want+1e-300 {
			t.Fatalf("expNeg(%v) = %v, want %v (relative error %v)", x, got, want, (got-want)/want)
		}
	}
	// dense sweep for the relative error bound
	for x := 1.0 / 64; x < 60; x += 0.0137 {
		if got, want := expNeg(x), math.Exp(-x); math.Abs(got-want) > 5e-6*want {
			t.Fatalf("expNeg(%v) = %v, want %v", x, got, want)
		}
	}
}

func TestSpikeIsForgottenAfterNormalAnswers(t *testing.T) {
	// A 2ms upstream answering every 3ms has one 80ms answer (a stall).
	tau, est := 10e9, 2*ms
	est = nextEstimate(est, 80*ms, 3e6, tau)
	if est != 80*ms {
		t.Fatalf("the spike must be taken at once, got %v", est/ms)
	}
	n := 0
	for est > 3*ms {
		est = nextEstimate(est, 2*ms, 3e6, tau)
		n++
		if n > 1000 {
			t.Fatalf("estimate still %v ms after 1000 normal answers", est/ms)
		}
	}
	// (15/16)^n · 78 < 1 → n ≈ 68
	if n > 80 {
		t.Fatalf("took %d normal answers to forget one spike", n)
	}
}
