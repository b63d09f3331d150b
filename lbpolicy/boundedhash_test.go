package lbpolicy

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/cespare/xxhash/v2"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// fakePool is a hashPool whose loads and availability a test sets.
type fakePool struct {
	loads []int
	down  []bool
}

func (p *fakePool) load(i int) int    { return p.loads[i] }
func (p *fakePool) usable(i int) bool { return p.down == nil || !p.down[i] }
func (p *fakePool) admits(int) bool   { return true }
func (p *fakePool) shared() bool      { return true }

func newFakePool(n int) *fakePool { return &fakePool{loads: make([]int, n), down: make([]bool, n)} }

// testDials returns n dial addresses, the same in every run, so the rings
// and so the tests are deterministic.
func testDials(n int) []string {
	d := make([]string, n)
	for i := range d {
		d[i] = fmt.Sprintf("10.0.0.%d:8080", i+1)
	}
	return d
}

func ones(n int) []int {
	w := make([]int, n)
	for i := range w {
		w[i] = 1
	}
	return w
}

func keyHash(k int) uint64 { return xxhash.Sum64String("/item/" + fmt.Sprint(k)) }

// TestConsistentHashBoundZipf: 8 upstreams, a Zipf-distributed stream of
// keys (a few very hot), requests held in flight and finished in random
// order. At every assignment the chosen upstream's requests in flight are
// at most ceil(c × the average in flight). Without the bound (a huge
// factor) the same stream overloads the hot keys' owners, so the test can
// fail.
func TestConsistentHashBoundZipf(t *testing.T) {
	const n, inFlight, steps = 8, 64, 20000
	ring := newHashRing(testDials(n), ones(n))
	run := func(c float64) (worst float64) {
		rng := rand.New(rand.NewPCG(1, 2))
		zipf := rand.NewZipf(rng, 1.1, 1, 10000)
		p := newFakePool(n)
		var held []int
		total := 0
		for range steps {
			if len(held) == inFlight {
				j := rng.IntN(len(held))
				p.loads[held[j]]--
				held[j] = held[len(held)-1]
				held = held[:len(held)-1]
				total--
			}
			i := pickBounded(ring, keyHash(int(zipf.Uint64())), c, p, false, 0)
			if i < 0 {
				t.Fatal("no upstream picked")
			}
			p.loads[i]++
			total++
			held = append(held, i)
			avg := float64(total) / n
			if over := float64(p.loads[i]) / math.Ceil(c*avg); over > worst {
				worst = over
			}
		}
		return worst
	}
	if worst := run(defaultBalanceFactor); worst > 1 {
		t.Fatalf("a load reached %.2f × ceil(c × average) with c = %v", worst, defaultBalanceFactor)
	}
	// the same check with c = 1.25 applied to an unbounded run
	unbounded := func() float64 {
		rng := rand.New(rand.NewPCG(1, 2))
		zipf := rand.NewZipf(rng, 1.1, 1, 10000)
		loads := make([]int, n)
		var held []int
		worst := 0.0
		for range steps {
			if len(held) == inFlight {
				j := rng.IntN(len(held))
				loads[held[j]]--
				held[j] = held[len(held)-1]
				held = held[:len(held)-1]
			}
			i := pickBounded(ring, keyHash(int(zipf.Uint64())), 1e9, &fakePool{loads: make([]int, n)}, false, 0)
			loads[i]++
			held = append(held, i)
			if over := float64(loads[i]) / math.Ceil(defaultBalanceFactor*float64(len(held))/n); over > worst {
				worst = over
			}
		}
		return worst
	}()
	if unbounded <= 1.5 {
		t.Fatalf("without the bound the worst load is only %.2f × the bound: the stream is not skewed enough to test it", unbounded)
	}
	t.Logf("worst load over the bound: unbounded %.2f×", unbounded)
}

// TestConsistentHashRemoval: when one of 8 upstreams leaves the pool, only
// its keys move (the theoretical minimum, about 1/8, within 10%), and they
// spread over at least 5 of the 7 others. Both ways of leaving: removed
// from the pool (a new ring), or unavailable in the same ring.
func TestConsistentHashRemoval(t *testing.T) {
	const n, keys = 8, 100000
	dials := testDials(n)
	before := newHashRing(dials, ones(n))
	idle := newFakePool(n)
	idle7 := newFakePool(n - 1)
	for gone := range n {
		rest := append(append([]string(nil), dials[:gone]...), dials[gone+1:]...)
		after := newHashRing(rest, ones(n-1))
		lost := newFakePool(n)
		lost.down[gone] = true
		check := func(name string, owner func(h uint64) string) {
			moved, owned := 0, 0
			dest := map[string]int{}
			for k := range keys {
				h := keyHash(k)
				was := dials[pickBounded(before, h, defaultBalanceFactor, idle, false, 0)]
				now := owner(h)
				if was == dials[gone] {
					owned++
				}
				if now != was {
					moved++
					if was != dials[gone] {
						t.Fatalf("%s %d: key %d moved from %s, which stayed", name, gone, k, was)
					}
					dest[now]++
				}
			}
			share := float64(moved) / keys
			if share < 0.9/n || share > 1.1/n {
				t.Fatalf("%s %d: %.4f of the keys moved, want within 10%% of %.4f", name, gone, share, 1.0/n)
			}
			if moved != owned {
				t.Fatalf("%s %d: %d keys moved, the leaving upstream owned %d", name, gone, moved, owned)
			}
			if len(dest) < 5 {
				t.Fatalf("%s %d: the moved keys went to only %d upstreams: %v", name, gone, len(dest), dest)
			}
			t.Logf("%s %d: moved %.4f of keys, to %d upstreams: %v", name, gone, share, len(dest), dest)
		}
		check("removed", func(h uint64) string { return rest[pickBounded(after, h, defaultBalanceFactor, idle7, false, 0)] })
		check("unavailable", func(h uint64) string { return dials[pickBounded(before, h, defaultBalanceFactor, lost, false, 0)] })
	}
}

// TestConsistentHashFullOwnerSpreads: the keys of an upstream that is full
// go to many successors, not to one neighbour.
func TestConsistentHashFullOwnerSpreads(t *testing.T) {
	const n, full = 8, 5
	ring := newHashRing(testDials(n), ones(n))
	p := newFakePool(n)
	for i := range p.loads {
		p.loads[i] = 10
	}
	p.loads[full] = 20 // bound: ceil(1.25 × 91 / 8) = 15
	idle := newFakePool(n)
	dest := map[int]int{}
	for k := range 20000 {
		h := keyHash(k)
		if pickBounded(ring, h, defaultBalanceFactor, idle, false, 0) != full {
			continue
		}
		got := pickBounded(ring, h, defaultBalanceFactor, p, false, 0)
		if got == full {
			t.Fatalf("key %d went to the full upstream", k)
		}
		dest[got]++
	}
	if len(dest) < 5 {
		t.Fatalf("a full upstream's keys went to only %d others: %v", len(dest), dest)
	}
}

// TestConsistentHashNoneUsable: with no usable upstream the ring picks
// none (reverse_proxy answers 502).
func TestConsistentHashNoneUsable(t *testing.T) {
	ring := newHashRing(testDials(4), ones(4))
	p := newFakePool(4)
	for i := range p.down {
		p.down[i] = true
	}
	if i := pickBounded(ring, 42, defaultBalanceFactor, p, false, 0); i != -1 {
		t.Fatalf("picked %d of none usable", i)
	}
	if i := leastLoaded(ring, p, 0); i != -1 {
		t.Fatalf("least loaded picked %d of none usable", i)
	}
}

// TestConsistentHashWeights: an upstream of weight 3 owns about three times
// the keys of one of weight 1, and may hold three times the requests.
func TestConsistentHashWeights(t *testing.T) {
	ring := newHashRing(testDials(2), []int{1, 3})
	idle := newFakePool(2)
	var got [2]int
	for k := range 40000 {
		got[pickBounded(ring, keyHash(k), defaultBalanceFactor, idle, false, 0)]++
	}
	if share := float64(got[1]) / 40000; share < 0.70 || share > 0.80 {
		t.Fatalf("weight 3 of 4 got %.3f of the keys", share)
	}
	// 8 in flight: bounds ceil(1.25 × 9 × 1/4) = 3 and ceil(1.25 × 9 × 3/4) = 9
	p := &fakePool{loads: []int{3, 5}}
	for k := range 1000 {
		if i := pickBounded(ring, keyHash(k), defaultBalanceFactor, p, false, 0); i != 1 {
			t.Fatalf("key %d went to %d, full at 3 of weight 1", k, i)
		}
	}
	// 15 in flight, all on weight 3: its bound is ceil(1.25 × 16 × 3/4) = 15
	p.loads = []int{0, 15}
	for k := range 1000 {
		if i := pickBounded(ring, keyHash(k), defaultBalanceFactor, p, false, 0); i != 0 {
			t.Fatalf("key %d went to %d, full at 15 of weight 3", k, i)
		}
	}
	if i := leastLoaded(ring, &fakePool{loads: []int{1, 2}}, 0); i != 1 {
		t.Fatalf("least loaded per weight: got %d, want 1 (3/3 < 2/1)", i)
	}
}

// TestConsistentHashRingSize: points follow the weights, and huge weights
// are scaled down to the ring's cap.
func TestConsistentHashRingSize(t *testing.T) {
	if r := newHashRing(testDials(3), []int{1, 2, 1}); len(r.points) != 4*pointsPerWeight {
		t.Fatalf("ring of weights 1,2,1 has %d points, want 4×%d", len(r.points), pointsPerWeight)
	}
	r := newHashRing(testDials(3), []int{maxWeight, maxWeight, 1})
	if len(r.points) > maxRingPoints+3 {
		t.Fatalf("ring of huge weights has %d points, cap %d", len(r.points), maxRingPoints)
	}
	for i := range r.points[1:] {
		if r.points[i] > r.points[i+1] {
			t.Fatal("ring not sorted")
		}
	}
}

// provisionHash provisions a consistent_hash policy outside a
// reverse_proxy handler.
func provisionHash(t testing.TB, s *ConsistentHashSelection) *ConsistentHashSelection {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Cleanup() })
	return s
}

// hashRequest is a request as Caddy's server hands it over, with a
// replacer and variables.
func hashRequest(target string) *http.Request {
	ctx := context.WithValue(context.Background(), caddyhttp.VarsCtxKey, map[string]any{})
	r := httptest.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	caddyhttp.NewTestReplacer(r)
	return r
}

// TestConsistentHashSameKey: the same key goes to the same upstream while
// nothing is full, different keys spread over the pool, and the default
// key is the request URI.
func TestConsistentHashSameKey(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{})
	if s.Key != defaultHashKey || s.BalanceFactor != defaultBalanceFactor {
		t.Fatalf("defaults not written: key %q, factor %v", s.Key, s.BalanceFactor)
	}
	pool := newPool(t, 8)
	seen := map[*reverseproxy.Upstream]bool{}
	for k := range 200 {
		target := fmt.Sprintf("/item/%d?x=1", k)
		first := s.Select(pool, hashRequest(target), nil)
		for range 5 {
			if u := s.Select(pool, hashRequest(target), nil); u != first {
				t.Fatalf("%s went to %s, then %s", target, first.Dial, u.Dial)
			}
		}
		seen[first] = true
	}
	if len(seen) != 8 {
		t.Fatalf("200 keys went to %d of 8 upstreams", len(seen))
	}
}

// TestConsistentHashKeys: header and replacer keys hash the placeholder's
// value; literal text around them is part of the key.
func TestConsistentHashKeys(t *testing.T) {
	pool := newPool(t, 8)
	hdr := provisionHash(t, &ConsistentHashSelection{Key: "{http.request.header.x-user}"})
	byUser := map[string]*reverseproxy.Upstream{}
	dests := map[*reverseproxy.Upstream]bool{}
	for k := range 100 {
		user := fmt.Sprint("user", k)
		for _, path := range []string{"/a", "/b", "/c"} {
			r := hashRequest(path)
			r.Header.Set("X-User", user)
			u := hdr.Select(pool, r, nil)
			if prev, ok := byUser[user]; ok && prev != u {
				t.Fatalf("user %s went to %s and %s", user, prev.Dial, u.Dial)
			}
			byUser[user] = u
			dests[u] = true
		}
	}
	if len(dests) < 6 {
		t.Fatalf("100 users went to %d upstreams", len(dests))
	}
	// through the replacer: the same value hashes as the fast path does
	viaRepl := provisionHash(t, &ConsistentHashSelection{Key: "{http.request.method}"})
	a, _ := viaRepl.key.hash(hashRequest("/x"))
	b, _ := hdr.key.hash(func() *http.Request { r := hashRequest("/y"); r.Header.Set("X-User", "GET"); return r }())
	if a != b || a == 0 {
		t.Fatalf("replacer value hashed to %x, header value to %x", a, b)
	}
	lit := parseHashKey(`user:{http.request.header.X-User}\{`)
	if len(lit.parts) != 3 || lit.parts[0].text != "user:" || lit.parts[2].text != "{" || lit.parts[1].header != "X-User" {
		t.Fatalf("parsed %+v", lit.parts)
	}
}

// TestConsistentHashEmptyKey: a request whose key is empty (no such
// header, or no request) goes to the least loaded upstream, never nowhere
// and never panicking; literal text alone is an empty key.
func TestConsistentHashEmptyKey(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{Key: "user:{http.request.header.X-User}"})
	pool := newPool(t, 4)
	if _, ok := s.key.hash(hashRequest("/")); ok {
		t.Fatal("a key of literal text and an empty placeholder is not empty")
	}
	seen := map[*reverseproxy.Upstream]bool{}
	for range 200 {
		u := s.Select(pool, hashRequest("/"), nil)
		if u == nil {
			t.Fatal("no upstream for an empty key")
		}
		seen[u] = true
	}
	// all idle: ties spread over the pool rather than piling on one
	if len(seen) < 3 {
		t.Fatalf("empty keys went to %d of 4 idle upstreams", len(seen))
	}
	if s.Select(pool, nil, nil) == nil {
		t.Fatal("no upstream without a request")
	}
	if s.Select(nil, nil, nil) != nil {
		t.Fatal("an upstream from an empty pool")
	}
}

// TestConsistentHashSelectAllocs: selecting allocates nothing, with the
// default key and with a header key.
func TestConsistentHashSelectAllocs(t *testing.T) {
	pool := newPool(t, 8)
	for _, key := range []string{"", "{http.request.header.X-User}", "{http.request.uri.path}:{http.request.header.X-User}"} {
		s := provisionHash(t, &ConsistentHashSelection{Key: key})
		r := hashRequest("/some/path?q=1")
		r.Header.Set("X-User", "alice")
		vars := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
		s.Select(pool, r, nil) // builds the view
		if a := testing.AllocsPerRun(200, func() {
			clear(vars) // a new request: a first attempt, recorded for retries
			if s.Select(pool, r, nil) == nil {
				t.Fatal("nil pick")
			}
		}); a != 0 {
			t.Fatalf("key %q: %v allocations per selection", key, a)
		}
	}
}

// TestConsistentHashValidate: every bound is checked, naming the option.
func TestConsistentHashValidate(t *testing.T) {
	pct := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		name string
		s    func() *ConsistentHashSelection
		want string
	}{
		{"factor 1", func() *ConsistentHashSelection { return &ConsistentHashSelection{BalanceFactor: 1} }, "balance_factor must be above 1"},
		{"factor 0.5", func() *ConsistentHashSelection { return &ConsistentHashSelection{BalanceFactor: 0.5} }, "balance_factor 0.5 is below the minimum 1"},
		{"factor 11", func() *ConsistentHashSelection { return &ConsistentHashSelection{BalanceFactor: 11} }, "balance_factor 11 is above the maximum 10"},
		{"factor NaN", func() *ConsistentHashSelection { return &ConsistentHashSelection{BalanceFactor: math.NaN()} }, "balance_factor NaN is not a finite number"},
		{"weight 0", func() *ConsistentHashSelection { return &ConsistentHashSelection{Weights: []int{1, 0}} }, "weights[1]: weight 0 is below the minimum 1"},
		{"threshold 101", func() *ConsistentHashSelection { return &ConsistentHashSelection{PanicThreshold: pct(101)} }, "panic_threshold 101%"},
		{"valid", func() *ConsistentHashSelection {
			return &ConsistentHashSelection{BalanceFactor: 2, Weights: []int{1, 5}, PanicThreshold: pct(0)}
		}, ""},
	} {
		err := tc.s().Validate()
		if tc.want == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "consistent_hash: ") {
			t.Errorf("%s: got %v, want %q", tc.name, err, tc.want)
		}
		// Provision refuses it too, before building anything
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if err := tc.s().Provision(ctx); err == nil {
			t.Errorf("%s: provisioned", tc.name)
		}
		cancel()
	}
}

// TestConsistentHashCaddyfile reads every option and every error.
func TestConsistentHashCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		in, want, err string
	}{
		{in: `consistent_hash`, want: `{}`},
		{in: `consistent_hash {http.request.header.X-User}`, want: `{"key":"{http.request.header.X-User}"}`},
		{in: "consistent_hash {\n balance_factor 1.5\n weights 1 2\n panic_threshold off\n}", want: `{"balance_factor":1.5,"weights":[1,2],"panic_threshold":0}`},
		{in: "consistent_hash {\n balance_factor 1\n}", err: "lb_policy consistent_hash: balance_factor must be above 1, at Testfile:2"},
		{in: "consistent_hash {\n balance_factor x\n}", err: `balance_factor "x": want a number`},
		{in: "consistent_hash {\n balance_factor\n}", err: "balance_factor: missing value"},
		{in: "consistent_hash {\n weights 1 0\n}", err: "weight 0 is below the minimum 1"},
		{in: "consistent_hash {\n weights 1 x\n}", err: `weight "x": want a whole number`},
		{in: "consistent_hash {\n panic_threshold 200\n}", err: "panic_threshold \"200\""},
		{in: "consistent_hash {\n weights 1\n weights 2\n}", err: "specified more than once"},
		{in: "consistent_hash {\n choices 2\n}", err: `unknown option "choices"`},
		{in: "consistent_hash {\n outlier {\n  consecutive_failures 3\n }\n slow_start 30s {\n  min_weight 20\n  aggression 2\n }\n}", want: `{"outlier":{"consecutive_failures":3},"slow_start":{"window":30000000000,"min_weight_percent":20,"aggression":2}}`},
		{in: "consistent_hash {\n slow_start 30s\n}", want: `{"slow_start":{"window":30000000000}}`},
		{in: "consistent_hash {\n slow_start\n}", err: "lb_policy consistent_hash: slow_start: missing value, at Testfile:2"},
		{in: "consistent_hash {\n slow_start 30s {\n  min_weight 0\n }\n}", err: "lb_policy consistent_hash: slow_start: min_weight_percent must be above 0%: a host at weight 0 would never be tried, at Testfile:3"},
		{in: "consistent_hash {\n outlier {\n  consecutive_failures 0\n }\n}", err: "lb_policy consistent_hash: outlier: consecutive_failures 0 is below the minimum 1, at Testfile:3"},
		{in: "consistent_hash {\n outlier\n outlier\n}", err: "lb_policy consistent_hash: outlier specified more than once, at Testfile:3"},
		{in: "consistent_hash a b", err: `unexpected argument "b"`},
	} {
		var s ConsistentHashSelection
		err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: got error %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		b, err := json.Marshal(&s)
		if err != nil {
			t.Fatal(err)
		}
		got := string(b)
		if got != tc.want {
			t.Errorf("%q: got %s, want %s", tc.in, got, tc.want)
		}
	}
}

// TestConsistentHashLargePoolTotals: above exactTotals upstreams the
// bound's totals are reused for totalsEvery, then summed again, and again
// at once when panic mode changes; a walk that finds every upstream full
// stops after maxWalk points and takes the least loaded.
func TestConsistentHashLargePoolTotals(t *testing.T) {
	const n = 100
	ring := newHashRing(testDials(n), ones(n))
	p := newFakePool(n)
	const h = 12345
	owner := pickBounded(ring, h, defaultBalanceFactor, p, false, 1000) // totals: 0 in flight
	for i := range p.loads {
		p.loads[i] = 10
	}
	// 1000 in flight, but the cached total says 0: every bound is 1, all
	// are full, and the least loaded from h%n is taken (all equal)
	if got := pickBounded(ring, h, defaultBalanceFactor, p, false, 1000+totalsEvery/2); got != h%n {
		t.Fatalf("with stale totals: got %d, want the least loaded %d", got, h%n)
	}
	// panic mode changed: summed afresh, bound ceil(1.25 × 1001 / 100) = 13
	if got := pickBounded(ring, h, defaultBalanceFactor, p, true, 1000+totalsEvery/2); got != owner {
		t.Fatalf("after panic mode changed: got %d, want the owner %d", got, owner)
	}
	// idle again, summed afresh at t1 (panic mode changed back)
	clear(p.loads)
	const t1 = 1000 + totalsEvery/2
	pickBounded(ring, h, defaultBalanceFactor, p, false, t1)
	for i := range p.loads {
		p.loads[i] = 10
	}
	if got := pickBounded(ring, h, defaultBalanceFactor, p, false, t1+totalsEvery-1); got != h%n {
		t.Fatalf("within totalsEvery: got %d, want the least loaded %d", got, h%n)
	}
	if got := pickBounded(ring, h, defaultBalanceFactor, p, false, t1+totalsEvery); got != owner {
		t.Fatalf("after totalsEvery: got %d, want the owner %d", got, owner)
	}
	if h%n == owner {
		t.Fatal("pick another h: its owner is the least loaded's start")
	}
}

// TestConsistentHashStatus: the pools the policy served are in the admin
// API's reports, with their weights, until Cleanup.
func TestConsistentHashStatus(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{Weights: []int{3, 1}})
	pool := newPool(t, 2)
	s.Select(pool, hashRequest("/"), nil)
	reps := s.poolStatuses()
	if len(reps) != 1 || reps[0].Policy != "consistent_hash" || reps[0].Available != 2 || len(reps[0].Upstreams) != 2 ||
		reps[0].Upstreams[0].Weight != 3 || reps[0].Upstreams[1].Weight != 1 || reps[0].PanicThreshold != defaultPanicThreshold {
		t.Fatalf("status %+v", reps)
	}
	found := func() bool {
		for _, st := range allPoolStatuses() {
			if st.Policy == "consistent_hash" && strings.Contains(st.Name, pool[0].Dial) {
				return true
			}
		}
		return false
	}
	if !found() {
		t.Fatal("pool not in the admin reports")
	}
	_ = s.Cleanup()
	if found() {
		t.Fatal("pool still in the admin reports after Cleanup")
	}
}

// TestConsistentHashInPanicWithOutlier: wrapped in the panic policy with
// outlier ejection, an ejected upstream's keys move to the others, spread,
// and no other key moves.
func TestConsistentHashInPanicWithOutlier(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{
		PolicyRaw: json.RawMessage(`{"policy": "consistent_hash"}`),
		Outlier:   &Outlier{},
	})
	pool := newPool(t, 4)
	owners := func() []*reverseproxy.Upstream {
		p.views.last.Load().countedAt.Store(-countEvery) // past the availability cache
		out := make([]*reverseproxy.Upstream, 300)
		for k := range out {
			out[k] = p.Select(pool, hashRequest(fmt.Sprintf("/item/%d", k)), nil)
		}
		return out
	}
	p.Select(pool, hashRequest("/"), nil) // builds the view
	before := owners()
	if _, _, ok := p.table.Stats(pool[2].Dial).Eject(monoclock.Now(), time.Hour,
		func(int64) time.Duration { return time.Hour }, hoststate.ReasonConsecutiveFailures); !ok {
		t.Fatal("ejecting")
	}
	after := owners()
	dest := map[*reverseproxy.Upstream]bool{}
	for k := range before {
		switch {
		case after[k] == pool[2]:
			t.Fatalf("key %d went to the ejected upstream", k)
		case before[k] == pool[2]:
			dest[after[k]] = true
		case after[k] != before[k]:
			t.Fatalf("key %d moved from %s, which stayed", k, before[k].Dial)
		}
	}
	if len(dest) != 3 {
		t.Fatalf("the ejected upstream's keys went to %d of the 3 others", len(dest))
	}
}

// TestConsistentHashWeightCount: inside a reverse_proxy with static
// upstreams, weights must be one per upstream.
func TestConsistentHashWeightCount(t *testing.T) {
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	raw := `{"upstreams":[{"dial":"10.0.0.1:80"},{"dial":"10.0.0.2:80"}],"load_balancing":{"selection_policy":{"policy":"consistent_hash","weights":[1,2,3]}}}`
	_, err = ctx.LoadModuleByID("http.handlers.reverse_proxy", json.RawMessage(raw))
	if err == nil || !strings.Contains(err.Error(), "consistent_hash: 3 weights given for 2 upstreams") {
		t.Fatalf("got %v", err)
	}
}

// TestConsistentHashRetryAvoidsTried: a retry goes to another upstream
// while one is untried, with static and dynamic upstreams, and a first
// attempt is unchanged by the record it leaves.
func TestConsistentHashRetryAvoidsTried(t *testing.T) {
	s := provisionHash(t, &ConsistentHashSelection{})
	if !s.trackTried {
		t.Fatal("outside a handler the policy must record what requests tried")
	}
	pool := newPool(t, 4)
	assertRetriesAvoidTried(t, s, pool, false)
	assertRetriesAvoidTried(t, s, pool, true)
	first := s.Select(pool, clientRequest(), nil)
	for range 50 {
		if u := s.Select(pool, clientRequest(), nil); u != first {
			t.Fatalf("first attempts of one key went to %s and %s", first.Dial, u.Dial)
		}
	}
	if u := s.Select(pool[:1], clientRequest(), nil); u != pool[0] {
		t.Fatal("a single upstream must take every attempt")
	}
}

// TestConsistentHashWeightsByAddress: with static upstreams, a weight
// belongs to its upstream's address, so a part of the pool (as a wrapping
// panic policy hands over without an ejected upstream) keeps its weights.
func TestConsistentHashWeightsByAddress(t *testing.T) {
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	raw := `{"upstreams":[{"dial":"10.0.0.1:80"},{"dial":"10.0.0.2:80"},{"dial":"10.0.0.3:80"}],"load_balancing":{"selection_policy":{"policy":"consistent_hash","weights":[3,1,2]}}}`
	mod, err := ctx.LoadModuleByID("http.handlers.reverse_proxy", json.RawMessage(raw))
	if err != nil {
		t.Fatal(err)
	}
	h := mod.(*reverseproxy.Handler)
	t.Cleanup(func() { _ = h.Cleanup() })
	s := h.LoadBalancing.SelectionPolicy.(*ConsistentHashSelection)
	for _, tc := range []struct {
		pool reverseproxy.UpstreamPool
		want []float64
	}{
		{h.Upstreams, []float64{3, 1, 2}},
		{h.Upstreams[1:], []float64{1, 2}},
		{reverseproxy.UpstreamPool{h.Upstreams[2], h.Upstreams[0]}, []float64{2, 3}},
	} {
		if got := s.views.get(tc.pool, s.buildView).ring.weights; !slices.Equal(got, tc.want) {
			t.Errorf("weights %v, want %v", got, tc.want)
		}
	}
}

// TestConsistentHashInPanicRetries: wrapped in panic, consistent_hash
// avoids what a retry tried itself, over the whole pool (the wrapper does
// not hand it the untried part, which would build a ring per subset).
func TestConsistentHashInPanicRetries(t *testing.T) {
	p := provisionPanic(t, &PanicSelection{PolicyRaw: json.RawMessage(`{"policy": "consistent_hash"}`)})
	if p.trackTried {
		t.Fatal("the panic wrapper tracks what was tried for consistent_hash, which does it itself")
	}
	pool := newPool(t, 4)
	assertRetriesAvoidTried(t, p, pool, false)
	if n := p.inner.(*ConsistentHashSelection).views.n; n != 1 {
		t.Fatalf("%d views after retries, want 1 (the pool's)", n)
	}
}

// TestHashKeyUnknownPlaceholders: a Caddyfile shorthand written in JSON,
// or a typo, is named so that Provision can warn that it is always empty.
func TestHashKeyUnknownPlaceholders(t *testing.T) {
	for key, want := range map[string][]string{
		"{http.request.uri}":                        nil,
		"{http.request.header.X-User}-{env.REGION}": nil,
		"{uri}": {"uri"},
		"user:{header.X-User}/{http.request.host}": {"header.X-User"},
		"literal only": nil,
		`\{uri\}`:      nil,
	} {
		k := parseHashKey(key)
		if got := k.unknownPlaceholders(); !slices.Equal(got, want) {
			t.Errorf("%q: unknown placeholders %q, want %q", key, got, want)
		}
	}
}
