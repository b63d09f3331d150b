package loadmodel

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/orca"
)

// get sends one load request to b and returns its load report header.
func get(t *testing.T, client *http.Client, b *Backend) string {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, b.URL(), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(PhaseHeader, PhaseMeasure.String())
	resp, err := client.Do(req)
	if err != nil {
		t.Error(err)
		return ""
	}
	resp.Body.Close()
	return resp.Header.Get(LoadReportHeader)
}

// appUtil parses a report as lbx does and returns its
// application_utilization.
func appUtil(t *testing.T, header string) float64 {
	t.Helper()
	r, err := orca.Parse(header)
	if err != nil {
		t.Fatalf("lbx's parser refuses the report %q: %v", header, err)
	}
	if !r.Has(orca.Application) || !r.Has(orca.RPS) || !r.Has(orca.EPS) {
		t.Fatalf("report %q lacks application_utilization, rps_fractional or eps", header)
	}
	return r.Application
}

// TestLoadReportHeader checks that a backend sends its load report only
// while reports are on, in a form lbx parses, and that the utilization it
// reports is its queue: requests in the system, the one answered
// included, per worker.
func TestLoadReportHeader(t *testing.T) {
	b, err := StartBackend(Model{Name: "r", Workers: 1, Service: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := NewClient(5 * time.Second)
	defer client.CloseIdleConnections()

	if h := get(t, client, b); h != "" {
		t.Fatalf("reports are off, but the response carries %q", h)
	}
	b.SetLoadReports(true)
	if !b.LoadReports() {
		t.Fatal("LoadReports() is false after SetLoadReports(true)")
	}
	if u := appUtil(t, get(t, client, b)); u != 1 {
		t.Errorf("an idle 1-worker backend reported utilization %v, want 1 (the request answered)", u)
	}

	// Hold the only worker, queue three requests behind it, and let them
	// through: they are answered one at a time and report 3, 2 and 1.
	b.slots <- struct{}{}
	const n = 3
	got := make(chan float64, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if h := get(t, client, b); h != "" {
				got <- appUtil(t, h)
			}
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for b.InSystem() < n {
		select {
		case <-ctx.Done():
			<-b.slots
			t.Fatalf("only %d of %d requests queued", b.InSystem(), n)
		case <-time.After(time.Millisecond):
		}
	}
	<-b.slots
	wg.Wait()
	close(got)
	want := float64(n)
	for u := range got {
		if u != want {
			t.Errorf("reported utilization %v, want %v (the queue as each was answered)", u, want)
		}
		want--
	}
	if want != 0 {
		t.Errorf("%v reports missing", want)
	}

	b.SetLoadReports(false)
	if h := get(t, client, b); h != "" {
		t.Errorf("reports turned off, but the response carries %q", h)
	}

	// Per worker: one request on a 4-worker backend is a quarter.
	b4, err := StartBackend(Model{Name: "r4", Workers: 4, Service: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b4.Close()
	b4.SetLoadReports(true)
	if u := appUtil(t, get(t, client, b4)); u != 0.25 {
		t.Errorf("one request on 4 workers reported utilization %v, want 0.25", u)
	}
}

// TestRateWindow checks the per-second counts the reports carry.
func TestRateWindow(t *testing.T) {
	var r rateWindow
	t0 := time.Unix(1000, 0)
	r.note(t0.Add(100*time.Millisecond), false)
	r.note(t0.Add(200*time.Millisecond), true)
	r.note(t0.Add(900*time.Millisecond), false)
	if a, f := r.last(t0.Add(950 * time.Millisecond)); a != 0 || f != 0 {
		t.Errorf("within the first second: %d answers, %d failures in the last whole second, want 0, 0", a, f)
	}
	r.note(t0.Add(1500*time.Millisecond), false)
	if a, f := r.last(t0.Add(1600 * time.Millisecond)); a != 3 || f != 1 {
		t.Errorf("in the next second: %d answers, %d failures, want 3, 1", a, f)
	}
	if a, _ := r.last(t0.Add(2100 * time.Millisecond)); a != 1 {
		t.Errorf("two seconds on: %d answers, want 1", a)
	}
	if a, _ := r.last(t0.Add(10 * time.Second)); a != 0 {
		t.Errorf("after a silence: %d answers, want 0", a)
	}
	if a, _ := r.last(t0.Add(5 * time.Second)); a != 0 {
		t.Errorf("a clock that stepped back: %d answers, want 0", a)
	}
}

func TestFormatLoadReport(t *testing.T) {
	if got, want := FormatLoadReport(2.5, 120, 3), "TEXT application_utilization=2.5, rps_fractional=120, eps=3"; got != want {
		t.Errorf("FormatLoadReport = %q, want %q", got, want)
	}
}

// TestAntagonistSchedule checks that the schedule is a pure function of
// the seed, within its bounds, and alternates bursts and pauses.
func TestAntagonistSchedule(t *testing.T) {
	a := Antagonist{URL: "http://127.0.0.1:1/", Rate: 100,
		OnMin: time.Second, OnMax: 2 * time.Second, OffMin: time.Second, OffMax: 3 * time.Second, Seed: 7}
	const horizon = time.Minute
	s := a.Schedule(horizon)
	if len(s) < int(horizon/(a.OnMax+a.OffMax)) || len(s) > int(horizon/a.OnMin)+1 {
		t.Fatalf("%d bursts in %v, outside the bounds", len(s), horizon)
	}
	if s[0].Start > a.OffMax {
		t.Errorf("first burst at %v, after the longest pause %v", s[0].Start, a.OffMax)
	}
	for i, b := range s {
		if l := b.End - b.Start; (l < a.OnMin && b.End != horizon) || l > a.OnMax {
			t.Errorf("burst %d lasts %v, outside [%v, %v]", i, l, a.OnMin, a.OnMax)
		}
		if b.End > horizon {
			t.Errorf("burst %d ends at %v, past the horizon", i, b.End)
		}
		if i > 0 {
			if gap := b.Start - s[i-1].End; gap < a.OffMin || gap > a.OffMax {
				t.Errorf("pause before burst %d lasts %v, outside [%v, %v]", i, gap, a.OffMin, a.OffMax)
			}
		}
	}
	again := a.Schedule(horizon)
	if len(again) != len(s) {
		t.Fatal("the same seed gave a different schedule")
	}
	for i := range s {
		if s[i] != again[i] {
			t.Fatal("the same seed gave a different schedule")
		}
	}
	other := a
	other.Seed = 8
	if o := other.Schedule(horizon); len(o) == len(s) && o[0] == s[0] && o[1] == s[1] {
		t.Error("another seed gave the same schedule")
	}
	fixed := Antagonist{URL: a.URL, Rate: 1, OnMin: 5 * time.Second, OnMax: 5 * time.Second, OffMin: 5 * time.Second, OffMax: 5 * time.Second}
	if on := OnTime(fixed.Schedule(time.Minute)); on < 25*time.Second || on > 35*time.Second {
		t.Errorf("5 s on, 5 s off for a minute: on for %v, want about half", on)
	}
	for _, bad := range []Antagonist{
		{URL: a.URL, Rate: 0, OnMin: 1, OnMax: 1},
		{URL: a.URL, Rate: 1, OnMin: 0, OnMax: 1},
		{URL: a.URL, Rate: 1, OnMin: 2, OnMax: 1},
		{URL: a.URL, Rate: 1, OnMin: 1, OnMax: 1, OffMin: -1},
		{Rate: 1, OnMin: 1, OnMax: 1},
	} {
		if bad.Validate() == nil {
			t.Errorf("%+v validates", bad)
		}
		if bad.Schedule(time.Minute) != nil {
			t.Errorf("%+v has a schedule", bad)
		}
	}
}

// TestAntagonistRun runs a short antagonist against a backend and checks
// that it sent only during its bursts, at its rate, counted apart from the
// proxied load.
func TestAntagonistRun(t *testing.T) {
	b, err := StartBackend(Model{Name: "n", Workers: 4, Service: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a := Antagonist{URL: b.URL(), Rate: 200, OnMin: 100 * time.Millisecond, OnMax: 200 * time.Millisecond,
		OffMin: 100 * time.Millisecond, OffMax: 200 * time.Millisecond, Seed: 3}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := a.Run(ctx, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	on := OnTime(res.Bursts)
	want := int(a.Rate * on.Seconds())
	if res.Sent < want-len(res.Bursts) || res.Sent > want+len(res.Bursts) {
		t.Errorf("sent %d in %v of bursts at %v/s, want about %d", res.Sent, on, a.Rate, want)
	}
	if res.OK+res.Errors != res.Sent || res.Errors != 0 {
		t.Errorf("result %+v, want every request answered", res)
	}
	if c := b.Counters(PhaseOther); c.Arrivals != int64(res.Sent) {
		t.Errorf("backend counted %d antagonist arrivals, want %d", c.Arrivals, res.Sent)
	}
	if c := b.Counters(PhaseMeasure); c.Arrivals != 0 {
		t.Errorf("antagonist traffic counted as measured load: %+v", c)
	}
	if b.BusyTime() < time.Duration(res.Sent)*time.Millisecond {
		t.Errorf("busy %v for %d requests of 1 ms", b.BusyTime(), res.Sent)
	}
}

// TestLoadReportPath checks the probe endpoint: answered at once, without
// a worker, with the report while reports are on, counted apart from the
// load.
func TestLoadReportPath(t *testing.T) {
	b, err := StartBackend(Model{Name: "p", Workers: 2, Service: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := NewClient(5 * time.Second)
	defer client.CloseIdleConnections()
	probe := func() string {
		t.Helper()
		resp, err := client.Get("http://" + b.Addr() + LoadReportPath)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("probe: status %d", resp.StatusCode)
		}
		return resp.Header.Get(LoadReportHeader)
	}
	if h := probe(); h != "" {
		t.Errorf("reports off, but the probe's answer carries %q", h)
	}
	b.SetLoadReports(true)
	// Both workers held: a probe does not wait for one. No request is in
	// the system, so it reports 0.
	b.slots <- struct{}{}
	b.slots <- struct{}{}
	defer func() { <-b.slots; <-b.slots }()
	if u := appUtil(t, probe()); u != 0 {
		t.Errorf("probe of an empty system reported %v, want 0", u)
	}
	if n := b.LoadProbes(); n != 2 {
		t.Errorf("%d probes counted, want 2", n)
	}
	for p := range numPhases {
		if c := b.Counters(p); c.Arrivals != 0 {
			t.Errorf("a probe counted as load in phase %v: %+v", p, c)
		}
	}
}

// TestReportBehind checks the other count: the requests an answer leaves
// behind.
func TestReportBehind(t *testing.T) {
	b, err := StartBackend(Model{Name: "rb", Workers: 1, Service: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	client := NewClient(5 * time.Second)
	defer client.CloseIdleConnections()
	b.SetLoadReports(true)
	b.SetReportBehind(true)
	if u := appUtil(t, get(t, client, b)); u != 0 {
		t.Errorf("an idle backend reported %v behind its answer, want 0", u)
	}
	b.SetReportBehind(false)
	if u := appUtil(t, get(t, client, b)); u != 1 {
		t.Errorf("an idle 1-worker backend reported %v with its answer, want 1", u)
	}
}
