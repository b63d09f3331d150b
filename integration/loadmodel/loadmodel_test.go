package loadmodel

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// TestFailModes checks that a failing backend fails every load request at
// once, in the way its mode says, that a reset really reaches the client
// as a transport error, and that its health endpoint still answers 200.
func TestFailModes(t *testing.T) {
	for _, mode := range []FailMode{Fail503, FailReset} {
		t.Run(mode.String(), func(t *testing.T) {
			b, err := StartBackend(Model{Name: "f", Workers: 1, Service: 50 * time.Millisecond, Fail: mode})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			client := NewClient(2 * time.Second)
			defer client.CloseIdleConnections()

			resp, err := client.Get(b.URL() + HealthPath[1:])
			if err != nil {
				t.Fatalf("health check: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("health check answered %d, want 200", resp.StatusCode)
			}
			if b.HealthChecks() != 1 {
				t.Errorf("%d health checks counted, want 1", b.HealthChecks())
			}

			l := Load{URL: b.URL(), Rate: 100, Duration: 300 * time.Millisecond, Timeout: time.Second}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			b.SetEpoch(time.Now())
			res, err := l.Run(ctx)
			if err != nil {
				t.Fatal(err)
			}
			s := Summarize(res)
			if s.Requests != 30 || s.Errors != s.Requests || s.Timeouts != 0 {
				t.Errorf("summary %+v, want all 30 requests to fail, none by timeout", s)
			}
			// Failing at once: well under the 50 ms service time.
			if s.P99 > 40*time.Millisecond {
				t.Errorf("p99 %v, want failures at once", s.P99)
			}
			want := BadStatus
			if mode == FailReset {
				want = Failed
			}
			for i, x := range res.Samples {
				if x.Outcome != want {
					t.Fatalf("request %d: outcome %v, want %v", i, x.Outcome, want)
				}
			}
			c := b.Counters(PhaseMeasure)
			if c.Arrivals != 30 || c.Failed != 30 || c.Served != 0 {
				t.Errorf("counters %+v, want 30 arrivals, all failed", c)
			}
		})
	}
	// A reset is a reset, not an orderly close: the client's error says so.
	b, err := StartBackend(Model{Name: "r", Workers: 1, Fail: FailReset})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	_, err = client.Get(b.URL())
	if err == nil || !strings.Contains(err.Error(), "reset") {
		t.Errorf("request to a resetting backend: error %v, want a connection reset", err)
	}
}

func TestFailModeText(t *testing.T) {
	for _, m := range []FailMode{FailNone, Fail503, FailReset} {
		b, err := m.MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		var back FailMode
		if err := back.UnmarshalText(b); err != nil || back != m {
			t.Errorf("%v round-trips to %v, %v", m, back, err)
		}
	}
	if _, err := ParseFailMode("slow"); err == nil {
		t.Error("ParseFailMode accepted an unknown mode")
	}
	if _, err := FailMode(9).MarshalText(); err == nil {
		t.Error("an invalid mode marshalled")
	}
}

func TestModelValidate(t *testing.T) {
	good := Model{Name: "v", Workers: 1, Service: time.Millisecond,
		Change: Change{At: time.Second, Service: 2 * time.Millisecond}}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, m := range map[string]Model{
		"no name":             {Workers: 1},
		"no workers":          {Name: "v"},
		"jitter":              {Name: "v", Workers: 1, Jitter: 1.5},
		"freeze":              {Name: "v", Workers: 1, Freeze: Freeze{Every: time.Second, Min: 2, Max: 1}},
		"fail mode":           {Name: "v", Workers: 1, Fail: 7},
		"change at negative":  {Name: "v", Workers: 1, Change: Change{At: -1}},
		"change without time": {Name: "v", Workers: 1, Change: Change{Service: time.Millisecond}},
		"change service":      {Name: "v", Workers: 1, Change: Change{At: 1, Service: -1}},
		"change freeze":       {Name: "v", Workers: 1, Change: Change{At: 1, Freeze: Freeze{Every: -1}}},
	} {
		if err := m.Validate(); err == nil {
			t.Errorf("%s: %+v validated", name, m)
		}
	}
}

// TestChange checks that a backend serves by the old model before its
// change and by the new one after it.
func TestChange(t *testing.T) {
	b, err := StartBackend(Model{Name: "c", Workers: 1, Service: 40 * time.Millisecond,
		Change: Change{At: 300 * time.Millisecond, Service: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := NewClient(2 * time.Second)
	defer client.CloseIdleConnections()
	get := func() time.Duration {
		start := time.Now()
		resp, err := client.Get(b.URL())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return time.Since(start)
	}
	epoch := time.Now()
	b.SetEpoch(epoch)
	if d := get(); d < 40*time.Millisecond {
		t.Errorf("before the change: %v, want ≥ 40ms", d)
	}
	time.Sleep(time.Until(epoch.Add(300 * time.Millisecond)))
	for range 5 {
		if d := get(); d > 30*time.Millisecond {
			t.Errorf("after the change: %v, want ≈ 1ms", d)
		}
	}
}

// TestJitterSeeded checks that the service times are a function of the
// seed and of the request's number since the epoch.
func TestJitterSeeded(t *testing.T) {
	draw := func(b *Backend) []time.Duration {
		b.SetEpoch(time.Now())
		out := make([]time.Duration, 50)
		for i := range out {
			out[i] = b.serviceTime(b.model.Service)
		}
		return out
	}
	m := Model{Name: "j", Workers: 1, Service: 4 * time.Millisecond, Jitter: 0.25, Seed: 3}
	a, b, c := &Backend{model: m}, &Backend{model: m}, &Backend{model: m}
	c.model.Seed = 4
	da, db, dc := draw(a), draw(b), draw(c)
	if !slices.Equal(da, db) {
		t.Error("the same seed drew different service times")
	}
	if slices.Equal(da, dc) {
		t.Error("different seeds drew the same service times")
	}
	if !slices.Equal(da, draw(a)) {
		t.Error("SetEpoch did not restart the sequence")
	}
	for _, d := range da {
		if d < 3*time.Millisecond || d > 5*time.Millisecond {
			t.Errorf("service time %v outside 4ms ± 25%%", d)
		}
	}
	if slices.Min(da) == slices.Max(da) {
		t.Error("no jitter")
	}
}

// TestLoadStep checks that a step really changes the rate: the measured
// requests, the samples' due times and the backend's arrival buckets all
// double after it.
func TestLoadStep(t *testing.T) {
	b, err := StartBackend(Model{Name: "s", Workers: 16, Service: 0})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	l := Load{URL: b.URL(), Rate: 100, Duration: time.Second, Timeout: time.Second,
		Steps: []Step{{At: 500 * time.Millisecond, Rate: 200}}}
	if got := l.RateAt(499 * time.Millisecond); got != 100 {
		t.Errorf("RateAt before the step = %v", got)
	}
	if got := l.RateAt(500 * time.Millisecond); got != 200 {
		t.Errorf("RateAt at the step = %v", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b.SetEpoch(time.Now())
	res, err := l.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s := Summarize(res); s.Requests != 150 || s.Errors != 0 {
		t.Fatalf("summary %+v, want 150 requests (50 + 100), no errors", s)
	}
	before, after := Summarize(res.Between(0, 500*time.Millisecond)), Summarize(res.Between(500*time.Millisecond, time.Second))
	if before.Requests != 50 || after.Requests != 100 {
		t.Errorf("%d requests due before the step and %d after, want 50 and 100", before.Requests, after.Requests)
	}
	if after.Throughput < 1.6*before.Throughput {
		t.Errorf("throughput %.0f/s before, %.0f/s after the step, want it doubled", before.Throughput, after.Throughput)
	}
	buckets := b.Arrivals()
	if len(buckets) < 10 {
		t.Fatalf("arrival buckets %v, want 10", buckets)
	}
	var first, second int64
	for i, n := range buckets {
		switch {
		case i < 5:
			first += n
		case i < 10:
			second += n
		}
	}
	if first < 45 || first > 55 || second < 90 || second > 110 {
		t.Errorf("arrivals %d in the first half second and %d in the second (buckets %v), want ≈ 50 and ≈ 100", first, second, buckets)
	}
	b.ResetCounters()
	if got := b.Arrivals(); len(got) != 0 {
		t.Errorf("arrival buckets after reset: %v", got)
	}
	for _, bad := range [][]Step{
		{{At: 0, Rate: 1}},
		{{At: time.Second, Rate: 1}},
		{{At: 100 * time.Millisecond, Rate: 0}},
		{{At: 200 * time.Millisecond, Rate: 1}, {At: 100 * time.Millisecond, Rate: 1}},
	} {
		l.Steps = bad
		if err := l.Validate(); err == nil {
			t.Errorf("steps %v validated", bad)
		}
	}
}

// TestFailRate checks that a partly failing backend fails about FailRate
// of its load requests, the same ones after every SetEpoch, and serves the
// others by the model.
func TestFailRate(t *testing.T) {
	b, err := StartBackend(Model{Name: "p", Workers: 4, Fail: Fail503, FailRate: 0.2, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := NewClient(2 * time.Second)
	defer client.CloseIdleConnections()
	outcomes := func() []bool {
		b.SetEpoch(time.Now())
		var out []bool
		for range 500 {
			req, _ := http.NewRequest(http.MethodGet, b.URL(), nil)
			req.Header.Set(PhaseHeader, PhaseMeasure.String())
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			out = append(out, resp.StatusCode == http.StatusServiceUnavailable)
		}
		return out
	}
	first, second := outcomes(), outcomes()
	failed := 0
	for i, f := range first {
		if f {
			failed++
		}
		if f != second[i] {
			t.Fatalf("request %d failed=%v first, %v after SetEpoch: want the same sequence", i, f, second[i])
		}
	}
	// 500 draws at 0.2: mean 100, sd ≈ 9.
	if failed < 65 || failed > 135 {
		t.Errorf("%d of 500 failed, want ≈100 (FailRate 0.2)", failed)
	}
	for _, m := range []Model{
		{Name: "x", Workers: 1, FailRate: 0.5},
		{Name: "x", Workers: 1, Fail: Fail503, FailRate: 1.5},
		{Name: "x", Workers: 1, Fail: Fail503, FailRate: -0.1},
	} {
		if m.Validate() == nil {
			t.Errorf("model %+v validated, want an error", m)
		}
	}
}

// TestLoadClosedLoop checks that Concurrency keeps exactly that many
// requests in flight at most, and measures only inside the window.
func TestLoadClosedLoop(t *testing.T) {
	b, err := StartBackend(Model{Name: "c", Workers: 16, Service: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	measured := false
	l := Load{URL: b.URL(), Concurrency: 3, Warmup: 50 * time.Millisecond, Duration: 300 * time.Millisecond,
		Timeout: time.Second, OnMeasure: func() { measured = true }}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := l.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !measured {
		t.Error("OnMeasure was not called")
	}
	c := b.Counters(PhaseMeasure)
	if c.MaxInSystem > 3 {
		t.Errorf("the backend held %d requests at once, want at most the 3 clients", c.MaxInSystem)
	}
	// 3 clients × 300 ms ÷ ≥5 ms: at most 180, and at least a few dozen.
	n := len(res.Samples)
	if n < 20 || n > 190 {
		t.Errorf("%d measured requests, want between 20 and 190", n)
	}
	for i, s := range res.Samples {
		if s.Due < 0 || s.Due >= l.Duration || s.Outcome != OK {
			t.Fatalf("sample %d: %+v, want an OK request sent inside the window", i, s)
		}
		if i > 0 && s.Due < res.Samples[i-1].Due {
			t.Fatalf("samples out of order at %d", i)
		}
	}
}

// TestLoadPath checks that Path numbers the requests of a closed loop
// from 0 in the order they are sent, each number once, and sends each to
// its own path.
func TestLoadPath(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.URL.Path]++
		mu.Unlock()
	}))
	defer srv.Close()
	var calls atomic.Int64
	l := Load{URL: srv.URL + "/", Concurrency: 4, Duration: 100 * time.Millisecond, Timeout: time.Second,
		Path: func(n uint64) string { calls.Add(1); return "/k/" + strconv.FormatUint(n, 10) }}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := l.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	n := int(calls.Load())
	if n < 4 || len(res.Samples) != n || len(seen) != n {
		t.Fatalf("%d paths drawn, %d samples, %d distinct paths served: want the same, at least 4", n, len(res.Samples), len(seen))
	}
	for i := range n {
		if c := seen["/k/"+strconv.Itoa(i)]; c != 1 {
			t.Fatalf("/k/%d served %d times, want once (numbers 0 to %d)", i, c, n-1)
		}
	}
}
