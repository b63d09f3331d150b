package lbpolicy

import (
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/orca"
)

// reportLoad stores a load report of utilization u for u's upstream,
// received age ago.
func reportLoad(t *testing.T, s *LeastTimeSelection, up *reverseproxy.Upstream, u float64, age time.Duration) {
	t.Helper()
	r, err := orca.Parse("TEXT application_utilization=" + strconv.FormatFloat(u, 'g', -1, 64))
	if err != nil {
		t.Fatal(err)
	}
	s.table.Stats(up.Dial).SetLoadReport(r, monoclock.Now()-int64(age), 3*time.Second)
}

// TestLeastTimeLoadReportsShapeShares checks that a fresh report past
// capacity takes an upstream out of an idle pool's choices, and that
// reports below capacity, stale reports and no reports change nothing.
// Latency and in-flight are equal, so without reports each of the four
// draws a quarter.
func TestLeastTimeLoadReportsShapeShares(t *testing.T) {
	const picks = 8000
	for _, c := range []struct {
		name     string
		loads    []float64 // per upstream, <0: no report
		age      time.Duration
		hot      float64 // expected share of pool[3]
		tolerate float64
	}{
		{"none", []float64{-1, -1, -1, -1}, 0, 0.25, 0.04},
		{"past capacity", []float64{0.5, 0.5, 0.5, 3}, 0, 0, 0.005},
		{"below capacity", []float64{0.2, 0.2, 0.2, 0.95}, 0, 0.25, 0.04},
		{"alone", []float64{-1, -1, -1, 3}, 0, 0, 0.005},
		{"stale", []float64{0.5, 0.5, 0.5, 3}, 4 * time.Second, 0.25, 0.04},
	} {
		for _, choices := range []Choices{choicesAuto, 2} {
			t.Run(c.name+"/"+choices.String(), func(t *testing.T) {
				s := provisionLeastTime(t, &LeastTimeSelection{Choices: choices})
				pool := newPool(t, 4)
				for i, u := range pool {
					observe(s, u, 2*time.Millisecond, hoststate.Success)
					if c.loads[i] >= 0 {
						reportLoad(t, s, u, c.loads[i], c.age)
					}
				}
				got := float64(shares(s, pool, picks)[pool[3]]) / picks
				if math.Abs(got-c.hot) > c.tolerate {
					t.Fatalf("share of pool[3] = %.3f, want %.3f ± %.3f", got, c.hot, c.tolerate)
				}
			})
		}
	}
}

// TestLeastTimeLoadReportsNeverRefuse: a report prices, it does not take
// an upstream out; when the one usable upstream is the busy one, it is
// chosen every time.
func TestLeastTimeLoadReportsNeverRefuse(t *testing.T) {
	for _, choices := range []Choices{choicesAll, 2} {
		s := provisionLeastTime(t, &LeastTimeSelection{Choices: choices, PanicThreshold: new(float64)})
		pool := newPool(t, 3)
		for i, u := range pool {
			observe(s, u, time.Millisecond, hoststate.Success)
			reportLoad(t, s, u, []float64{0.1, 0.1, 30}[i], 0)
		}
		for _, u := range pool[:2] {
			s.table.Stats(u.Dial).Eject(monoclock.Now(), time.Minute, func(int64) time.Duration { return time.Minute }, hoststate.ReasonSuccessRate)
		}
		for i := range 1000 {
			if u := s.Select(pool, nil, nil); u != pool[2] {
				t.Fatalf("choices %v: selection %d chose %v, want the busy upstream, the only one usable", choices, i, u)
			}
		}
	}
}

// TestLeastTimeLoadReportsFlipping: an upstream whose report flips between
// idle and 30 times past capacity on every answer gets at most its share
// without reports (a report never lowers a price), and every selection
// still chooses.
func TestLeastTimeLoadReportsFlipping(t *testing.T) {
	const picks = 8000
	s := provisionLeastTime(t, &LeastTimeSelection{})
	pool := newPool(t, 4)
	for _, u := range pool {
		observe(s, u, 2*time.Millisecond, hoststate.Success)
	}
	n := 0
	for i := range picks {
		reportLoad(t, s, pool[3], []float64{0.01, 30}[i%2], 0)
		u := s.Select(pool, nil, nil)
		if u == nil {
			t.Fatalf("selection %d chose nothing", i)
		}
		if u == pool[3] {
			n++
		}
	}
	// half the time it is priced out, half the time it is one of four
	if got := float64(n) / picks; got > 0.125+0.03 || got < 0.125-0.03 {
		t.Fatalf("flipping upstream's share %.3f, want about 0.125 (a quarter of the half it is not priced out)", got)
	}
}
