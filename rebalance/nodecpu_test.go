package rebalance

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// procStat10 is the start of a /proc/stat of a recent kernel: the
// aggregate line's ten columns (user nice system idle iowait irq softirq
// steal guest guest_nice), then the per-CPU lines.
const procStat10 = `cpu  2209954 17 674725 2566413 13729 11 89976 5 300 7
cpu0 1087348 0 330712 1309445 3877 0 45026 0 0 0
cpu1 1122605 0 344013 1256968 9851 0 44950 0 0 0
intr 123456 0 9 0 0
ctxt 987654321
btime 1700000000
processes 123456
procs_running 2
procs_blocked 0
softirq 1234 0 1 2 3 4 5 6 7 8 9
`

// TestParseProcStat: the busy and total jiffies of /proc/stat's aggregate
// cpu line; guest and guest_nice, already in user and nice, are not added
// again.
func TestParseProcStat(t *testing.T) {
	for _, tc := range []struct {
		name        string
		in          string
		busy, total uint64
		err         string
	}{
		{
			name: "10 columns",
			in:   procStat10,
			// user+nice+system+irq+softirq+steal; + idle+iowait.
			busy:  2209954 + 17 + 674725 + 11 + 89976 + 5,
			total: 2209954 + 17 + 674725 + 11 + 89976 + 5 + 2566413 + 13729,
		},
		{name: "4 columns", in: "cpu 100 20 30 850\ncpu0 100 20 30 850\n", busy: 150, total: 1000},
		{name: "7 columns", in: "cpu 100 20 30 800 40 5 5\n", busy: 160, total: 1000},
		{name: "8 columns", in: "cpu 100 20 30 800 40 5 3 2\n", busy: 160, total: 1000},
		{name: "the cpu line after others", in: "intr 1 2 3\ncpu 1 2 3 4\n", busy: 6, total: 10},
		{name: "a long line before it", in: "intr " + strings.Repeat("1234567 ", 20000) + "\ncpu 1 2 3 4\n", busy: 6, total: 10},
		{name: "empty", in: "", err: "no aggregate cpu line"},
		{name: "per-CPU lines only", in: "cpu0 1 2 3 4\ncpu1 1 2 3 4\n", err: "no aggregate cpu line"},
		{name: "garbage", in: "hello world\n\x00\x01\n", err: "no aggregate cpu line"},
		{name: "3 columns", in: "cpu 1 2 3\n", err: "the cpu line has 3 columns, want at least 4"},
		{name: "not a number", in: "cpu 1 2 x 4\n", err: `the cpu line's column 3, "x", is not a count of jiffies`},
		{name: "negative", in: "cpu 1 2 3 -4\n", err: `column 4, "-4"`},
		{name: "overflow", in: "cpu 18446744073709551615 1 0 0\n", err: "overflow"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			busy, total, err := parseProcStat(strings.NewReader(tc.in))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("busy %d total %d, error %v; want an error containing %q", busy, total, err, tc.err)
				}
				return
			}
			if err != nil || busy != tc.busy || total != tc.total {
				t.Fatalf("busy %d total %d, error %v; want %d, %d", busy, total, err, tc.busy, tc.total)
			}
		})
	}
}

// writeProcStat writes a /proc/stat with the aggregate line cpu to path.
func writeProcStat(t *testing.T, path, cpu string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(cpu+"\ncpu0 1 1 1 1\nintr 1 2 3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestNodeCPUSampler: consecutive readings of a fixed /proc/stat make the
// node's CPU utilisation over the interval: 0 at the first, the busy
// share of the jiffies in between after it, 0 and a new baseline when a
// counter goes backwards, and 0 while the file cannot be read.
func TestNodeCPUSampler(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stat")
	s := newNodeCPUSampler(path)
	for i, st := range []struct {
		cpu  string // "": no file
		want float64
		err  bool
	}{
		// user nice system idle iowait irq softirq steal guest guest_nice
		{cpu: "cpu 1000 0 500 8000 500 0 0 0 0 0", want: 0}, // the first sample
		// +300 user, +100 system, +50 softirq, +50 steal, +400 idle,
		// +100 iowait, +200 guest (inside user already): 500 of 1000.
		{cpu: "cpu 1300 0 600 8400 600 0 50 50 200 0", want: 50},
		// Idle only: 0%.
		{cpu: "cpu 1300 0 600 9400 600 0 50 50 200 0", want: 0},
		// Busy only: 100%.
		{cpu: "cpu 1500 0 600 9400 600 0 50 50 200 0", want: 100},
		// No jiffy elapsed: 0.
		{cpu: "cpu 1500 0 600 9400 600 0 50 50 200 0", want: 0},
		// Counters restart (a container restart, a wrap): 0, and the new
		// reading is the baseline.
		{cpu: "cpu 100 0 100 800 0 0 0 0 0 0", want: 0},
		// 4 columns: 25 busy of 100 since the new baseline.
		{cpu: "cpu 120 0 105 875", want: 25},
		// Busy back, idle on: one counter backwards is enough.
		{cpu: "cpu 119 0 105 975", want: 0},
		{cpu: "cpu 129 0 105 1065", want: 10},
		// The file goes: 0 with the error, and the next reading is a
		// first one again.
		{cpu: "", want: 0, err: true},
		{cpu: "cpu 200 0 200 2000", want: 0},
		{cpu: "cpu 275 0 200 2025", want: 75},
		{cpu: "garbage", want: 0, err: true},
		{cpu: "cpu 300 0 200 2100", want: 0},
	} {
		if st.cpu == "" {
			os.Remove(path)
		} else {
			writeProcStat(t, path, st.cpu)
		}
		got, err := s.sample()
		if got != st.want || (err != nil) != st.err {
			t.Errorf("reading %d (%q): %v, error %v; want %v, error %v", i, st.cpu, got, err, st.want, st.err)
		}
	}
}

// TestNodeCPUSamplerNext: the utilisation from raw jiffies, without a
// file.
func TestNodeCPUSamplerNext(t *testing.T) {
	s := newNodeCPUSampler("")
	for i, st := range []struct {
		busy, total uint64
		want        float64
	}{
		{100, 1000, 0},         // the first reading
		{133, 1100, 33},        // 33 of 100
		{133, 1100, 0},         // nothing elapsed
		{200, 1099, 0},         // total backwards: a reset
		{201, 1102, 100.0 / 3}, // 1 of 3
		{211, 1107, 100},       // 10 busy of 5: idle went backwards; capped
		{211, 1207, 0},         // idle only
		{0, 1, 0},              // wrapped: a reset
	} {
		if got := s.next(st.busy, st.total); got != st.want {
			t.Errorf("reading %d (%d of %d): %v; want %v", i, st.busy, st.total, got, st.want)
		}
	}
}

// provisionCPU provisions an app with metric cpu, cpu scope and procStat
// path, with a test source.
func provisionCPU(t *testing.T, scope, path string) (*App, error) {
	a := &App{Metric: metricCPU, CPU: scope, procStat: path, source: &fakeSource{}, cluster: &cluster.App{NodeName: "cpu"}}
	return a, provisionApp(t, a)
}

// TestCPUScopeDefault: metric cpu measures the node's CPU where /proc/stat
// can be read, and reports it as node_cpu; elsewhere, this process's, as
// cpu. Asking for the node's where /proc/stat cannot be read fails,
// naming the file.
func TestCPUScopeDefault(t *testing.T) {
	dir := t.TempDir()
	stat, missing := filepath.Join(dir, "stat"), filepath.Join(dir, "missing")
	writeProcStat(t, stat, "cpu 1 2 3 4 5 6 7 8 9 10")
	for _, tc := range []struct {
		scope, path      string
		wantScope, wantM string
		err              string
	}{
		{"", stat, cpuNode, metricNodeCPU, ""},
		{cpuNode, stat, cpuNode, metricNodeCPU, ""},
		{cpuProcess, stat, cpuProcess, metricCPU, ""},
		{"", missing, cpuProcess, metricCPU, ""},
		{cpuProcess, missing, cpuProcess, metricCPU, ""},
		{cpuNode, missing, "", "", "cpu node: the node's CPU cannot be read from " + missing},
	} {
		a, err := provisionCPU(t, tc.scope, tc.path)
		name := fmt.Sprintf("cpu %q with %s", tc.scope, filepath.Base(tc.path))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "cpu process measures this process's CPU instead") {
				t.Errorf("%s: error %v; want one containing %q", name, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		s := a.settings()
		if a.cpuScope != tc.wantScope || s.metric != tc.wantM || s.params.Metric != tc.wantM || (a.nodeCPU != nil) != (tc.wantScope == cpuNode) {
			t.Errorf("%s: scope %q, metric %q, params' metric %q, node sampler %v; want %q, %q",
				name, a.cpuScope, s.metric, s.params.Metric, a.nodeCPU != nil, tc.wantScope, tc.wantM)
		}
	}
	// The other metrics have no scope.
	a := &App{source: &fakeSource{}, cluster: &cluster.App{NodeName: "cpu"}}
	if err := provisionApp(t, a); err != nil || a.cpuScope != "" || a.settings().metric != metricConnections {
		t.Errorf("metric connections: scope %q, metric %q, error %v", a.cpuScope, a.settings().metric, err)
	}
}

// TestCPUProcessSourceNode: the process's source samples the node's CPU
// from the sampler Provision primed: the first interval is measured from
// Provision's reading.
func TestCPUProcessSourceNode(t *testing.T) {
	stat := filepath.Join(t.TempDir(), "stat")
	writeProcStat(t, stat, "cpu 100 0 100 800")
	a := &App{Metric: metricCPU, procStat: stat, cluster: &cluster.App{NodeName: "cpu"}}
	if err := a.Provision(testContext(t)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Cleanup() })
	src, ok := a.source.(*processSource)
	if !ok || src.nodeCPU == nil {
		t.Fatalf("source %T without the node sampler", a.source)
	}
	writeProcStat(t, stat, "cpu 150 0 110 840")
	if got, _ := src.Sample(a.settings().metric); got != 60 {
		t.Errorf("node CPU %v; want 60 (60 busy of 100 jiffies)", got)
	}
	// The process's own CPU is another metric, and no sampler is a 0.
	p := &processSource{tracker: conntrack.NewTracker()}
	if got, _ := p.Sample(metricNodeCPU); got != 0 {
		t.Errorf("without a sampler: %v", got)
	}
}

// TestCPUMetricIdentity: the node's CPU and the process's are different
// metrics wherever metrics are told apart: their gossip averaging kinds,
// the rule of the average, and the load tag, which still fits with the
// longest metric's room.
func TestCPUMetricIdentity(t *testing.T) {
	kinds := map[byte]string{}
	for _, m := range []string{metricConnections, metricThroughput, metricCPU, metricNodeCPU} {
		k, ok := averageKinds[m]
		if !ok || k == 0 {
			t.Errorf("metric %s has no averaging kind", m)
		}
		if other, dup := kinds[k]; dup {
			t.Errorf("metrics %s and %s share averaging kind %d", m, other, k)
		}
		kinds[k] = m
		if len(longestLoadTag(m)) > len(longestLoadTag(metricConnections)) {
			t.Errorf("metric %s's load tag is longer than connections', which TestLoadTagMustFit sizes", m)
		}
	}
	now := time.Now()
	for _, tc := range []struct {
		mine, theirs string
		want         shed.Standing
	}{
		{metricCPU, metricNodeCPU, shed.OtherMetric},
		{metricNodeCPU, metricCPU, shed.OtherMetric},
		{metricNodeCPU, metricNodeCPU, shed.Counted},
	} {
		p := shed.Params{Metric: tc.mine, Freshness: time.Second}
		r := shed.Report{Status: cluster.StatusAlive, Load: 50, At: now}
		r.Metric, r.Load, _ = shed.ParseLoadTag(shed.FormatLoadReport(tc.theirs, 50, 1))
		if got := p.Standing(r, now); got != tc.want {
			t.Errorf("%s judging %s: %v; want %v", tc.mine, tc.theirs, got, tc.want)
		}
	}
}

// TestCPUScopesNeverAverage: on loopback, two members measuring the
// node's CPU and one measuring its process's gossip under different
// metrics: each counts only the members of its own scope, in its
// decision, its gossip average and the loads lb_policy cluster_load
// reads.
func TestCPUScopesNeverAverage(t *testing.T) {
	stat := filepath.Join(t.TempDir(), "stat")
	writeProcStat(t, stat, "cpu 1 2 3 4")
	scope := func(cpu string, join *App) func(*cluster.App, *App) {
		return func(c *cluster.App, a *App) {
			a.Metric, a.CPU, a.procStat = metricCPU, cpu, stat
			if join != nil {
				c.Join = []string{join.gossipAddr()}
			}
		}
	}
	nodeA := testApp(t, "cpu-node-a", &fakeSource{load: 40}, scope(cpuNode, nil))
	nodeB := testApp(t, "cpu-node-b", &fakeSource{load: 60}, scope("", nodeA))
	proc := testApp(t, "cpu-process", &fakeSource{load: 10}, scope(cpuProcess, nodeA))

	for _, x := range []struct {
		a       *App
		metric  string
		counted int
		other   int
	}{{nodeA, metricNodeCPU, 2, 1}, {nodeB, metricNodeCPU, 2, 1}, {proc, metricCPU, 1, 2}} {
		lbxtest.WaitFor(t, 15*time.Second, x.a.node.name+" counts its scope only", func() (bool, string) {
			tag := selfTags(x.a.node)[shed.LoadTag]
			n := x.a.node
			n.mu.Lock()
			d, avg := n.last, n.average
			n.mu.Unlock()
			return strings.HasPrefix(tag, x.metric+" ") && d.Counted == x.counted && d.OtherMetric == x.other && avg.Members == x.counted,
				fmt.Sprintf("tag %q, counted %d, other metric %d, members in metric %d; reason %q", tag, d.Counted, d.OtherMetric, avg.Members, d.Reason)
		})
		if want := averageKinds[x.metric]; x.a.node.avg.kind != want {
			t.Errorf("%s averages with kind %d; want %d", x.a.node.name, x.a.node.avg.kind, want)
		}
	}
	lbxtest.WaitFor(t, 15*time.Second, "cluster_load's loads on cpu-node-a leave cpu-process out", func() (bool, string) {
		ms, err := nodeLoads{nodeA.cluster}.memberLoads(time.Now())
		got := map[string]bool{}
		for _, m := range ms {
			got[m.Name] = m.Counts
		}
		return err == nil && got["cpu-node-a"] && got["cpu-node-b"] && !got["cpu-process"], fmt.Sprintf("%v %v", got, err)
	})

	// A change of metric (a reload to another cpu) starts the averaging
	// afresh, under the new kind: no estimate flows from one to the other.
	avg := newAverager(nodeA.logger)
	t.Cleanup(avg.close)
	now := time.Now()
	s := &settings{cluster: nodeA.cluster, metric: metricCPU, interval: time.Second, params: shed.Params{Freshness: 5 * time.Second}}
	var states []any
	for _, metric := range []string{metricCPU, metricCPU, metricNodeCPU} {
		s.metric = metric
		if err := avg.prepare(s, "averager", now); err != nil {
			t.Fatal(err)
		}
		states = append(states, avg.state)
		if avg.kind != averageKinds[metric] {
			t.Errorf("%s: kind %d", metric, avg.kind)
		}
	}
	if states[0] != states[1] || states[1] == states[2] {
		t.Errorf("averaging states %p %p %p: want the same for the same metric, a new one for another", states...)
	}
}

// TestCPUCaddyfile: cpu goes with metric cpu, before or after it.
func TestCPUCaddyfile(t *testing.T) {
	for _, in := range []string{
		"rebalance {\n metric cpu\n cpu node\n}",
		"rebalance {\n cpu process\n metric cpu\n}",
	} {
		a := new(App)
		if err := a.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil || a.Metric != metricCPU || a.CPU == "" {
			t.Errorf("%q: metric %q, cpu %q, error %v", in, a.Metric, a.CPU, err)
		}
	}
}

// TestCPUScopeReload: a config that changes the metric (cpu process to
// cpu node) starts the node's load afresh: the window's samples, in the
// old unit, and the decision's state are dropped, and a tag in the new
// metric is due; a config that keeps it keeps the samples.
func TestCPUScopeReload(t *testing.T) {
	sec := time.Second
	cfg := func(metric string, history time.Duration) *settings {
		return &settings{owner: new(App), metric: metric, interval: sec, history: history}
	}
	proc, proc2, nodeS := cfg(metricCPU, 4*sec), cfg(metricCPU, 2*sec), cfg(metricNodeCPU, 2*sec)
	n := &node{window: shed.NewWindow(4), recentSheds: shed.NewWindow(4), owners: []*settings{proc}}
	n.window.Add(150)
	n.recentSheds.Add(3)
	n.shedding, n.lift, n.sincePublished = true, shed.LiftState{Lifting: true, Low: 10}, 2

	n.attach(proc2)
	if n.window.Len() != 1 || n.window.Size() != 2 || !n.shedding || n.sincePublished != 2 {
		t.Errorf("same metric: window %d of %d, shedding %v, since published %d; want the sample kept",
			n.window.Len(), n.window.Size(), n.shedding, n.sincePublished)
	}
	n.attach(nodeS)
	if n.window.Len() != 0 || n.window.Size() != 2 || n.recentSheds.Sum() != 3 || n.shedding || n.lift.Lifting || n.sincePublished != 0 {
		t.Errorf("cpu process to node: window %d of %d, sheds %v, shedding %v, lifting %v, since published %d; want the load afresh",
			n.window.Len(), n.window.Size(), n.recentSheds.Sum(), n.shedding, n.lift.Lifting, n.sincePublished)
	}
	// An older config goes: the driver is the same.
	n.window.Add(40)
	n.detach(proc.owner)
	if n.window.Len() != 1 || n.driver() != nodeS {
		t.Errorf("an older config stopped: window %d, driver %s", n.window.Len(), n.driver().metric)
	}
	// The newest goes (it failed to start): back to the old metric.
	n.detach(nodeS.owner)
	if n.window.Len() != 0 || n.driver() != proc2 {
		t.Errorf("back to cpu process: window %d, driver %s", n.window.Len(), n.driver().metric)
	}
}
