package partition

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// chooseCase builds a layout of n upstreams for BenchmarkChoose.
// "unusable": 3 live replicas make a scheme of 3 partitions (one replica
// each); the other n-3 fill a scheme of 4 partitions and are all ejected,
// as when a large list points at hosts that are down, so that scheme has
// capacity 0. "live": all n replicas serve the one partition of a scheme
// of 1 and are all usable.
func chooseCase(tb testing.TB, kind string, n int) (*layout, *hoststate.Table) {
	tb.Helper()
	hosts := hoststate.NewTable(hoststate.Config{})
	entries := make([]Entry, 0, n)
	switch kind {
	case "unusable":
		for i := range 3 {
			entries = append(entries, Entry{Dial: fmt.Sprintf("127.0.0.1:%d", 20000+i), Tag: Tag{Index: i, Count: 3}})
		}
		for i := range n - 3 {
			entries = append(entries, Entry{Dial: fmt.Sprintf("10.%d.%d.%d:80", i>>16, (i>>8)&255, i&255), Tag: Tag{Index: i % 4, Count: 4}})
		}
	case "live":
		for i := range n {
			entries = append(entries, Entry{Dial: fmt.Sprintf("10.%d.%d.%d:80", i>>16, (i>>8)&255, i&255), Tag: Tag{Index: 0, Count: 1}})
		}
	}
	l, err := buildLayout(entries, nil, hosts)
	if err != nil {
		tb.Fatal(err)
	}
	if kind == "unusable" {
		now := monoclock.Now()
		for _, r := range l.byAddr {
			if r.hostport[:3] == "10." {
				r.stats.Eject(now, 0, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures)
			}
		}
		if l.audited.Load() != nil {
			// As the background audit would within capRefresh.
			l.audited.Store(l.takeAudit(monoclock.Now()))
		}
	}
	return l, hosts
}

// chooseOnce does what ServeHTTP and the upstream source do for one
// request before anything is sent: choose a scheme, then hand
// reverse_proxy the candidate upstreams of each of its partitions (what
// the selection policy then scans). It returns how many candidates were
// handed out.
func chooseOnce(tb testing.TB, l *layout, intn func(int) int, req *http.Request, st *subState) int {
	sc := l.choose(intn, monoclock.Now())
	if sc == nil {
		tb.Fatal("no scheme has capacity")
	}
	handed := 0
	for i := range sc.parts {
		*st = subState{replicas: sc.parts[i], sample: sc.sample(i), skipEjected: true}
		ups, err := source{}.GetUpstreams(req)
		if err != nil || len(ups) == 0 {
			tb.Fatalf("partition %d: %d upstreams, %v", i, len(ups), err)
		}
		handed += len(ups)
	}
	return handed
}

// BenchmarkChoose measures the per-request cost of choosing where a
// request goes, by the number of upstreams in the list: a scheme by
// capacity, and each partition's candidates for the selection policy
// (see chooseOnce and chooseCase). ns/op should not grow with the list.
// candidates/op is how many upstreams reverse_proxy's policy is then
// given to scan.
//
//	go test ./partition -run '^$' -bench Choose -benchtime=2000x
func BenchmarkChoose(b *testing.B) {
	for _, kind := range []string{"unusable", "live"} {
		for _, n := range []int{3, 1000, 50000, 200000} {
			b.Run(fmt.Sprintf("%s/replicas=%d", kind, n), func(b *testing.B) {
				l, hosts := chooseCase(b, kind, n)
				defer hosts.Release()
				st := &subState{}
				req, _ := http.NewRequestWithContext(context.WithValue(context.Background(), subStateKey{}, st), http.MethodGet, "/", nil)
				x := 0
				intn := func(k int) int { x++; return x % k }
				handed := 0
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					handed += chooseOnce(b, l, intn, req, st)
				}
				b.ReportMetric(float64(handed)/float64(b.N), "candidates/op")
			})
		}
	}
}
