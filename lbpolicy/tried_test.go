package lbpolicy

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// clientRequest returns a request as Caddy's server hands it to
// reverse_proxy, with its own variables and replacer; reverse_proxy passes
// the same one to Select for every attempt.
func clientRequest() *http.Request {
	return requestWith(map[string]any{}, caddy.NewReplacer())
}

// dialsOf returns the dial addresses t records, nil on a first attempt.
func dialsOf(t *Tried) []string {
	if t == nil {
		return nil
	}
	return t.dials
}

func requestWith(vars map[string]any, repl *caddy.Replacer) *http.Request {
	ctx := context.WithValue(context.Background(), caddyhttp.VarsCtxKey, vars)
	ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, repl)
	return httptest.NewRequestWithContext(ctx, http.MethodGet, "/", nil)
}

// attempts runs n selections for one request, as reverse_proxy does for a
// first attempt and n-1 retries, with fresh Upstream values each time when
// dynamic (as dynamic upstream sources make them), and returns the dial
// addresses chosen.
func attempts(sel reverseproxy.Selector, pool reverseproxy.UpstreamPool, n int, dynamic bool) []string {
	r := clientRequest()
	var got []string
	for range n {
		p := pool
		if dynamic {
			p = make(reverseproxy.UpstreamPool, len(pool))
			for i, u := range pool {
				p[i] = &reverseproxy.Upstream{Host: u.Host, Dial: u.Dial}
			}
		}
		u := sel.Select(p, r, nil)
		if u == nil {
			got = append(got, "")
			continue
		}
		got = append(got, u.Dial)
	}
	return got
}

// assertRetriesAvoidTried: over many requests, no retry picks an upstream
// its request already tried while the pool has an untried one, and once
// all are tried a retry still gets one.
func assertRetriesAvoidTried(t *testing.T, sel reverseproxy.Selector, pool reverseproxy.UpstreamPool, dynamic bool) {
	t.Helper()
	n := len(pool) + 1
	for trial := range 300 {
		got := attempts(sel, pool, n, dynamic)
		seen := map[string]bool{}
		for i, d := range got {
			if d == "" {
				t.Fatalf("request %d, attempt %d: nothing chosen (attempts %q)", trial, i, got)
			}
			if i < len(pool) && seen[d] {
				t.Fatalf("request %d, attempt %d went back to %s, already tried, with %d untried upstreams left: attempts %q",
					trial, i, d, len(pool)-len(seen), got)
			}
			seen[d] = true
		}
	}
}

// TestEWMARetryAvoidsTried: with pool[0] the fastest, a full scan picks it
// for every first attempt, and without exclusion for every retry too; two
// random choices would pick a tried one again whenever it is drawn and
// still the cheaper. A retry must go elsewhere, with static and dynamic
// upstreams alike.
func TestEWMARetryAvoidsTried(t *testing.T) {
	for _, choices := range []Choices{choicesAll, 2} {
		for _, dynamic := range []bool{false, true} {
			name := choices.String()
			if dynamic {
				name += "/dynamic"
			}
			t.Run(name, func(t *testing.T) {
				s := provisionLeastTime(t, &LeastTimeSelection{Choices: choices})
				pool := newPool(t, 4)
				observe(s, pool[0], time.Millisecond, hoststate.Success)
				for _, u := range pool[1:] {
					observe(s, u, 10*time.Millisecond, hoststate.Success)
				}
				assertRetriesAvoidTried(t, s, pool, dynamic)
			})
		}
	}
}

// TestEWMARetryFirstAttemptUnchanged: the record a first attempt leaves
// changes nothing for it, only for its retries: a full scan still sends
// every first attempt to the fastest upstream.
func TestEWMARetryFirstAttemptUnchanged(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{Choices: choicesAll})
	pool := newPool(t, 3)
	observe(s, pool[0], time.Millisecond, hoststate.Success)
	for _, u := range pool[1:] {
		observe(s, u, 10*time.Millisecond, hoststate.Success)
	}
	for range 200 {
		if u := s.Select(pool, clientRequest(), nil); u != pool[0] {
			t.Fatalf("first attempt picked %v; want the fastest, %v", u, pool[0])
		}
	}
}

// TestRetrySingleUpstream: with one upstream, every retry still gets it.
func TestRetrySingleUpstream(t *testing.T) {
	for name, sel := range map[string]reverseproxy.Selector{
		"ewma":              provisionLeastTime(t, &LeastTimeSelection{}),
		"ewma choices 2":    provisionLeastTime(t, &LeastTimeSelection{Choices: 2}),
		"panic(least_conn)": provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"least_conn"}`)}),
		"panic(first)":      provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"first"}`)}),
	} {
		pool := newPool(t, 1)
		for _, d := range attempts(sel, pool, 3, false) {
			if d != pool[0].Dial {
				t.Fatalf("%s: attempts of a request to a pool of one: %q", name, d)
			}
		}
	}
}

// TestEWMARetryAmongTriedWhenOnlyTheyAreUsable: when the untried
// upstreams are unusable, a retry goes back to one that was tried rather
// than fail.
func TestEWMARetryAmongTriedWhenOnlyTheyAreUsable(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{Choices: choicesAll, PanicThreshold: percent(0)})
	pool := newPool(t, 3)
	if _, _, ok := s.table.Stats(pool[2].Dial).Eject(monoclock.Now(), time.Hour,
		func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("eject")
	}
	for range 50 {
		got := attempts(s, pool, 3, false)
		if got[0] == got[1] || got[2] == "" || got[2] == pool[2].Dial {
			t.Fatalf("attempts %q; want the two usable upstreams, then one of them again", got)
		}
	}
}

// TestPanicRetryAvoidsTried: panic hands the policy it wraps, stock ones
// included, the pool without the upstreams the request tried. least_conn
// with nothing in flight picks at random and would pick a tried one again
// one time in n; first would pick pool[0] for every attempt.
func TestPanicRetryAvoidsTried(t *testing.T) {
	for _, policy := range []string{"least_conn", "first", "round_robin", "random", "random_choose", "ip_hash"} {
		for _, dynamic := range []bool{false, true} {
			name := policy
			if dynamic {
				name += "/dynamic"
			}
			t.Run(name, func(t *testing.T) {
				p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"` + policy + `"}`)})
				assertRetriesAvoidTried(t, p, newPool(t, 4), dynamic)
			})
		}
	}
	t.Run("first, in order", func(t *testing.T) {
		p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"first"}`)})
		pool := newPool(t, 3)
		got := attempts(p, pool, 4, false)
		want := []string{pool[0].Dial, pool[1].Dial, pool[2].Dial, pool[0].Dial}
		if !slices.Equal(got, want) {
			t.Fatalf("first: attempts %q; want %q", got, want)
		}
	})
}

// TestPanicRetryAvoidsTriedInPanicMode: in panic mode the wrapped policy
// chooses among health-blind twins; a retry leaves out the twins of what
// was tried.
func TestPanicRetryAvoidsTriedInPanicMode(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy":"first"}`),
		Outlier:   &Outlier{MaxEjectionPercent: percent(100)},
	})
	pool := newPool(t, 4)
	p.Select(pool, nil, nil) // builds the view
	for _, u := range pool[:3] {
		if _, _, ok := p.table.Stats(u.Dial).Eject(monoclock.Now(), time.Hour,
			func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
			t.Fatal("eject")
		}
	}
	p.views.last.Load().countedAt.Store(-countEvery)
	got := attempts(p, pool, 3, false)
	if !p.views.last.Load().panic.on.Load() {
		t.Fatal("not in panic mode with 3 of 4 ejected")
	}
	want := []string{pool[0].Dial, pool[1].Dial, pool[2].Dial}
	if !slices.Equal(got, want) {
		t.Fatalf("panic mode, first: attempts %q; want %q", got, want)
	}
}

// TestPanicAroundEWMARetryAvoidsTried: around ewma the wrapper leaves the
// exclusion to ewma, which does it over the whole pool.
func TestPanicAroundEWMARetryAvoidsTried(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"ewma","choices":"all"}`)})
	if p.trackTried {
		t.Fatal("the wrapper around ewma tracks tried upstreams itself")
	}
	assertRetriesAvoidTried(t, p, newPool(t, 4), false)
}

func TestTracksTriedOnlyWithRetries(t *testing.T) {
	for lb, want := range map[string]bool{
		``:                        false,
		`,"retries":1`:            true,
		`,"try_duration":"5s"`:    true,
		`,"retries":0`:            false,
		`,"try_interval":"100ms"`: false,
	} {
		ctx, err := caddy.ProvisionContext(&caddy.Config{})
		if err != nil {
			t.Fatal(err)
		}
		raw := `{"upstreams":[{"dial":"127.0.0.1:1"}],"load_balancing":{"selection_policy":{"policy":"ewma"}` + lb + `}}`
		mod, err := ctx.LoadModuleByID("http.handlers.reverse_proxy", json.RawMessage(raw))
		if err != nil {
			t.Fatal(err)
		}
		h := mod.(*reverseproxy.Handler)
		if got := h.LoadBalancing.SelectionPolicy.(leastTimer).leastTime().trackTried; got != want {
			t.Errorf("load_balancing {...%s}: tracks tried %v, want %v", lb, got, want)
		}
		_ = h.Cleanup()
	}
}

// TestRetryLeavesVarsAlone: only a first attempt writes the request's
// variables. reverse_proxy's transport may still be dialing for an earlier
// attempt, and its dial function reads them: a retry writing the map then
// would be a concurrent map read and write, which crashes the process.
func TestRetryLeavesVarsAlone(t *testing.T) {
	pool := newPool(t, 4)
	for name, sel := range map[string]reverseproxy.Selector{
		"ewma":         provisionLeastTime(t, &LeastTimeSelection{}),
		"panic(first)": provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"first"}`)}),
	} {
		vars := map[string]any{}
		r := requestWith(vars, caddy.NewReplacer())
		first := sel.Select(pool, r, nil)
		after := maps.Clone(vars)
		if after[triedVar] != first {
			t.Fatalf("%s: the first attempt recorded %v, want %v", name, after[triedVar], first)
		}
		for range 3 {
			sel.Select(pool, r, nil)
			if !maps.Equal(vars, after) {
				t.Fatalf("%s: a retry changed the request's variables: %v, then %v", name, after, vars)
			}
		}
	}
}

// TestRecordTriedNeverWritesShared: a copy of a request's state (a
// partition's sub-requests start from one) shares its list; recording in
// one copy must not change the other.
func TestRecordTriedNeverWritesShared(t *testing.T) {
	pool := newPool(t, 3)
	repl := caddy.NewReplacer()
	r := requestWith(map[string]any{}, repl)
	a, tried := LoadTried(r)
	RecordTried(a, tried, pool[0])
	a, tried = LoadTried(r)
	RecordTried(a, tried, pool[1])
	_, shared := LoadTried(r)

	copyRepl := caddy.NewReplacer()
	copyRepl.Set(triedKey, shared)
	c := requestWith(map[string]any{triedVar: pool[0]}, copyRepl)
	a, tried = LoadTried(c)
	RecordTried(a, tried, pool[2])
	if _, got := LoadTried(c); !slices.Equal(dialsOf(got), []string{pool[0].Dial, pool[1].Dial, pool[2].Dial}) {
		t.Fatalf("copy: %q", dialsOf(got))
	}
	if _, got := LoadTried(r); !slices.Equal(dialsOf(got), []string{pool[0].Dial, pool[1].Dial}) {
		t.Fatalf("original after the copy recorded: %q", dialsOf(got))
	}
	a, tried = LoadTried(r)
	RecordTried(a, tried, pool[0]) // already tried: no change
	if _, got := LoadTried(r); !slices.Equal(dialsOf(got), []string{pool[0].Dial, pool[1].Dial}) {
		t.Fatalf("recording a tried one again: %q", dialsOf(got))
	}
}

// TestTriedWithoutReplacer: a request without a replacer (not from
// Caddy's server) still has its first attempt avoided by its retries.
func TestTriedWithoutReplacer(t *testing.T) {
	pool := newPool(t, 3)
	r := httptest.NewRequestWithContext(context.WithValue(context.Background(), caddyhttp.VarsCtxKey, map[string]any{}), http.MethodGet, "/", nil)
	p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy":"first"}`)})
	if got := []*reverseproxy.Upstream{p.Select(pool, r, nil), p.Select(pool, r, nil), p.Select(pool, r, nil)}; got[0] != pool[0] || got[1] != pool[1] || got[2] != pool[1] {
		t.Fatalf("attempts %v", got)
	}
	if u := p.Select(pool, nil, nil); u != pool[0] {
		t.Fatalf("no request: %v", u)
	}
}

// TestAvoidAllSteersFirstAttempt: with the fastest upstreams marked by
// AvoidAll, a full-scan ewma sends the request to the one left, a slow
// one it would never choose otherwise; with every upstream marked, it
// still chooses (the fastest), as a retry does once all were tried.
// With Avoid, which keeps one dial, the second fastest would be chosen.
func TestAvoidAllSteersFirstAttempt(t *testing.T) {
	s := provisionLeastTime(t, &LeastTimeSelection{Choices: choicesAll})
	pool := newPool(t, 4)
	for i, u := range pool {
		observe(s, u, time.Duration(i+1)*time.Millisecond, hoststate.Success)
	}
	for range 50 {
		r := clientRequest()
		AvoidAll(r, []string{pool[0].Dial, pool[1].Dial, pool[2].Dial})
		if u := s.Select(pool, r, nil); u != pool[3] {
			t.Fatalf("picked %v; want the one upstream not avoided, %v", u, pool[3])
		}
	}
	r := clientRequest()
	AvoidAll(r, []string{pool[0].Dial, pool[1].Dial, pool[2].Dial, pool[3].Dial})
	if u := s.Select(pool, r, nil); u != pool[0] {
		t.Fatalf("with every upstream avoided, picked %v; want the fastest, %v", u, pool[0])
	}
	AvoidAll(clientRequest(), nil) // nothing to record: no panic
}
