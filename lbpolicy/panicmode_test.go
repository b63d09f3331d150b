package lbpolicy

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/internal/events"
	"github.com/caddy-lbx/lbx/lbxtest"
)

func TestPanicDecisionAroundThreshold(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	fifty := 50.0
	m := newPanicMode(&fifty, "test", zap.New(core), events.Emitter{})
	var st panicState
	steps := []struct {
		avail, total int
		want         bool
	}{
		{4, 4, false},
		{2, 4, false}, // exactly at the threshold: not panic
		{1, 4, true},  // one below: panic
		{0, 4, true},  // all down
		{1, 4, true},  // still panicking: no new transition
		{3, 4, false}, // recovered
		{0, 1, true},  // one-host pool, host down
		{1, 1, false},
		{5, 10, false},
		{4, 10, true},
	}
	for i, s := range steps {
		if got := m.decide(&st, s.avail, s.total); got != s.want {
			t.Fatalf("step %d: %d/%d available: panic=%v, want %v", i, s.avail, s.total, got, s.want)
		}
	}
	if got := st.entered.Load(); got != 3 {
		t.Fatalf("entered panic %d times, want 3", got)
	}
	entered := logs.FilterMessageSnippet("entered panic").Len()
	left := logs.FilterMessageSnippet("left panic").Len()
	if entered != 3 || left != 2 {
		t.Fatalf("want one log line per transition (3 in, 2 out), got %d in, %d out", entered, left)
	}
}

func TestPanicDisabledAndHundredPercent(t *testing.T) {
	zero, hundred := 0.0, 100.0
	off := newPanicMode(&zero, "t", zap.NewNop(), events.Emitter{})
	if off.threshold != 0 {
		t.Fatal("0% must disable panic mode")
	}
	all := newPanicMode(&hundred, "t", zap.NewNop(), events.Emitter{})
	var st panicState
	if !all.decide(&st, 3, 4) || all.decide(&st, 4, 4) {
		t.Fatal("at 100%, any unavailable upstream means panic, none means not")
	}
	def := newPanicMode(nil, "t", zap.NewNop(), events.Emitter{})
	if def.percent() != defaultPanicThreshold {
		t.Fatalf("default threshold %v, want %v", def.percent(), defaultPanicThreshold)
	}
}

func TestPanicTransitionsEmitEvents(t *testing.T) {
	ctx, rec := lbxtest.SubscribeEvents(t, eventPanicEntered, eventPanicLeft)
	m := newPanicMode(nil, "ewma", zap.NewNop(), events.New(ctx))
	var st panicState
	m.decide(&st, 1, 4)
	m.decide(&st, 0, 4) // still in panic: no event
	m.decide(&st, 4, 4)
	evs := rec.Events()
	if len(evs) != 2 {
		t.Fatalf("want 2 events (entered, left), got %d", len(evs))
	}
	in, out := evs[0], evs[1]
	if in.Name() != eventPanicEntered || in.Data["available"] != 1 || in.Data["upstreams"] != 4 || in.Data["policy"] != "ewma" {
		t.Fatalf("entered event: %s %v", in.Name(), in.Data)
	}
	if out.Name() != eventPanicLeft || out.Data["available"] != 4 {
		t.Fatalf("left event: %s %v", out.Name(), out.Data)
	}
}
