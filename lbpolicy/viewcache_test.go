package lbpolicy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// lbxSeries gathers lbx's metrics from a registry of their own and counts
// the caddy_lbx_upstream_* and caddy_lbx_pool_* series that name an
// address holding mark (the package's state is shared by its tests).
func lbxSeries(t *testing.T, mark string) (upstream, pool int) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(collector)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if (l.GetName() == "upstream" || l.GetName() == "upstreams") && strings.Contains(l.GetValue(), mark) {
					if strings.HasPrefix(mf.GetName(), "caddy_lbx_upstream_") {
						upstream++
					} else {
						pool++
					}
					break
				}
			}
		}
	}
	return upstream, pool
}

// upstreamsView returns the dial addresses holding mark in /lbx/upstreams'
// upstreams, and how many of its pools hold one.
func upstreamsView(mark string) (dials []string, pools int) {
	st := buildUpstreamsPage(pageQuery{limit: maxPageLimit})
	for _, u := range st.Upstreams {
		if strings.Contains(u.Dial, mark) {
			dials = append(dials, u.Dial)
		}
	}
	for _, p := range st.Pools {
		if strings.Contains(firstDial(p), mark) {
			pools++
		}
	}
	return dials, pools
}

// TestChurnedUpstreamsReleased: a dynamic pool one of whose members churns
// its port through 150 addresses (a `dynamic serf` member changing its
// port_tag, as in issue 22) grows the upstream series and /lbx/upstreams;
// once the member has left and linger has passed, both are back at their
// baseline, while the members still offered, and an address with a
// request in flight, keep their state. The clock is the policy's own
// reading, passed in: nothing sleeps.
func TestChurnedUpstreamsReleased(t *testing.T) {
	mark := t.Name() + "-"
	s := provisionLeastTime(t, &LeastTimeSelection{})
	linger := int64(s.linger())
	if linger != int64(minLinger) {
		t.Fatalf("linger with the defaults is %v, want %v", time.Duration(linger), minLinger)
	}
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	hosts := map[string]*reverseproxy.Host{}
	up := func(name string) *reverseproxy.Upstream {
		if hosts[name] == nil {
			hosts[name] = new(reverseproxy.Host)
		}
		// a dynamic source hands out fresh Upstream values every time
		return &reverseproxy.Upstream{Host: hosts[name], Dial: mark + name}
	}
	serve := func(names ...string) {
		pool := make(reverseproxy.UpstreamPool, len(names))
		for i, n := range names {
			pool[i] = up(n)
		}
		for range 3 {
			if got := s.Select(pool, req, nil); got == nil {
				t.Fatalf("no upstream selected from %v", names)
			} else {
				observe(s, got, time.Millisecond, hoststate.Success)
			}
		}
	}

	serve("a:80", "b:80")
	baseUp, basePool := lbxSeries(t, mark)
	baseDials, basePools := upstreamsView(mark)
	if baseUp == 0 || basePool == 0 || len(baseDials) != 2 || basePools != 1 {
		t.Fatalf("baseline: %d upstream and %d pool series, /lbx/upstreams %v and %d pools; want some, 2 addresses, 1 pool", baseUp, basePool, baseDials, basePools)
	}

	const churn = 150
	for port := range churn {
		serve("a:80", "b:80", fmt.Sprintf("churn:%d", 10000+port))
	}
	// One of the churned addresses still has a request awaiting headers.
	inFlight := s.table.Stats(mark + "churn:10007")
	start := inFlight.Begin()

	churnedUp, churnedPool := lbxSeries(t, mark)
	churnedDials, _ := upstreamsView(mark)
	t.Logf("after churning %d ports: %d upstream series (baseline %d), %d pool series (baseline %d), %d addresses in /lbx/upstreams",
		churn, churnedUp, baseUp, churnedPool, basePool, len(churnedDials))
	if churnedUp < baseUp+churn || len(churnedDials) < churn {
		t.Fatalf("the churn did not show: %d upstream series, %d addresses", churnedUp, len(churnedDials))
	}

	// The member leaves; traffic goes on to a and b.
	serve("a:80", "b:80")
	if n, _ := s.views.release(monoclock.Now()); n != 0 {
		t.Fatalf("release right after the churn released %d views; want none before linger", n)
	}
	// linger later, a and b are still served.
	later := monoclock.Now() + linger + 1
	v := s.views.last.Load()
	v.usedAt.Store(later)
	for i := range v.members {
		s.table.ObserveAt(v.members[i].stats, later-int64(time.Millisecond), later, hoststate.Success)
	}
	views, dropped := s.views.release(later + 1)
	if views == 0 || dropped < churn-1 {
		t.Fatalf("release after linger: %d views, %d addresses; want the churned ones", views, dropped)
	}

	gotUp, gotPool := lbxSeries(t, mark)
	dials, pools := upstreamsView(mark)
	t.Logf("linger later: %d upstream series, %d pool series, /lbx/upstreams %v and %d pools", gotUp, gotPool, dials, pools)
	wantDials := append(append([]string(nil), baseDials...), mark+"churn:10007")
	if gotPool != basePool || pools != basePools || strings.Join(dials, " ") != strings.Join(wantDials, " ") {
		t.Errorf("after release: %d pool series (baseline %d), /lbx/upstreams %v and %d pools; want %v and %d", gotPool, basePool, dials, pools, wantDials, basePools)
	}
	// Of the churned addresses only the one with a request in flight has
	// series left, a few. (Counted by address, not against the baseline:
	// which of a and b the baseline's three random picks reached, and so
	// which series they had then, varies.)
	churnUp, _ := lbxSeries(t, mark+"churn:")
	inFlightUp, _ := lbxSeries(t, mark+"churn:10007")
	if churnUp != inFlightUp || inFlightUp == 0 || inFlightUp > 10 {
		t.Errorf("after release: %d upstream series of churned addresses, %d of them the in-flight address's; want only its few (1 to 10)", churnUp, inFlightUp)
	}

	// The request finishes, and traffic stops: linger later the address
	// goes too, and so do a and b, dynamic as well and no longer offered.
	s.table.ObserveAt(inFlight, start, later, hoststate.Success)
	if views, dropped := s.views.release(later + linger + 2); views != 1 || dropped != 3 {
		t.Errorf("with nothing offered for linger: released %d views and %d addresses, want 1 and 3 (left: %v)", views, dropped, upstreamsDials(mark))
	}
	if gotUp, gotPool := lbxSeries(t, mark); gotPool != 0 || gotUp != 0 {
		t.Errorf("with nothing offered for linger: %d upstream and %d pool series; want none", gotUp, gotPool)
	}

	// A pool that comes back is served by a fresh view on fresh state.
	serve("a:80", "b:80")
	v = s.views.last.Load()
	for i, u := range v.ups {
		if st, ok := s.table.Lookup(u.Dial); !ok || st != v.members[i].stats {
			t.Errorf("%s: the new view's state is not the table's", u.Dial)
		}
	}
}

func upstreamsDials(mark string) []string { d, _ := upstreamsView(mark); return d }

// TestStaticViewsKept: the views and state of a handler's static upstreams
// are never released, however long they go unused.
func TestStaticViewsKept(t *testing.T) {
	s := &LeastTimeSelection{table: hoststate.NewTable(hoststate.Config{})}
	t.Cleanup(s.table.Release)
	pool := newPool(t, 3)
	h := &reverseproxy.Handler{Upstreams: pool}
	s.views.rel = newReleaser(s.table, h, minLinger)
	s.viewFor(pool)
	v := s.views.last.Load()
	if !v.static {
		t.Fatal("the view of the static upstreams is not marked static")
	}
	if views, dropped := s.views.release(monoclock.Now() + int64(24*time.Hour)); views != 0 || dropped != 0 {
		t.Errorf("a day later: released %d views, %d addresses; want none", views, dropped)
	}
	if s.views.last.Load() != v || s.table.Len() != 3 {
		t.Errorf("the static view or its state went (table holds %d)", s.table.Len())
	}
}

func TestLingerFor(t *testing.T) {
	for _, c := range []struct {
		windows []time.Duration
		want    time.Duration
	}{
		{nil, time.Minute},
		{[]time.Duration{time.Second, 10 * time.Second}, time.Minute},
		{[]time.Duration{10 * time.Second, 45 * time.Second}, 90 * time.Second},
		{[]time.Duration{time.Hour}, 2 * time.Hour},
	} {
		if got := lingerFor(c.windows...); got != c.want {
			t.Errorf("lingerFor(%v) = %v, want %v", c.windows, got, c.want)
		}
	}
	for l, want := range map[time.Duration]time.Duration{time.Minute: 15 * time.Second, 2 * time.Minute: 30 * time.Second, 48 * time.Hour: time.Minute} {
		if got := releaseEvery(l); got != want {
			t.Errorf("releaseEvery(%v) = %v, want %v", l, got, want)
		}
	}
}

// TestReleaserStops: the release loop a policy starts in Provision ends
// with the config's context.
func TestReleaserStops(t *testing.T) {
	const loop = "lbpolicy.(*views).startReleasing"
	// Loops of earlier tests end in the background as their contexts are
	// cancelled: follow this test's own loop by its goroutine's header
	// ("goroutine N [...]"), not by a count.
	ids := func() map[string]bool {
		set := map[string]bool{}
		for _, g := range lbxtest.Goroutines(loop) {
			head, _, _ := strings.Cut(g, " [")
			set[head] = true
		}
		return set
	}
	before := ids()
	s := &LeastTimeSelection{}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := s.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	var mine []string
	for id := range ids() {
		if !before[id] {
			mine = append(mine, id)
		}
	}
	if len(mine) != 1 {
		t.Fatalf("%d new release loops after Provision, want 1", len(mine))
	}
	cancel()
	_ = s.Cleanup()
	lbxtest.WaitFor(t, 5*time.Second, "the release loop to end", func() (bool, string) {
		return !ids()[mine[0]], mine[0] + " still runs"
	})
}

// walkPages reads GET /lbx/upstreams page by page with limit, checking
// that no page is longer than limit in any list, and returns the page
// count, the addresses holding mark in the upstreams, and those of every
// pool whose name holds mark, each in the order the pages gave them.
func walkPages(t *testing.T, limit int, mark string) (pages int, dials []string, members map[string][]string) {
	t.Helper()
	members = map[string][]string{}
	after := ""
	for {
		q := url.Values{"limit": {strconv.Itoa(limit)}}
		if after != "" {
			q.Set("after", after)
		}
		rec := httptest.NewRecorder()
		if err := serveUpstreams(rec, httptest.NewRequest(http.MethodGet, "/lbx/upstreams?"+q.Encode(), nil)); err != nil {
			t.Fatalf("page after %q: %v", after, err)
		}
		var st upstreamsStatus
		if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
			t.Fatal(err)
		}
		pages++
		if len(st.Upstreams) > limit {
			t.Fatalf("page after %q lists %d upstreams; limit %d", after, len(st.Upstreams), limit)
		}
		for _, u := range st.Upstreams {
			if strings.Contains(u.Dial, mark) {
				dials = append(dials, u.Dial)
			}
		}
		for _, p := range st.Pools {
			if len(p.Upstreams) > limit {
				t.Fatalf("page after %q lists %d members of pool %s; limit %d", after, len(p.Upstreams), p.Name, limit)
			}
			if strings.Contains(p.Name, mark) {
				for _, m := range p.Upstreams {
					members[p.Name] = append(members[p.Name], m.Dial)
				}
			}
		}
		if st.NextAfter == "" {
			return pages, dials, members
		}
		if st.NextAfter <= after || pages > 10000 {
			t.Fatalf("next_after %q after %q: the pages do not advance", st.NextAfter, after)
		}
		after = st.NextAfter
	}
}

// TestUpstreamsPaged: GET /lbx/upstreams lists at most limit addresses per
// page, in the upstreams and in each pool, and walking next_after gives
// every address once, the upstreams sorted and each pool's members in
// pool order within a page, with the pool's size and name (short for a
// large pool) on every page. Without paging the first page held all 280
// addresses of the test.
func TestUpstreamsPaged(t *testing.T) {
	mark := t.Name() + "-"
	s := provisionLeastTime(t, &LeastTimeSelection{})
	// A pool of 250 in descending order, so pool order is not dial order,
	// and 30 addresses that only the registry holds.
	const n, extra = 250, 30
	pool := make(reverseproxy.UpstreamPool, n)
	for i := range pool {
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("%sp%03d:80", mark, n-1-i)}
	}
	if s.Select(pool, httptest.NewRequest(http.MethodGet, "/", nil), nil) == nil {
		t.Fatal("nothing selected")
	}
	var want []string
	for i := range n {
		want = append(want, fmt.Sprintf("%sp%03d:80", mark, i))
	}
	for i := range extra {
		d := fmt.Sprintf("%sx%02d:80", mark, i)
		s.table.Stats(d)
		want = append(want, d)
	}
	slices.Sort(want)

	const limit = 7
	pages, dials, members := walkPages(t, limit, mark)
	if strings.Join(dials, " ") != strings.Join(want, " ") {
		t.Errorf("the pages' upstreams holding the mark: %d (%v…); want the %d addresses once each, sorted", len(dials), dials[:min(len(dials), 5)], len(want))
	}
	if len(members) != 1 {
		t.Fatalf("pools named for the mark: %d; want 1 (%v)", len(members), slices.Collect(maps.Keys(members)))
	}
	for name, ms := range members {
		if more := fmt.Sprintf("+%d more #", 250-(poolNameMembers-1)); !strings.Contains(name, more) || len(name) > 64*poolNameMembers {
			t.Errorf("pool name %q; want %d members, %s and a hash", name, poolNameMembers-1, more)
		}
		got := slices.Clone(ms)
		slices.Sort(got)
		if len(ms) != n || slices.Compact(got) == nil || len(slices.Compact(got)) != n {
			t.Errorf("the pool's members over the pages: %d, %d distinct; want %d once each", len(ms), len(slices.Compact(got)), n)
		}
	}
	if pages < (n+extra)/limit {
		t.Errorf("%d pages of %d; want at least %d", pages, limit, (n+extra)/limit)
	}

	// One address, with the pool cut down to it.
	one := fmt.Sprintf("%sp%03d:80", mark, 42)
	rec := httptest.NewRecorder()
	if err := serveUpstreams(rec, httptest.NewRequest(http.MethodGet, "/lbx/upstreams?dial="+url.QueryEscape(one), nil)); err != nil {
		t.Fatal(err)
	}
	var st upstreamsStatus
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Upstreams) != 1 || st.Upstreams[0].Dial != one || st.NextAfter != "" {
		t.Errorf("dial=%s: upstreams %+v, next_after %q; want that one alone", one, st.Upstreams, st.NextAfter)
	}
	for _, p := range st.Pools {
		if strings.Contains(p.Name, mark) && (len(p.Upstreams) != 1 || p.Upstreams[0].Dial != one || p.Total != n) {
			t.Errorf("dial=%s: pool lists %d members of %d; want that one of %d", one, len(p.Upstreams), p.Total, n)
		}
	}
}

// TestUpstreamsQueryRefused: a query GET /lbx/upstreams cannot honour gets
// 400 with a message naming the parameter, not a silent first page.
func TestUpstreamsQueryRefused(t *testing.T) {
	for _, tc := range []struct{ query, want string }{
		{"limit=0", `limit="0"`},
		{"limit=1001", `limit="1001"`},
		{"limit=ten", `limit="ten"`},
		{"limit=5&limit=6", `"limit" given 2 times`},
		{"page=2", `unknown query parameter "page"`},
		{"dial=", "dial is empty"},
		{"dial=a:80&after=b", "takes no after or limit"},
	} {
		err := serveUpstreams(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/lbx/upstreams?"+tc.query, nil))
		var apiErr caddy.APIError
		if !errors.As(err, &apiErr) || apiErr.HTTPStatus != http.StatusBadRequest || !strings.Contains(apiErr.Err.Error(), tc.want) {
			t.Errorf("?%s: %v; want 400 saying %q", tc.query, err, tc.want)
		}
	}
	for _, ok := range []string{"", "limit=1", "limit=1000", "after=zzz", "dial=a:80"} {
		if err := serveUpstreams(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/lbx/upstreams?"+ok, nil)); err != nil {
			t.Errorf("?%s: %v", ok, err)
		}
	}
}

// TestUpstreamsSummary: the summary counts every upstream by state and
// names the worst by what selection expects of them, an ejected one
// (expected_ms null) before a failing one before the slowest, whatever
// page is asked for; the ejected one keeps its answer median.
func TestUpstreamsSummary(t *testing.T) {
	mark := t.Name() + "-"
	table := provisionLeastTime(t, &LeastTimeSelection{}).table
	now := monoclock.Now()
	ejected, failing, slow, fast := table.Stats(mark+"ejected:80"), table.Stats(mark+"failing:80"), table.Stats(mark+"slow:80"), table.Stats(mark+"fast:80")
	table.ObserveAt(slow, now-int64(900*time.Millisecond), now, hoststate.Success)
	table.ObserveAt(fast, now-int64(time.Millisecond), now, hoststate.Success)
	table.ObserveAt(failing, now-int64(time.Millisecond), now, hoststate.Failure)
	table.ObserveAt(ejected, now-int64(3*time.Millisecond), now, hoststate.Success)
	if _, _, ok := ejected.Eject(now, time.Minute, func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("not ejected")
	}
	st := buildUpstreamsPage(pageQuery{limit: 1, after: "\xff"})
	if len(st.Upstreams) != 0 || st.Total < 4 {
		t.Errorf("a page after every address: %d upstreams, total %d; want none of at least 4", len(st.Upstreams), st.Total)
	}
	for state, atLeast := range map[string]int{stateEjected: 1, stateFailing: 1, stateHealthy: 2, stateUnsampled: 0} {
		if st.Summary.States[state] < atLeast {
			t.Errorf("summary counts %d %s; want at least %d (%v)", st.Summary.States[state], state, atLeast, st.Summary.States)
		}
	}
	var order []string
	for _, u := range st.Summary.Worst {
		if d, ok := strings.CutPrefix(u.Dial, mark); ok {
			order = append(order, d)
			if d == "ejected:80" && (u.ExpectedMs != nil || u.AnswerMedianMs < 2.5 || u.State != stateEjected) {
				t.Errorf("ejected: expected_ms %v, answer_median_ms %v, state %s; want null, its 3 ms answers, ejected", u.ExpectedMs, u.AnswerMedianMs, u.State)
			}
			if d == "fast:80" && (u.ExpectedMs == nil || *u.ExpectedMs <= 0) {
				t.Errorf("fast: expected_ms %v; want a positive figure", u.ExpectedMs)
			}
		}
	}
	if got := strings.Join(order, " "); got != "ejected:80 failing:80 slow:80 fast:80" {
		t.Errorf("worst: %q; want ejected, failing, slow, fast", got)
	}
}

// setup200k gives the package state 200,000 upstream addresses, all in
// one ewma pool that has served a request, as a naming file of that size
// does; a few have samples. It returns after Cleanup is registered.
func setup200k(b *testing.B) {
	b.Helper()
	s := provisionLeastTime(b, &LeastTimeSelection{})
	const n = 200_000
	pool := make(reverseproxy.UpstreamPool, n)
	for i := range pool {
		pool[i] = &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: fmt.Sprintf("10.%d.%d.%d:80", i>>16, i>>8&0xff, i&0xff)}
	}
	if s.Select(pool, httptest.NewRequest(http.MethodGet, "/", nil), nil) == nil {
		b.Fatal("nothing selected")
	}
	now := monoclock.Now()
	for i := 0; i < n; i += 97 {
		s.table.ObserveAt(s.table.Stats(pool[i].Dial), now-int64(time.Millisecond), now, hoststate.Success)
	}
}

// BenchmarkUpstreamsView200k: one GET /lbx/upstreams (the first page, of
// the default size) with 200,000 upstreams in one pool, answer encoded.
func BenchmarkUpstreamsView200k(b *testing.B) {
	setup200k(b)
	req := httptest.NewRequest(http.MethodGet, "/lbx/upstreams", nil)
	b.ReportAllocs()
	size := 0
	for b.Loop() {
		rec := httptest.NewRecorder()
		if err := serveUpstreams(rec, req); err != nil {
			b.Fatal(err)
		}
		size = rec.Body.Len()
	}
	b.ReportMetric(float64(size), "bytes/answer")
}
