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

func TestReportedFactor(t *testing.T) {
	const at = int64(1e9)
	for _, c := range []struct {
		header string
		age    time.Duration
		want   float64
	}{
		{"TEXT application_utilization=0.95", 0, 1},                      // below capacity: nothing
		{"TEXT application_utilization=3", 0, 3},                         // 3× past capacity
		{"TEXT application_utilization=3", time.Second / 4, 1 + 0.75*2},  // faded a quarter
		{"TEXT application_utilization=3", time.Second, 1},               // faded out
		{"TEXT application_utilization=0.2, cpu_utilization=4", 0, 1},    // application wins
		{"TEXT cpu_utilization=2", 0, 2},                                 // else cpu
		{"TEXT cpu_utilization=0.9, rps_fractional=100, eps=50", 0, 1.4}, // + error share
		{"TEXT application_utilization=100", 0, MaxReportedLoad},         // capped
		{"TEXT rps_fractional=100, named_metrics.queue=300", 0, 1},       // no utilization
	} {
		r, err := orca.Parse(c.header)
		if err != nil {
			t.Fatal(err)
		}
		s := NewStats("a:1")
		s.SetLoadReport(r, at, time.Second)
		if got := s.ReportedFactor(at + int64(c.age)); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%s, %v old: factor %v, want %v", c.header, c.age, got, c.want)
		}
	}
	if got := NewStats("b:1").ReportedFactor(at); got != 1 {
		t.Errorf("no report: factor %v", got)
	}
}

// TestJudgeReportedFactor: the factor multiplies what Judge expects, also
// of a rested host, whose own answers are too old to count.
func TestJudgeReportedFactor(t *testing.T) {
	table := NewTable(Config{Horizon: time.Second})
	t.Cleanup(table.Release)
	s := table.Stats(t.Name() + ":1")
	now := int64(10 * time.Second)
	r, err := orca.Parse("TEXT application_utilization=4")
	if err != nil {
		t.Fatal(err)
	}
	s.SetLoadReport(r, now, 3*time.Second)
	if got, _ := table.Judge(s, now, 2e6); got != 8e6 {
		t.Fatalf("rested host reporting 4: expected %v ns, want 8e6 (the pool's 2e6 × 4)", got)
	}
}

// FuzzReportedFactor: whatever a parsed report says (any utilization and
// error rate within the parser's bounds) and however old it is, the factor
// stays within [1, MaxReportedLoad]: a report never makes an upstream look
// faster, and never prices it beyond the cap.
func FuzzReportedFactor(f *testing.F) {
	f.Add(0.3, 0.0, 0.0, 0.0)
	f.Add(100.0, 1e9, 1e9, 0.5)
	f.Add(3.0, 1.0, 1e9, 1.0)
	f.Fuzz(func(t *testing.T, util, rps, eps, ageFrac float64) {
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
		if got := s.ReportedFactor(now); !(got >= 1 && got <= MaxReportedLoad) {
			t.Fatalf("%s: factor %v outside [1, %v]", header, got, MaxReportedLoad)
		}
	})
}
