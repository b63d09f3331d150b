package hoststate

import (
	"errors"
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
