package selective

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
)

// groupsOf returns a Caddyfile group block per backend, named after it,
// each a reverse_proxy to that backend with the given extra lines.
func groupsOf(extra string, bs ...*backend) string {
	var b strings.Builder
	for _, be := range bs {
		fmt.Fprintf(&b, "\t\tgroup %s {\n\t\t\treverse_proxy %s {\n%s\t\t\t}\n\t\t}\n", be.name, be.addr, extra)
	}
	return b.String()
}

// The no-options form: two groups, every request answered, both groups
// used, and the answering group named in the placeholders.
func TestDefaults(t *testing.T) {
	e := newEnv(t)
	a, b := e.backend("a"), e.backend("b")
	e.load(fmt.Sprintf("\tselective {\n%s\t}\n\theader X-Group {http.selective.group}", groupsOf("", a, b)))
	var mu sync.Mutex
	by := map[string]int{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 25 {
				r := e.do(http.MethodGet, "/")
				mu.Lock()
				if r.err != nil || r.status != 200 {
					by["failed"]++
				} else {
					by[r.body]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if by["failed"] != 0 || by["a"] == 0 || by["b"] == 0 {
		t.Fatalf("answers by group: %v; want every request answered, by both groups", by)
	}
	st := e.admin()
	if len(st.Handlers) != 1 || len(st.Handlers[0].Groups) != 2 || st.Handlers[0].Policy != "latency" || st.Handlers[0].MaxRetry != 1 {
		t.Fatalf("admin view: %+v", st)
	}
	for _, g := range st.Handlers[0].Groups {
		if g.Capacity != 1 || g.Upstreams != 1 || g.Attempts == 0 || g.InFlight != 0 {
			t.Errorf("group %s in the admin view: %+v", g.Name, g)
		}
	}
}

// A group that answers 503 is retried on the other: no client error, and
// after failingStreak failures the failing group is no longer chosen.
// Under failover the failing group is the primary, so it is surely tried
// (the latency policy may never try it once the other has answered fast).
func TestRetryOnAnotherGroup(t *testing.T) {
	e := newEnv(t)
	bad, good := e.backend("bad"), e.backend("good")
	bad.status.Store(http.StatusServiceUnavailable)
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy failover\n\t\tstatus_header\n\t}", groupsOf("", bad, good)))
	for i := range 40 {
		r := e.get("/")
		if r.status != 200 || r.body != "good" {
			t.Fatalf("request %d: %d %q (%s), want 200 from good", i, r.status, r.body, r.header.Get("X-Selective"))
		}
	}
	if n := bad.hits.Load(); n < 1 || n > failingStreak+3 {
		t.Fatalf("the failing group got %d requests of 40; want it left alone after %d failures", n, failingStreak)
	}
	r := e.get("/")
	if h := r.header.Get("X-Selective"); !strings.HasPrefix(h, "good; attempts=") {
		t.Fatalf("status header %q", h)
	}
}

// A POST is not retried on a status (it may have had effects), but is on
// a dial error, when no backend saw it.
func TestRetryMethods(t *testing.T) {
	e := newEnv(t)
	bad, good := e.backend("bad"), e.backend("good")
	bad.status.Store(http.StatusServiceUnavailable)
	// policy failover sends every first attempt to the first group
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy failover\n\t}", groupsOf("", bad, good)))
	if r := e.do(http.MethodPost, "/"); r.status != http.StatusServiceUnavailable {
		t.Fatalf("POST to a 503 group: %d %q, want the 503 itself", r.status, r.body)
	}
	if r := e.get("/"); r.status != 200 || r.body != "good" {
		t.Fatalf("GET: %d %q, want it retried on good", r.status, r.body)
	}
	dead := &backend{name: "dead", addr: fmt.Sprintf("127.0.0.1:%d", freePort(t))} // nothing listens: a dial error
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy failover\n\t}", groupsOf("", dead, good)))
	for range 3 {
		if r := e.do(http.MethodPost, "/"); r.status != 200 || r.body != "good" {
			t.Fatalf("POST after a dial error: %d %q, want it retried on good", r.status, r.body)
		}
	}
}

// The hash policy: keys stay on their group; when a group goes down, its
// keys move to the others, spread, and no other key moves.
func TestHashKeysStayAndSpread(t *testing.T) {
	e := newEnv(t)
	bs := []*backend{e.backend("g0"), e.backend("g1"), e.backend("g2")}
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy hash {http.request.header.X-Key}\n\t}", groupsOf("\t\t\t\thealth_uri /health\n\t\t\t\thealth_interval 50ms\n", bs...)))
	const keys = 300
	route := func() map[string]string {
		m := make(map[string]string, keys)
		for k := range keys {
			r := e.get("/", "X-Key", fmt.Sprintf("user-%d", k))
			if r.status != 200 {
				t.Fatalf("key %d: status %d", k, r.status)
			}
			m[fmt.Sprint(k)] = r.body
		}
		return m
	}
	before := route()
	again := route()
	count := map[string]int{}
	for k, g := range before {
		if again[k] != g {
			t.Fatalf("key %s moved from %s to %s with nothing changed", k, g, again[k])
		}
		count[g]++
	}
	for _, b := range bs {
		if c := count[b.name]; c < keys/3/2 {
			t.Fatalf("keys per group %v; want them spread", count)
		}
	}
	bs[0].health.Store(http.StatusServiceUnavailable)
	waitFor(t, 5*time.Second, "g0 unhealthy", func() (bool, string) {
		g := e.admin().Handlers[0].Groups[0]
		return g.Usable == 0, fmt.Sprintf("%+v", g)
	})
	after := route()
	moved := map[string]int{}
	for k, g := range before {
		switch {
		case g == "g0":
			moved[after[k]]++
		case after[k] != g:
			t.Fatalf("key %s of %s moved to %s although %s is up", k, g, after[k], g)
		}
	}
	if moved["g0"] != 0 || moved["g1"] < count["g0"]/4 || moved["g2"] < count["g0"]/4 {
		t.Fatalf("g0's %d keys went to %v; want them spread over g1 and g2", count["g0"], moved)
	}
	t.Logf("keys per group %v; g0's keys moved to %v; no other key moved", count, moved)
}

// Failover: the backup group takes the share the primary cannot, in
// proportion, as the primary's healthy upstreams go from 4 to 0.
func TestFailoverSpills(t *testing.T) {
	e := newEnv(t)
	var primary []*backend
	var dials []string
	for i := range 4 {
		b := e.backend(fmt.Sprintf("p%d", i))
		primary = append(primary, b)
		dials = append(dials, b.addr)
	}
	backup := e.backend("backup")
	e.load(fmt.Sprintf(`	selective {
		group primary {
			reverse_proxy %s {
				health_uri /health
				health_interval 50ms
			}
		}
		group backup {
			reverse_proxy %s
		}
		policy failover
		max_retry 1
	}`, strings.Join(dials, " "), backup.addr))
	const n = 400
	for down := 0; down <= 4; down++ {
		for i := range down {
			primary[i].health.Store(http.StatusServiceUnavailable)
		}
		waitFor(t, 5*time.Second, "primary health", func() (bool, string) {
			g := e.admin().Handlers[0].Groups[0]
			return g.Usable == float64(4-down), fmt.Sprintf("%+v", g)
		})
		// The share the rule owes the backup is taken from the primary
		// group's state as the handler sees it before each request: a
		// health check that fails on a busy machine, or a failed answer
		// that puts the group in its cooldown, moves traffic rightly, and
		// the test judges the rule, not the machine.
		toBackup, owed, off := 0, 0.0, 0
		for range n {
			g := e.admin().Handlers[0].Groups[0]
			share := g.Capacity / g.Weight / g.Upstreams
			if share != float64(4-down)/4 {
				off++
			}
			owed += 1 - math.Min(1, share/0.7)
			r := e.get("/")
			if r.status != 200 {
				t.Fatalf("%d of 4 down: status %d %q", down, r.status, r.body)
			}
			if r.body == "backup" {
				toBackup++
			}
		}
		want, got := owed/n, float64(toBackup)/n
		t.Logf("%d of 4 primary upstreams down: %.3f to backup (want %.3f; %d requests saw another share)", down, got, want, off)
		if off > n/2 {
			t.Errorf("%d of 4 down: %d of %d requests saw the primary group at another share than %d of 4", down, off, n, 4-down)
		}
		if math.Abs(got-want) > 0.08 {
			t.Errorf("%d of 4 down: %.3f of requests to the backup group, want %.3f", down, got, want)
		}
	}
	for _, b := range primary {
		b.health.Store(0)
	}
	waitFor(t, 5*time.Second, "primary back", func() (bool, string) {
		g := e.admin().Handlers[0].Groups[0]
		return g.Usable == 4, fmt.Sprintf("%+v", g)
	})
	before := backup.hits.Load()
	for range 50 {
		e.get("/")
	}
	if n := backup.hits.Load() - before; n != 0 {
		t.Fatalf("the primary recovered, yet the backup got %d of 50", n)
	}
}

// A backup request: the first group is slow, the second answers; the
// client gets the second's answer soon after the delay, and the slow
// backend sees its request cancelled.
func TestBackupRequest(t *testing.T) {
	e := newEnv(t)
	slow, fast := e.backend("slow"), e.backend("fast")
	slow.delay.Store(int64(2 * time.Second))
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy failover\n\t\tbackup_request 50ms\n\t\tstatus_header\n\t}", groupsOf("", slow, fast)))
	start := time.Now()
	r := e.get("/")
	took := time.Since(start)
	if r.status != 200 || r.body != "fast" || !strings.Contains(r.header.Get("X-Selective"), "backup=won") {
		t.Fatalf("got %d %q (%s), want fast's answer by the backup request", r.status, r.body, r.header.Get("X-Selective"))
	}
	if took > time.Second {
		t.Fatalf("the answer took %v; the backup should have answered after about 50ms", took)
	}
	waitFor(t, 3*time.Second, "the slow attempt cancelled at its backend", func() (bool, string) {
		return slow.cancelled.Load() == 1, fmt.Sprint(slow.cancelled.Load())
	})
	// A POST is not hedged by default.
	start = time.Now()
	if r := e.do(http.MethodPost, "/"); r.body != "slow" || time.Since(start) < time.Second {
		t.Fatalf("POST: %q after %v, want slow's answer, unhedged", r.body, time.Since(start))
	}
	// One group: the backup goes to another replica, even under a policy
	// that would choose the same one again (first, wrapped by panic,
	// which leaves out what a request tried).
	e.load(fmt.Sprintf(`	selective {
		group only {
			reverse_proxy %s %s {
				lb_policy panic {
					policy first
				}
			}
		}
		backup_request 50ms
	}`, slow.addr, fast.addr))
	for range 3 {
		start = time.Now()
		if r := e.get("/"); r.body != "fast" || time.Since(start) > time.Second {
			t.Fatalf("one group: %q after %v, want the other replica's answer after about 50ms", r.body, time.Since(start))
		}
	}
}

// A backup request goes only where it need not queue: with every other
// replica busy, none is sent ("busy" in the status header, counted in
// the admin view), and no budget is spent on it.
func TestBackupOnlyToSpareCapacity(t *testing.T) {
	e := newEnv(t)
	a, b := e.backend("a"), e.backend("b")
	a.delay.Store(int64(400 * time.Millisecond))
	b.delay.Store(int64(400 * time.Millisecond))
	e.load(fmt.Sprintf(`	selective {
		group only {
			reverse_proxy %s %s {
				lb_policy ewma
			}
		}
		backup_request 200ms
		status_header
	}`, a.addr, b.addr))
	// Two calls, the second once the first is at a replica: ewma sends it
	// to the other, and each replica holds one call until 400 ms, so
	// neither call's backup (at 200 ms) has anywhere idle to go.
	var wg sync.WaitGroup
	replies := make([]reply, 2)
	for i := range replies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			replies[i] = e.get("/")
		}()
		waitFor(t, 5*time.Second, "the call at a replica", func() (bool, string) {
			n := a.hits.Load() + b.hits.Load()
			return n == int64(i+1), fmt.Sprint(n)
		})
	}
	wg.Wait()
	for i, r := range replies {
		if r.status != 200 || !strings.Contains(r.header.Get("X-Selective"), "backup=busy") {
			t.Errorf("call %d with both replicas busy: %d %q; want an answer without a backup request (backup=busy)", i, r.status, r.header.Get("X-Selective"))
		}
	}
	h := e.admin().Handlers[0]
	if h.BackupBusy != 2 || h.BackupTokens != budgetBurst {
		t.Errorf("admin: backup_busy %d, tokens %.2f; want 2 and the full bucket (%d)", h.BackupBusy, h.BackupTokens, budgetBurst)
	}
	if a.hits.Load()+b.hits.Load() != 2 {
		t.Errorf("the backends got %d requests; want 2", a.hits.Load()+b.hits.Load())
	}
	// One call alone: the other replica is idle, so it gets the backup.
	if r := e.get("/"); !strings.Contains(r.header.Get("X-Selective"), "backup=sent") && !strings.Contains(r.header.Get("X-Selective"), "backup=won") {
		t.Errorf("one call alone: %q; want a backup request sent", r.header.Get("X-Selective"))
	}
}

// The backup budget: with a tiny share, the bucket's burst is spent and
// further backups are refused and counted.
func TestBackupBudget(t *testing.T) {
	e := newEnv(t)
	slow, fast := e.backend("slow"), e.backend("fast")
	slow.delay.Store(int64(300 * time.Millisecond))
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy failover\n\t\tbackup_request 10ms\n\t\tbackup_budget 0.01%%\n\t}", groupsOf("", slow, fast)))
	fastAnswers := 0
	for range budgetBurst + 5 {
		if r := e.get("/"); r.body == "fast" {
			fastAnswers++
		}
	}
	h := e.admin().Handlers[0]
	if fastAnswers != budgetBurst || h.BackupRefused != 5 {
		t.Fatalf("%d answers by backup, %d refused; want %d and 5", fastAnswers, h.BackupRefused, budgetBurst)
	}
}

// The outer timeout overrides a nested selective's: brpc's 500ms over
// 100ms example.
func TestTimeoutOverridesNested(t *testing.T) {
	e := newEnv(t)
	b := e.backend("b")
	b.delay.Store(int64(300 * time.Millisecond))
	inner := fmt.Sprintf("selective {\n\t\t\t\tgroup only {\n\t\t\t\t\treverse_proxy %s\n\t\t\t\t}\n\t\t\t\ttimeout 100ms\n\t\t\t}", b.addr)
	e.load(fmt.Sprintf("\tselective {\n\t\tgroup nested {\n\t\t\t%s\n\t\t}\n\t\ttimeout 500ms\n\t\tmax_retry 0\n\t}", inner))
	if r := e.get("/"); r.status != 200 || r.body != "b" {
		t.Fatalf("outer 500ms, inner 100ms, backend 300ms: %d %q, want b's answer", r.status, r.body)
	}
	e.load(fmt.Sprintf("\tselective {\n\t\tgroup nested {\n\t\t\t%s\n\t\t}\n\t\ttimeout 150ms\n\t\tmax_retry 0\n\t}", inner))
	start := time.Now()
	before := b.cancelled.Load()
	if r := e.get("/"); r.status != http.StatusGatewayTimeout || time.Since(start) > 250*time.Millisecond {
		t.Fatalf("outer 150ms, backend 300ms: %d after %v, want 504 after about 150ms", r.status, time.Since(start))
	}
	waitFor(t, 3*time.Second, "the timed-out attempt cancelled at its backend", func() (bool, string) {
		return b.cancelled.Load() == before+1, fmt.Sprint(b.cancelled.Load() - before)
	})
}

// A reload that keeps a group keeps its state (its attempts count and
// estimate), adds and removes groups, and loses no request.
func TestReloadKeepsGroupState(t *testing.T) {
	e := newEnv(t)
	a, b, c := e.backend("a"), e.backend("b"), e.backend("c")
	e.load(fmt.Sprintf("\tselective {\n%s\t}", groupsOf("", a, b)))
	for range 20 {
		e.get("/")
	}
	attemptsOf := func(name string) (uint64, bool) {
		for _, g := range e.admin().Handlers[0].Groups {
			if g.Name == name {
				return g.Attempts, true
			}
		}
		return 0, false
	}
	kept, _ := attemptsOf("a")
	// weighted: the new group gets its share at once (latency would give
	// it traffic only once a's queue grows, which sequential requests
	// never make it)
	e.load(fmt.Sprintf("\tselective {\n%s\t\tpolicy weighted\n\t}", groupsOf("", a, c)))
	if n, ok := attemptsOf("a"); !ok || n != kept {
		t.Fatalf("group a after the reload: %d attempts (present %v), want the %d it had", n, ok, kept)
	}
	if _, ok := attemptsOf("b"); ok {
		t.Fatal("group b is still in the admin view after the reload removed it")
	}
	seen := map[string]bool{}
	for range 40 {
		r := e.get("/")
		if r.status != 200 {
			t.Fatalf("after the reload: %d %q", r.status, r.body)
		}
		seen[r.body] = true
	}
	if !seen["a"] || !seen["c"] || seen["b"] {
		t.Fatalf("answered by %v; want a and c", seen)
	}
}

// A bad config pushed to a serving Caddy is refused with the option named,
// and the old config keeps serving.
func TestBadConfigKeepsServing(t *testing.T) {
	e := newEnv(t)
	a := e.backend("a")
	good := fmt.Sprintf("\tselective {\n%s\t}", groupsOf("", a))
	e.load(good)
	for _, c := range []struct{ body, want string }{
		{"max_retry 17", "max_retry 17 is above the maximum 16"},
		{"max_retry -1", "max_retry -1 is below the minimum 0"},
		{"backup_request 0s", "backup_request 0s is below the minimum 1ms"},
		{"backup_budget 0", "backup_budget must be above 0"},
		{"backup_budget 101", "backup_budget 101 is above the maximum 100"},
		{"timeout 25h", "timeout 25h0m0s is above the maximum 24h0m0s"},
		{"retry_on teapot", `retry_on "teapot"`},
		{"policy hash", "policy hash: want one key"},
		{"policy failover 0", "threshold must be above 0"},
		{"policy random", `policy "random" is not one of`},
		{"status_header X:Y", "not a valid header name"},
		{"max_replay_body 2GiB", "max_replay_body"},
		{"frobnicate", `unknown option "frobnicate"`},
	} {
		err := e.loadErr(fmt.Sprintf("\tselective {\n%s\t\t%s\n\t}", groupsOf("", a), c.body))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want an error with %q", c.body, err, c.want)
		}
		if r := e.get("/"); r.status != 200 || r.body != "a" {
			t.Fatalf("after %s: the old config answers %d %q", c.body, r.status, r.body)
		}
	}
	for _, c := range []struct{ site, want string }{
		{"\tselective {\n\t}", "no group given"},
		{fmt.Sprintf("\tselective {\n\t\tgroup x {\n\t\t\treverse_proxy %s\n\t\t}\n\t\tgroup x {\n\t\t\treverse_proxy %s\n\t\t}\n\t}", a.addr, a.addr), "group x specified more than once"},
		{"\tselective {\n\t\tgroup bad/name {\n\t\t\trespond ok\n\t\t}\n\t}", `has '/'`},
		{"\tselective {\n\t\tgroup x weight 0 {\n\t\t\trespond ok\n\t\t}\n\t}", "weight 0 is below the minimum 1"},
		{"\tselective {\n\t\tgroup x\n\t}", "missing block"},
	} {
		err := e.loadErr(c.site)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: got %v, want an error with %q", c.site, err, c.want)
		}
	}
	if r := e.get("/"); r.status != 200 || r.body != "a" {
		t.Fatalf("the old config answers %d %q", r.status, r.body)
	}
}

// A group may be a parallel fan-out: its merged answer is the group's,
// its failure is retried on the next group, and, as parallel reports no
// capacity, the group counts as one usable upstream.
func TestParallelGroup(t *testing.T) {
	e := newEnv(t)
	a, b, single := e.backend("a"), e.backend("b"), e.backend("single")
	e.load(fmt.Sprintf(`	selective {
		group fanout {
			parallel {
				branch a {
					reverse_proxy %s
				}
				branch b {
					reverse_proxy %s
				}
				merge concat
				fail_limit 1
			}
		}
		group single {
			reverse_proxy %s
		}
		policy failover
		max_retry 1
	}`, a.addr, b.addr, single.addr))
	if r := e.get("/"); r.status != 200 || r.body != "ab" {
		t.Fatalf("got %d %q, want the branches' answers merged", r.status, r.body)
	}
	var found bool
	for _, g := range e.admin().Handlers[0].Groups {
		if g.Name == "fanout" {
			found = true
			if g.Usable != 1 || g.Upstreams != 1 {
				t.Errorf("capacity %v of %v; want 1 of 1", g.Usable, g.Upstreams)
			}
		}
	}
	if !found {
		t.Fatal("no group fanout in the admin view")
	}
	b.status.Store(http.StatusServiceUnavailable)
	if r := e.get("/"); r.status != 200 || r.body != "single" {
		t.Fatalf("with a branch failing: %d %q, want the other group's answer", r.status, r.body)
	}
}

// A group may be a partition fan-out: its merged answer is the group's,
// its failure (fail_limit 1) is retried on the next group, and the
// selective's deadline bounds it instead of its own 30s timeout.
func TestPartitionGroup(t *testing.T) {
	e := newEnv(t)
	p0, p1, single := e.backend("p0"), e.backend("p1"), e.backend("single")
	site := func(timeout string, retries int) string {
		return fmt.Sprintf(`	selective {
		group fanout {
			partition {
				to %s 0/2 %s 1/2
				merge concat
				fail_limit 1
			}
		}
		group single {
			reverse_proxy %s
		}
		policy failover
		max_retry %d
		timeout %s
	}`, p0.addr, p1.addr, single.addr, retries, timeout)
	}
	e.load(site("2s", 1))
	if r := e.get("/"); r.status != 200 || r.body != "p0p1" {
		t.Fatalf("got %d %q, want the partitions' answers merged", r.status, r.body)
	}
	// The fan-out's capacity is its partitions' least replica count
	// (brpc's rule), not one: a second replica of partition 0 alone adds
	// nothing, one of each partition doubles it.
	capacityOf := func() (usable, total float64) {
		for _, g := range e.admin().Handlers[0].Groups {
			if g.Name == "fanout" {
				return g.Usable, g.Upstreams
			}
		}
		t.Fatal("no group fanout in the admin view")
		return 0, 0
	}
	if u, tot := capacityOf(); u != 1 || tot != 1 {
		t.Fatalf("one replica per partition: capacity %v of %v, want 1 of 1", u, tot)
	}
	p0b, p1b := e.backend("p0"), e.backend("p1")
	for _, c := range []struct {
		extra string
		want  float64
	}{{p0b.addr + " 0/2", 1}, {p0b.addr + " 0/2 " + p1b.addr + " 1/2", 2}} {
		e.load(strings.Replace(site("2s", 1), " 1/2\n", " 1/2 "+c.extra+"\n", 1))
		if u, tot := capacityOf(); u != c.want || tot != c.want {
			t.Fatalf("with %s added: capacity %v of %v, want %v", c.extra, u, tot, c.want)
		}
	}
	e.load(site("2s", 1))
	p1.status.Store(http.StatusServiceUnavailable)
	if r := e.get("/"); r.status != 200 || r.body != "single" {
		t.Fatalf("with a partition failing: %d %q, want the other group's answer", r.status, r.body)
	}
	p1.status.Store(0)
	p1.delay.Store(int64(3 * time.Second))
	e.load(site("300ms", 0))
	start := time.Now()
	r := e.get("/")
	if took := time.Since(start); r.status != http.StatusGatewayTimeout || took > time.Second {
		t.Fatalf("a partition slower than the selective's 300ms deadline: %d after %v, want 504 after about 300ms", r.status, took)
	}
}

// The seed's walk-through of a dynamic partition still holds inside a
// group, and the fan-out's capacity weighs the group: a 3-partition
// scheme on one server and a 4-partition scheme on a second share the
// fan-out's requests 1:1 (backend traffic 3:4), and the fan-out (capacity
// 2) takes two thirds of the calls against a single upstream under the
// weighted policy; the 4-partition scheme on a third server makes that
// scheme's capacity 2 (requests 1:2, traffic 3:4:4, the fan-out 3 of 4
// calls); with partition 2/3 gone, the first server gets nothing.
func TestSeedWalkThroughInAGroup(t *testing.T) {
	e := newEnv(t)
	s4, s5, s6, single := e.backend("8004"), e.backend("8005"), e.backend("8006"), e.backend("single")
	scheme := func(b *backend, m int, skip ...int) string {
		var sb strings.Builder
		for i := range m {
			if !slices.Contains(skip, i) {
				fmt.Fprintf(&sb, " %s %d/%d", b.addr, i, m)
			}
		}
		return sb.String()
	}
	site := func(to string) string {
		return fmt.Sprintf(`	selective {
		group fanout {
			partition {
				to%s
				merge concat
				fail_limit 1
				lb_policy round_robin
			}
		}
		group single {
			reverse_proxy %s
		}
		policy weighted
	}`, to, single.addr)
	}
	hits := func() [4]int64 {
		return [4]int64{s4.hits.Load(), s5.hits.Load(), s6.hits.Load(), single.hits.Load()}
	}
	measure := func(n int) (d [4]int64) {
		before := hits()
		for range n {
			if r := e.get("/"); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
		}
		after := hits()
		for i := range d {
			d[i] = after[i] - before[i]
		}
		return d
	}
	const n = 900
	e.load(site(scheme(s4, 3) + scheme(s5, 4)))
	d := measure(n)
	share3 := float64(d[0]) / 3 / (float64(d[0])/3 + float64(d[1])/4)
	fanout := 1 - float64(d[3])/n
	t.Logf("phase 1: hits %v, 3-partition share %.3f (want 0.5), fan-out share %.3f (want 0.667)", d, share3, fanout)
	// binomial sd over ≈600 fan-out calls ≈ 0.02; over 900 calls ≈ 0.016
	if math.Abs(share3-0.5) > 0.08 || math.Abs(fanout-2.0/3) > 0.07 || d[2] != 0 {
		t.Errorf("phase 1: hits %v; want 8004:8005 ≈ 3:4 and the fan-out on 2 of 3 calls", d)
	}

	e.load(site(scheme(s4, 3) + scheme(s5, 4) + scheme(s6, 4)))
	d = measure(n)
	share3 = float64(d[0]) / 3 / (float64(d[0])/3 + float64(d[1]+d[2])/4)
	split := float64(d[1]) / float64(d[1]+d[2])
	fanout = 1 - float64(d[3])/n
	t.Logf("phase 2: hits %v, 3-partition share %.3f (want 0.333), 8005/(8005+8006) %.3f, fan-out share %.3f (want 0.75)", d, share3, split, fanout)
	if math.Abs(share3-1.0/3) > 0.08 || math.Abs(split-0.5) > 0.1 || math.Abs(fanout-0.75) > 0.07 {
		t.Errorf("phase 2: hits %v; want ≈ 3:4:4 and the fan-out on 3 of 4 calls", d)
	}

	e.load(site(scheme(s4, 3, 2) + scheme(s5, 4) + scheme(s6, 4)))
	d = measure(n / 3)
	t.Logf("phase 3: hits %v", d)
	if d[0] != 0 || d[1] == 0 || d[2] == 0 {
		t.Errorf("phase 3: hits %v; want none on 8004", d)
	}
}

// The latency policy sends most requests to the faster of two groups, and
// the weighted policy follows capacity (usable upstreams × weight).
func TestLatencyAndWeighted(t *testing.T) {
	e := newEnv(t)
	slow, fast := e.backend("slow"), e.backend("fast")
	slow.delay.Store(int64(20 * time.Millisecond))
	e.load(fmt.Sprintf("\tselective {\n%s\t}", groupsOf("", slow, fast)))
	for range 200 {
		e.get("/")
	}
	if s, f := slow.hits.Load(), fast.hits.Load(); s*10 > f {
		t.Fatalf("latency policy: %d to the 20ms group, %d to the fast one; want the fast one to take over 90%%", s, f)
	}
	a1, a2, a3, b := e.backend("a1"), e.backend("a2"), e.backend("a3"), e.backend("b")
	e.load(fmt.Sprintf(`	selective {
		group a {
			reverse_proxy %s %s %s
		}
		group b weight 2 {
			reverse_proxy %s
		}
		policy weighted
	}`, a1.addr, a2.addr, a3.addr, b.addr))
	const n = 1000
	toB := 0
	for range n {
		if e.get("/").body == "b" {
			toB++
		}
	}
	// capacities 3 × 1 and 1 × 2: b takes 2/5
	if share := float64(toB) / n; math.Abs(share-0.4) > 0.06 {
		t.Fatalf("weighted: %.3f to b, want 0.4 (capacity 2 of 5)", share)
	}
}

// Every way a call can end — a client that leaves mid-call, a backup
// whose loser is cancelled, a timeout, every group failing, a body too
// large to replay, dial errors — 25 times each, leaves no goroutine and
// no attempt counted in flight.
func TestNoLeakOnBadRequests(t *testing.T) {
	e := newEnv(t)
	slow, fast, failing := e.backend("slow"), e.backend("fast"), e.backend("failing")
	slow.delay.Store(int64(300 * time.Millisecond))
	failing.status.Store(http.StatusBadGateway)
	dead := &backend{name: "dead", addr: fmt.Sprintf("127.0.0.1:%d", freePort(t))}
	e.load(fmt.Sprintf(`	selective {
		group slow {
			reverse_proxy %s
		}
		group fast {
			reverse_proxy %s
		}
		group failing {
			reverse_proxy %s
		}
		group dead {
			reverse_proxy %s
		}
		policy hash {http.request.header.X-Key}
		backup_request 20ms
		backup_budget 100%%
		max_replay_body 1KiB
		timeout 200ms
		max_retry 3
	}`, slow.addr, fast.addr, failing.addr, dead.addr))
	// a key whose first choice is each group, from the policy's own score
	names := []string{"slow", "fast", "failing", "dead"}
	keyFor := map[string]string{}
	for k := 0; len(keyFor) < len(names); k++ {
		key := fmt.Sprint(k)
		kh := xxhash.Sum64String(key)
		best, bestScore := "", math.Inf(-1)
		for _, n := range names {
			if sc := rendezvousScore(kh, xxhash.Sum64String(n), 1); sc > bestScore {
				best, bestScore = n, sc
			}
		}
		if _, ok := keyFor[best]; !ok {
			keyFor[best] = key
		}
	}
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	send := func(method, key string, body string, cancelAfter time.Duration) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		if cancelAfter > 0 {
			time.AfterFunc(cancelAfter, cancel)
		}
		req, _ := http.NewRequestWithContext(ctx, method, fmt.Sprintf("http://127.0.0.1:%d/", httpPort), strings.NewReader(body))
		req.Header.Set("X-Key", key)
		if res, err := client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
		}
	}
	big := strings.Repeat("x", 4096)
	for range 25 {
		send(http.MethodGet, keyFor["slow"], "", 10*time.Millisecond) // client leaves before the backup
		send(http.MethodGet, keyFor["slow"], "", 0)                   // backup wins, the slow one is cancelled
		send(http.MethodPost, keyFor["slow"], "", 0)                  // not hedged: the deadline passes
		send(http.MethodGet, keyFor["failing"], "", 0)                // held failure, retried
		send(http.MethodPost, keyFor["failing"], big, 0)              // streamed body, not retried
		send(http.MethodPost, keyFor["dead"], "", 0)                  // dial errors, retried
		send(http.MethodGet, keyFor["slow"], "", 25*time.Millisecond) // client leaves after the backup
	}
	waitFor(t, 5*time.Second, "no attempt in flight", func() (bool, string) {
		for _, g := range e.admin().Handlers[0].Groups {
			if g.InFlight != 0 {
				return false, fmt.Sprintf("%+v", g)
			}
		}
		return true, ""
	})
	waitFor(t, 5*time.Second, "no selective goroutine left", func() (bool, string) {
		buf := make([]byte, 1<<20)
		stacks := string(buf[:runtime.Stack(buf, true)])
		for _, g := range strings.Split(stacks, "\n\n") {
			if strings.Contains(g, "selective.(*attempt).run") || strings.Contains(g, "selective.(*call).run") {
				return false, g
			}
		}
		return true, ""
	})
}

// The access log sees the call's placeholders, the answering attempt's
// upstream and the selective_group field; a placeholder nobody knows is
// empty (it must not send a lookup back and forth between the client's
// and the attempt's placeholders).
func TestAccessLog(t *testing.T) {
	e := newEnv(t)
	a := e.backend("a")
	logFile := t.TempDir() + "/access.log"
	e.load(fmt.Sprintf(`	log {
		output file %s
	}
	log_append up {http.reverse_proxy.upstream.hostport}
	log_append tried {http.selective.tried}
	log_append nobody {http.nobody.knows.this}
	selective {
%s	}`, logFile, groupsOf("", a)))
	if r := e.get("/"); r.status != 200 {
		t.Fatalf("status %d", r.status)
	}
	waitFor(t, 5*time.Second, "the access log line", func() (bool, string) {
		b, _ := os.ReadFile(logFile)
		line := string(b)
		return strings.Contains(line, `"up":"`+a.addr+`"`) && strings.Contains(line, `"tried":"a"`) &&
			strings.Contains(line, `"selective_group":"a"`) && (strings.Contains(line, `"nobody":""`) || strings.Contains(line, `"nobody":null`)), line
	})
}
