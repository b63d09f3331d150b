package hoststate

import (
	"errors"
	"fmt"
	"math"
	"testing"
	"time"
	"unsafe"

	"github.com/caddy-lbx/lbx/internal/orca"
)

func TestLoadReport(t *testing.T) {
	s := NewStats("10.0.0.1:80")
	if s.LoadReport() != nil {
		t.Fatal("a new upstream has a report")
	}
	header := "TEXT cpu_utilization=0.4, rps_fractional=12, named_metrics.queue=3"
	r, err := orca.Parse(header)
	if err != nil {
		t.Fatal(err)
	}
	s.SetLoadReport(r, 1000, time.Second)
	got := s.LoadReport()
	if got == nil || got.CPU != 0.4 || !got.Has(orca.CPU|orca.RPS) || got.Has(orca.Mem) || got.Named["queue"] != 3 {
		t.Fatalf("report = %+v", got)
	}
	if u, ok := got.Utilization(); !ok || u != 0.4 {
		t.Fatalf("utilization = %v, %v", u, ok)
	}
	// the kept key must not point into the header
	for k := range got.Named {
		p, lo, hi := uintptr(unsafe.Pointer(unsafe.StringData(k))), uintptr(unsafe.Pointer(unsafe.StringData(header))), uintptr(unsafe.Pointer(unsafe.StringData(header)))+uintptr(len(header))
		if p >= lo && p < hi {
			t.Fatalf("key %q shares the header's memory", k)
		}
	}
	if got.Stale(1000+int64(time.Second)) || !got.Stale(1001+int64(time.Second)) {
		t.Fatal("stale at the wrong time")
	}
	if a := got.Age(1000 + int64(time.Millisecond)); a != time.Millisecond {
		t.Fatalf("age = %v", a)
	}

	// refused reports are counted by kind and leave the good one in place
	for _, h := range []string{"garbage", "TEXT cpu_utilization=NaN"} {
		_, err := orca.Parse(h)
		if err == nil {
			t.Fatalf("%q parsed", h)
		}
		s.RefuseLoadReport(err)
	}
	n, kind := s.LoadReportsRefused()
	if n != 2 || !errors.Is(kind, orca.ErrValue) || kind != orca.ErrValue {
		t.Fatalf("refused = %d, %v", n, kind)
	}
	if s.LoadReport() != got {
		t.Fatal("a refused report replaced the good one")
	}
	snap := s.Snapshot(2000)
	if snap.LoadReport != got || snap.ReportsRefused != 2 || snap.ReportError != orca.ErrValue {
		t.Fatalf("snapshot = %+v", snap)
	}
}

func TestReportedShare(t *testing.T) {
	for _, c := range []struct {
		load, mean, pull, want float64
	}{
		{0.3, 0.3, 1, 1},           // at the mean: untouched
		{0.1, 0.45, 1, 1},          // below the mean: never raised
		{0.9, 0.45, 1, 0.1 / 0.55}, // headroom 0.1 against 0.55
		{1, 0.5, 1, MinReportedShare},
		{1, 1, 1, 1},                           // all saturated: alike
		{0.9, 0.45, 0.5, 1 - 0.5*(1-0.1/0.55)}, // half faded
		{1, 0.5, 0, 1},                         // faded out
	} {
		if got := ReportedShare(c.load, c.mean, c.pull); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("ReportedShare(%v, %v, %v) = %v, want %v", c.load, c.mean, c.pull, got, c.want)
		}
	}
}

func TestReportedLoad(t *testing.T) {
	report := func(s *Stats, header string, at int64) {
		t.Helper()
		r, err := orca.Parse(header)
		if err != nil {
			t.Fatal(err)
		}
		s.SetLoadReport(r, at, time.Second)
	}
	const at = int64(1e9)
	a, b, c := NewStats("a:1"), NewStats("b:1"), NewStats("c:1")
	report(a, "TEXT application_utilization=0.2, cpu_utilization=0.9", at) // application wins
	report(b, "TEXT cpu_utilization=0.5, rps_fractional=100, eps=20", at)  // + error share 0.2
	report(c, "TEXT rps_fractional=100, named_metrics.queue=3", at)        // no utilization
	for _, x := range []struct {
		s    *Stats
		load float64
		ok   bool
	}{{a, 0.2, true}, {b, 0.7, true}, {c, 0, false}} {
		load, pull, ok := x.s.ReportedLoad(at)
		if ok != x.ok || math.Abs(load-x.load) > 1e-12 || (ok && pull != 1) {
			t.Errorf("%s: load %v, pull %v, %v; want %v, 1, %v", x.s.Dial(), load, pull, ok, x.load, x.ok)
		}
	}
	if _, pull, _ := a.ReportedLoad(at + int64(time.Second)/4); math.Abs(pull-0.75) > 1e-12 {
		t.Errorf("pull a quarter of max_age later = %v, want 0.75", pull)
	}
	if _, _, ok := a.ReportedLoad(at + int64(time.Second)); ok {
		t.Error("a report at its max_age still counts")
	}
	members := []*Stats{a, b, c, NewStats("d:1")}
	mean, ok := MeanReportedLoad(at, len(members), func(i int) *Stats { return members[i] })
	if !ok || math.Abs(mean-0.45) > 1e-12 {
		t.Errorf("mean = %v, %v; want 0.45 over the two that report", mean, ok)
	}
	if _, ok := MeanReportedLoad(at, 1, func(int) *Stats { return a }); ok {
		t.Error("a report alone has a mean to be weighed against")
	}
	if got := c.ReportedShare(at, 0.45); got != 1 {
		t.Errorf("a report without utilization takes share: %v", got)
	}
	if got, want := b.ReportedShare(at, 0.45), 0.3/0.55; math.Abs(got-want) > 1e-12 {
		t.Errorf("share of b = %v, want %v", got, want)
	}
}

// FuzzReportedShare: whatever reports say (any utilization, error rate
// and age a parsed report can hold, against any mean), the share stays
// within [MinReportedShare, 1]: a report never takes an upstream out and
// never raises one above its share without reports.
func FuzzReportedShare(f *testing.F) {
	f.Add(0.3, 0.0, 0.0, 0.45, 0.0)
	f.Add(100.0, 1e9, 1e9, 0.0, 0.5)
	f.Add(0.0, 0.0, 0.0, 1.0, 1.0)
	f.Fuzz(func(t *testing.T, util, rps, eps, mean, ageFrac float64) {
		header := fmt.Sprintf("TEXT application_utilization=%g, rps_fractional=%g, eps=%g", util, rps, eps)
		r, err := orca.Parse(header)
		if err != nil {
			return // the parser's bounds refused it: nothing reaches selection
		}
		s := NewStats("fuzz:1")
		s.SetLoadReport(r, 1, time.Second)
		if math.IsNaN(ageFrac) || math.IsInf(ageFrac, 0) {
			ageFrac = 0
		}
		now := 1 + int64(math.Mod(math.Abs(ageFrac), 2)*float64(time.Second))
		load, _, ok := s.ReportedLoad(now)
		if ok && (load < 0 || load > 1) {
			t.Fatalf("%s: load %v outside [0, 1]", header, load)
		}
		// the mean is of loads, so within [0, 1]
		m := math.Mod(math.Abs(mean), 1)
		if math.IsNaN(m) {
			m = 0
		}
		if got := s.ReportedShare(now, m); !(got >= MinReportedShare && got <= 1) {
			t.Fatalf("%s at mean %v: share %v outside [%v, 1]", header, m, got, MinReportedShare)
		}
	})
}
