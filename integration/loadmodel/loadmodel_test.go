package loadmodel

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"
)

func TestFreezeSchedule(t *testing.T) {
	f := Freeze{Every: 2 * time.Second, Min: 50 * time.Millisecond, Max: 100 * time.Millisecond, Seed: 7}
	for k := range int64(200) {
		start, end := f.Window(k)
		if l := end - start; l < f.Min || l > f.Max {
			t.Fatalf("window %d: length %v outside [%v, %v]", k, l, f.Min, f.Max)
		}
		if start < time.Duration(k)*f.Every || end > time.Duration(k+1)*f.Every {
			t.Fatalf("window %d = [%v, %v) leaves its period", k, start, end)
		}
		if s2, e2 := f.Window(k); s2 != start || e2 != end {
			t.Fatalf("window %d is not deterministic", k)
		}
		if got := f.Thaw(start); got != end {
			t.Errorf("Thaw(start of window %d) = %v, want %v", k, got, end)
		}
		if got := f.Thaw(end - 1); got != end {
			t.Errorf("Thaw(end-1 of window %d) = %v, want %v", k, got, end)
		}
		if got := f.Thaw(end); got != end {
			t.Errorf("Thaw(end of window %d) = %v, want itself", k, got)
		}
		if start > time.Duration(k)*f.Every {
			if got := f.Thaw(start - 1); got != start-1 {
				t.Errorf("Thaw(before window %d) = %v, want itself", k, got)
			}
		}
	}
	if other := (Freeze{Every: f.Every, Min: f.Min, Max: f.Max, Seed: 8}); other.Frozen(time.Minute) == f.Frozen(time.Minute) {
		t.Error("different seeds gave the same schedule")
	}
	if fr := f.Frozen(time.Minute); fr < 30*f.Min || fr > 30*f.Max {
		t.Errorf("frozen %v in a minute of 2s periods, want between %v and %v", fr, 30*f.Min, 30*f.Max)
	}
	var none Freeze
	if none.Thaw(time.Second) != time.Second || none.Frozen(time.Hour) != 0 {
		t.Error("the zero Freeze stalls")
	}
}

func TestQuantile(t *testing.T) {
	s := make([]time.Duration, 1000)
	for i := range s {
		s[i] = time.Duration(i + 1)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500}, {0.99, 990}, {0.999, 999}, {1, 1000}, {0.0001, 1}} {
		if got := Quantile(s, c.q); got != c.want {
			t.Errorf("Quantile(1..1000, %v) = %v, want %v", c.q, got, c.want)
		}
	}
	if Quantile(nil, 0.5) != 0 {
		t.Error("Quantile of no samples is not 0")
	}
	if got := Quantile([]time.Duration{3}, 0.99); got != 3 {
		t.Errorf("Quantile of one sample = %v", got)
	}
}

// TestBackendQueues checks that a backend serves at most Workers requests
// at once and that the rest queue.
func TestBackendQueues(t *testing.T) {
	b, err := StartBackend(Model{Name: "q", Workers: 2, Service: 30 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := NewClient(2 * time.Second)
	defer client.CloseIdleConnections()

	const n = 6
	start := time.Now()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, b.URL(), nil)
			req.Header.Set(PhaseHeader, PhaseMeasure.String())
			resp, err := client.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			if got := resp.Header.Get(BackendHeader); got != "q" {
				t.Errorf("backend header %q, want q", got)
			}
		})
	}
	wg.Wait()
	// Six requests, two at a time, 30 ms each: at least three rounds.
	if el := time.Since(start); el < 90*time.Millisecond {
		t.Errorf("6 requests on 2 workers of 30ms took %v, want ≥ 90ms", el)
	}
	c := b.Counters(PhaseMeasure)
	if c.Arrivals != n || c.Served != n {
		t.Errorf("counters %+v, want %d arrivals and served", c, n)
	}
	if c.MaxInSystem < 3 {
		t.Errorf("max in system %d, want a queue to have formed", c.MaxInSystem)
	}
	if c.MeanService < 30*time.Millisecond {
		t.Errorf("mean service %v, want ≥ 30ms", c.MeanService)
	}
}

// TestLoadOpenLoop runs a short load against a backend that stalls, and
// checks that requests kept being sent during the stall and were charged
// for it.
func TestLoadOpenLoop(t *testing.T) {
	b, err := StartBackend(Model{
		Name: "s", Workers: 4, Service: time.Millisecond,
		// One stall of exactly 200 ms in each 400 ms period.
		Freeze: Freeze{Every: 400 * time.Millisecond, Min: 200 * time.Millisecond, Max: 200 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	measured := false
	l := Load{
		URL: b.URL(), Rate: 200, Warmup: 100 * time.Millisecond, Duration: 800 * time.Millisecond,
		Timeout:   time.Second,
		OnMeasure: func() { measured = true },
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b.SetEpoch(time.Now())
	res, err := l.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !measured {
		t.Error("OnMeasure was not called")
	}
	s := Summarize(res)
	if s.Requests != 160 {
		t.Errorf("%d measured requests, want 160", s.Requests)
	}
	if s.Errors != 0 {
		t.Errorf("%d errors", s.Errors)
	}
	if s.ByBackend["s"] != s.OK {
		t.Errorf("by backend %v, want all %d from s", s.ByBackend, s.OK)
	}
	// Half the time is frozen: requests sent then wait up to 200 ms, and
	// the open loop keeps sending them, so well over 1% are delayed by more
	// than 50 ms.
	if s.P99 < 50*time.Millisecond {
		t.Errorf("p99 %v, want the stalls to show (≥ 50ms)", s.P99)
	}
	if s.P50 > 150*time.Millisecond {
		t.Errorf("p50 %v, want most requests to be fast", s.P50)
	}
	if got := b.Counters(PhaseMeasure).Arrivals; got != 160 {
		t.Errorf("backend counted %d measured arrivals, want 160", got)
	}
	if got := b.Counters(PhaseWarmup).Arrivals; got != 20 {
		t.Errorf("backend counted %d warm-up arrivals, want 20", got)
	}
}

func TestLoadTimeout(t *testing.T) {
	b, err := StartBackend(Model{Name: "slow", Workers: 1, Service: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	l := Load{URL: b.URL(), Rate: 20, Duration: 500 * time.Millisecond, Timeout: 100 * time.Millisecond}
	res, err := l.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	s := Summarize(res)
	if s.Timeouts != s.Requests || s.Errors != s.Requests {
		t.Errorf("summary %+v, want every request to time out", s)
	}
	if s.P50 < 100*time.Millisecond {
		t.Errorf("p50 %v, want timeouts counted at their full duration", s.P50)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := b.WaitIdle(ctx); err != nil {
		t.Error(err)
	}
}
