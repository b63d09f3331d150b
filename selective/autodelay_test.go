package selective

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/latdist"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// The auto delay follows the configured quantile of the group's observed
// latencies (within the histogram's 12.5% resolution, never below), uses
// max until 100 answers are in, and stays within min and max.
func TestAutoDelayFollowsQuantile(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	var all []int64
	for range 5000 {
		// ~2 ms answers, 3% of them frozen 20-60 ms
		ns := int64(time.Millisecond) + int64(r.ExpFloat64()*float64(time.Millisecond))
		if r.IntN(100) < 3 {
			ns += int64(20*time.Millisecond) + r.Int64N(int64(40*time.Millisecond))
		}
		all = append(all, ns)
	}
	sorted := slices.Sorted(slices.Values(all))
	exact := func(q float64) time.Duration { return time.Duration(sorted[int(q/100*float64(len(sorted)))-1]) }
	newGroup := func() *group { return &group{state: &groupState{lat: latdist.New(autoWindow)}} }
	now := monoclock.Now()

	for _, tc := range []struct {
		auto   BackupAuto
		lo, hi time.Duration
	}{
		{BackupAuto{}, exact(95), exact(95) * 9 / 8},
		{BackupAuto{Quantile: 99}, exact(99), exact(99) * 9 / 8},
		{BackupAuto{Quantile: 50}, exact(50), exact(50) * 9 / 8},
		{BackupAuto{Quantile: 99, Max: caddy5ms}, 5 * time.Millisecond, 5 * time.Millisecond},
		{BackupAuto{Quantile: 50, Min: caddy5ms}, 5 * time.Millisecond, 5 * time.Millisecond},
	} {
		h := &Handler{BackupRequestAuto: &tc.auto}
		g := newGroup()
		_, hi := tc.auto.bounds()
		for i, ns := range all {
			if i == autoMinSamples-1 {
				if d := h.backupDelay(g, now); d != hi {
					t.Fatalf("%+v: with %d answers the delay is %v; want max, %v", tc.auto, i, d, hi)
				}
				g.autoAt.Store(0) // recompute at once
			}
			g.state.lat.Observe(now, ns)
		}
		if d := h.backupDelay(g, now); d < tc.lo || d > tc.hi {
			t.Errorf("%+v: delay %v; want %v to %v", tc.auto, d, tc.lo, tc.hi)
		}
	}
}

const caddy5ms = 5 * 1_000_000 // a caddy.Duration of 5ms

// Validate refuses out-of-bounds auto settings, and both forms at once,
// naming the value.
func TestAutoDelayValidate(t *testing.T) {
	for _, tc := range []struct {
		json, want string
	}{
		{`"backup_request_auto":{"quantile":49}`, "quantile 49 is outside 50 to 99.9"},
		{`"backup_request_auto":{"quantile":99.95}`, "quantile 99.95 is outside"},
		{`"backup_request_auto":{"min":"500us"}`, "backup_request_auto min 500µs is below the minimum 1ms"},
		{`"backup_request_auto":{"max":"2h"}`, "backup_request_auto max 2h0m0s is above the maximum 1h"},
		{`"backup_request_auto":{"min":"2s"}`, "backup_request_auto min 2s is above max 1s"},
		{`"backup_request_auto":{},"backup_request":"10ms"`, "backup_request and backup_request_auto both given"},
		{`"backup_request_auto":{"quantile":99,"min":"2ms","max":"200ms"}`, ""},
	} {
		var h Handler
		raw := fmt.Sprintf(`{"groups":[{"name":"a","routes":[{"handle":[{"handler":"static_response"}]}]}],%s}`, tc.json)
		if err := h.UnmarshalJSON([]byte(raw)); err != nil {
			t.Fatalf("%s: %v", tc.json, err)
		}
		err := h.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v; want no error", tc.json, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v; want an error containing %q", tc.json, err, tc.want)
		}
	}
}

// End to end: with backup_request auto, a group whose replicas answer at
// once gets a delay at the floor once it has 100 answers, and a call stuck
// at one replica is then answered by the backup well before the default
// max (1s) — it would wait the full second with the max as the delay.
func TestAutoDelayEndToEnd(t *testing.T) {
	e := newEnv(t)
	a, b := e.backend("a"), e.backend("b")
	e.load(fmt.Sprintf(`	selective {
		group only {
			reverse_proxy %s %s {
				lb_policy panic {
					policy first
				}
			}
		}
		backup_request auto min 20ms
		status_header
	}`, a.addr, b.addr))
	if g := e.admin().Handlers[0].Groups[0]; g.BackupDelayMs != 1000 {
		t.Errorf("before any answer the delay is %vms; want max, 1000ms", g.BackupDelayMs)
	}
	for range autoMinSamples + 10 {
		if r := e.get("/"); r.body != "a" {
			t.Fatalf("warm-up: %q; want a", r.body)
		}
	}
	waitFor(t, 5*time.Second, "the delay at the floor", func() (bool, string) {
		d := e.admin().Handlers[0].Groups[0].BackupDelayMs
		return d == 20, fmt.Sprint(d)
	})
	a.delay.Store(int64(2 * time.Second))
	start := time.Now()
	r := e.get("/")
	if r.body != "b" || !strings.Contains(r.header.Get("X-Selective"), "backup=won") || time.Since(start) > 900*time.Millisecond {
		t.Fatalf("stuck call: %q (%s) after %v; want b's answer by a backup sent after about 20ms", r.body, r.header.Get("X-Selective"), time.Since(start))
	}
}
