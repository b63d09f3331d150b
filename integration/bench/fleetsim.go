package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/integration/fleetsim"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// bench fleetsim: the rebalance decision at fleet scale, simulated
// (package fleetsim): every node decides from its own gossipavg view, from
// serf tags that arrive late, or from the exact average, behind a random
// or a least-connections outer balancer, through a scale-out, a scale-in
// and a rolling restart.

// fleetsimConfig is bench fleetsim's configuration, from flags.
type fleetsimConfig struct {
	sizes     []int
	conns     []int
	views     []fleetsim.ViewKind
	balancers []fleetsim.Balancer
	scenarios []fleetsim.Scenario
	seeds     int
	firstSeed uint64
	parallel  int
	// timeline and plot are the -timeline CSV file and the -plot PNG file
	// (empty: none): both of the run recordedCase picks.
	timeline string
	plot     string
	// params are the decision's settings, history the smoothing window
	// (intervals), joinEvery and reconnectDelay fleetsim.Config's.
	params         shed.Params
	history        int
	joinEvery      int
	reconnectDelay int
}

// parseFleetsimFlags reads bench fleetsim's configuration from args.
func parseFleetsimFlags(args []string, stderr io.Writer) (*fleetsimConfig, error) {
	fs := flag.NewFlagSet("bench fleetsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sizes := fs.String("sizes", "100,300,1000", "fleet sizes before the scenario, comma-separated (2 to 10000)")
	conns := fs.String("conns", "100,1000", "connections per node before the scenario, comma-separated (1 to 100000)")
	views := fs.String("views", "flow,tags,exact", "how nodes see the cluster: flow (gossipavg), tags (serf tags, late), exact")
	balancers := fs.String("balancers", "random,leastconn", "outer balancers: random, leastconn")
	var scenNames []string
	for _, s := range fleetsim.Scenarios {
		scenNames = append(scenNames, s.String())
	}
	scenarios := fs.String("scenarios", strings.Join(scenNames, ","), "scenarios")
	cfg := &fleetsimConfig{}
	fs.IntVar(&cfg.seeds, "seeds", 3, "runs per case, seeds from -seed on; the tables show medians [min–max]")
	fs.Uint64Var(&cfg.firstSeed, "seed", 1, "first seed")
	fs.IntVar(&cfg.parallel, "parallel", runtime.GOMAXPROCS(0), "runs at once")
	fs.StringVar(&cfg.timeline, "timeline", "", "write the connections of every node per interval of the 1000-node ×2 flow run behind random (first seed, most connections) to this CSV file")
	fs.StringVar(&cfg.plot, "plot", "", "draw the connections per node per interval of the run -timeline records (min, median and max of the old nodes and of the added ones; the average and ±threshold) to this PNG file, relative to the lbx module's root")
	cfg.params = fleetsim.DefaultParams()
	shedRate, threshold := 100*cfg.params.ShedRate, 100*cfg.params.Threshold
	freshness, joinSettle := int(cfg.params.Freshness/fleetsim.Interval), 0
	fs.Float64Var(&threshold, "threshold", threshold, "threshold, percent")
	fs.Float64Var(&shedRate, "shed-rate", shedRate, "shed_rate, percent per interval")
	fs.IntVar(&cfg.params.MinConnections, "min-connections", cfg.params.MinConnections, "min_connections")
	fs.IntVar(&freshness, "freshness", freshness, "freshness, intervals")
	fs.IntVar(&joinSettle, "join-settle", 0, "join_settle, intervals (0: freshness; -1: off)")
	fs.IntVar(&cfg.history, "history", 10, "history, intervals")
	fs.IntVar(&cfg.joinEvery, "join-every", 0, "intervals between two nodes a scale-out adds (0: all at once)")
	fs.IntVar(&cfg.reconnectDelay, "reconnect-delay", 1, "the most intervals a shed client takes to reconnect (uniform from 1)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	cfg.params.Threshold, cfg.params.ShedRate = threshold/100, shedRate/100
	cfg.params.Freshness = time.Duration(freshness) * fleetsim.Interval
	cfg.params.JoinSettle = time.Duration(joinSettle) * fleetsim.Interval
	switch {
	case threshold <= 0 || threshold > 1000:
		return nil, fmt.Errorf("-threshold %v: want above 0 and at most 1000", threshold)
	case shedRate <= 0 || shedRate > 100:
		return nil, fmt.Errorf("-shed-rate %v: want above 0 and at most 100", shedRate)
	case cfg.params.MinConnections < 0:
		return nil, fmt.Errorf("-min-connections %d: want at least 0", cfg.params.MinConnections)
	case freshness < 1 || freshness > 3600:
		return nil, fmt.Errorf("-freshness %d: want 1 to 3600 intervals", freshness)
	case joinSettle < -1 || joinSettle > 3600:
		return nil, fmt.Errorf("-join-settle %d: want -1 to 3600 intervals", joinSettle)
	case cfg.history < 1 || cfg.history > 3600:
		return nil, fmt.Errorf("-history %d: want 1 to 3600 intervals", cfg.history)
	case cfg.joinEvery < 0 || cfg.joinEvery > 60:
		return nil, fmt.Errorf("-join-every %d: want 0 to 60 intervals", cfg.joinEvery)
	case cfg.reconnectDelay < 1 || cfg.reconnectDelay > 60:
		return nil, fmt.Errorf("-reconnect-delay %d: want 1 to 60 intervals", cfg.reconnectDelay)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	var err error
	if cfg.sizes, err = intList("sizes", *sizes, 2, 10_000); err != nil {
		return nil, err
	}
	if cfg.conns, err = intList("conns", *conns, 1, 100_000); err != nil {
		return nil, err
	}
	if cfg.views, err = nameList("views", *views, []fleetsim.ViewKind{fleetsim.Flow, fleetsim.Tags, fleetsim.Exact}); err != nil {
		return nil, err
	}
	if cfg.balancers, err = nameList("balancers", *balancers, []fleetsim.Balancer{fleetsim.Random, fleetsim.LeastConn}); err != nil {
		return nil, err
	}
	if cfg.scenarios, err = nameList("scenarios", *scenarios, fleetsim.Scenarios); err != nil {
		return nil, err
	}
	switch {
	case cfg.seeds < 1 || cfg.seeds > 100:
		return nil, fmt.Errorf("-seeds %d: want 1 to 100", cfg.seeds)
	case cfg.parallel < 1:
		return nil, fmt.Errorf("-parallel %d: want at least 1", cfg.parallel)
	case cfg.plot != "" && !isPNGPath(cfg.plot):
		return nil, fmt.Errorf("-plot %q: want a .png file", cfg.plot)
	}
	return cfg, nil
}

// intList parses a comma-separated list of integers from lo to hi.
func intList(flagName, s string, lo, hi int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < lo || n > hi {
			return nil, fmt.Errorf("-%s: %q is not a number from %d to %d", flagName, f, lo, hi)
		}
		out = append(out, n)
	}
	return out, nil
}

// nameList parses a comma-separated list of names of known values.
func nameList[T fmt.Stringer](flagName, s string, known []T) ([]T, error) {
	var out []T
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		i := slices.IndexFunc(known, func(k T) bool { return k.String() == f })
		if i < 0 {
			var names []string
			for _, k := range known {
				names = append(names, k.String())
			}
			return nil, fmt.Errorf("-%s: unknown %q; want some of %s", flagName, f, strings.Join(names, ","))
		}
		out = append(out, known[i])
	}
	return out, nil
}

// fleetsimCase is one row of a table: every seed's run of it.
type fleetsimCase struct {
	scenario fleetsim.Scenario
	size     int
	conns    int
	view     fleetsim.ViewKind
	balancer fleetsim.Balancer
	results  []fleetsim.Result
}

// fleetsimCases returns every case cfg asks for, in report order, each
// with room for its seeds' results.
func fleetsimCases(cfg *fleetsimConfig) []*fleetsimCase {
	var cases []*fleetsimCase
	for _, sc := range cfg.scenarios {
		for _, n := range cfg.sizes {
			for _, c := range cfg.conns {
				for _, v := range cfg.views {
					for _, b := range cfg.balancers {
						cases = append(cases, &fleetsimCase{scenario: sc, size: n, conns: c, view: v, balancer: b, results: make([]fleetsim.Result, cfg.seeds)})
					}
				}
			}
		}
	}
	return cases
}

// runFleetsim runs bench fleetsim and prints its tables to out.
func runFleetsim(ctx context.Context, args []string, cmdline string, out, progress io.Writer) error {
	cfg, err := parseFleetsimFlags(args, progress)
	if err != nil {
		return err
	}
	cases := fleetsimCases(cfg)
	recorded, err := recordedCase(cfg, cases)
	if err != nil {
		return err
	}
	plotFile, err := plotPath(ctx, cfg.plot)
	if err != nil {
		return err
	}
	var record *runRecord

	began := time.Now()
	type job struct{ c, seed int }
	jobs := make(chan job)
	errs := make(chan error, cfg.parallel)
	var mu sync.Mutex
	done := 0
	var wg sync.WaitGroup
	for range cfg.parallel {
		wg.Go(func() {
			for j := range jobs {
				c := cases[j.c]
				fc := fleetsim.Config{
					Nodes: c.size, Conns: c.conns, Scenario: c.scenario, View: c.view, Balancer: c.balancer,
					Seed: cfg.firstSeed + uint64(j.seed), Params: cfg.params, History: cfg.history,
					JoinEvery: cfg.joinEvery, ReconnectDelay: cfg.reconnectDelay,
				}
				var rec *runRecord
				if j.c == recorded && j.seed == 0 {
					var err error
					if rec, err = newRunRecord(cfg, c.size); err != nil {
						errs <- err
						return
					}
					fc.Timeline, record = rec.interval, rec
				}
				r, err := fleetsim.Run(fc)
				if err == nil && rec != nil {
					err = rec.finish()
				}
				if err != nil {
					errs <- fmt.Errorf("%s, %d nodes × %d, %s, %s, seed %d: %w", c.scenario, c.size, c.conns, c.view, c.balancer, fc.Seed, err)
					return
				}
				c.results[j.seed] = r
				mu.Lock()
				done++
				fmt.Fprintf(progress, "fleetsim: %d/%d %s, %d nodes × %d, %s, %s, seed %d: %d intervals (%v so far)\n",
					done, len(cases)*cfg.seeds, c.scenario, c.size, c.conns, c.view, c.balancer, fc.Seed, r.Intervals, time.Since(began).Round(time.Second))
				mu.Unlock()
			}
		})
	}
	// The largest fleets first, so that the pool does not end on one.
	order := make([]job, 0, len(cases)*cfg.seeds)
	for i := range cases {
		for s := range cfg.seeds {
			order = append(order, job{i, s})
		}
	}
	slices.SortStableFunc(order, func(a, b job) int { return cases[b.c].size - cases[a.c].size })
	var runErr error
feed:
	for _, j := range order {
		select {
		case jobs <- j:
		case runErr = <-errs:
			break feed
		case <-ctx.Done():
			runErr = ctx.Err()
			break feed
		}
	}
	close(jobs)
	wg.Wait()
	if runErr == nil {
		select {
		case runErr = <-errs:
		default:
		}
	}
	if runErr != nil {
		return runErr
	}
	fmt.Fprint(out, fleetsimReport(cfg, cmdline, cases, time.Since(began)))
	if plotFile != "" {
		c := cases[recorded]
		if err := writePNGFile(plotFile, fleetsimChart(cfg, c, c.results[0], record.spreads).WritePNG); err != nil {
			return err
		}
		fmt.Fprintf(out, "\nPlot of the %d-node %s run, %d connections per node, %s view, %s balancer, seed %d: %s\n",
			c.size, c.scenario, c.conns, c.view, c.balancer, cfg.firstSeed, cfg.plot)
	}
	return nil
}

// recordedCase returns the index of the case whose first seed's run
// -timeline and -plot record: 1000 nodes, scale-out-double, the most
// connections of the run, flow view, random balancer; -1 when neither
// flag is given, and an error when the run lacks that case.
func recordedCase(cfg *fleetsimConfig, cases []*fleetsimCase) (int, error) {
	if cfg.timeline == "" && cfg.plot == "" {
		return -1, nil
	}
	i := slices.IndexFunc(cases, func(c *fleetsimCase) bool {
		return c.scenario == fleetsim.Double && c.size == 1000 && c.conns == slices.Max(cfg.conns) &&
			c.view == fleetsim.Flow && c.balancer == fleetsim.Random
	})
	if i < 0 {
		return -1, fmt.Errorf("-timeline and -plot need the run they record: size 1000, scenario %s, view flow, balancer random", fleetsim.Double)
	}
	return i, nil
}

// runRecord is what -timeline and -plot record of their run, interval by
// interval.
type runRecord struct {
	nodes   int              // the fleet's size before the scenario
	csv     func(int, []int) // -timeline's writer; nil without it
	done    func() error     // flushes and closes -timeline's file
	plot    bool
	spreads []connSpread // -plot's, one per interval
}

// newRunRecord returns the record of a run of a fleet of nodes for cfg's
// -timeline and -plot, creating -timeline's file.
func newRunRecord(cfg *fleetsimConfig, nodes int) (*runRecord, error) {
	rec := &runRecord{nodes: nodes, plot: cfg.plot != ""}
	if cfg.timeline != "" {
		var err error
		if rec.csv, rec.done, err = timelineWriter(cfg.timeline); err != nil {
			return nil, err
		}
	}
	return rec, nil
}

// interval is the run's fleetsim.Config.Timeline.
func (rec *runRecord) interval(t int, conns []int) {
	if rec.csv != nil {
		rec.csv(t, conns)
	}
	if rec.plot {
		rec.spreads = append(rec.spreads, spreadOf(t, conns, rec.nodes))
	}
}

// finish ends the record once the run is over.
func (rec *runRecord) finish() error {
	if rec.done == nil {
		return nil
	}
	return rec.done()
}

// connSpread is one interval of a run, summed up: the min, median and
// max connections of the nodes there before the scenario (the slots
// below fleetsim.Config.Nodes) and of the nodes it added (NaN while there
// are none), and the average over every node.
type connSpread struct {
	t          int
	old, added [3]float64
	avg        float64
}

// spreadOf sums up interval t's connections per node, conns, of a fleet
// of nodes before the scenario.
func spreadOf(t int, conns []int, nodes int) connSpread {
	nodes = min(nodes, len(conns))
	s := connSpread{t: t, old: minMedianMax(conns[:nodes]), added: minMedianMax(conns[nodes:]), avg: math.NaN()}
	if len(conns) > 0 {
		sum := 0
		for _, c := range conns {
			sum += c
		}
		s.avg = float64(sum) / float64(len(conns))
	}
	return s
}

// minMedianMax returns the min, median and max of v; NaNs for none.
func minMedianMax(v []int) [3]float64 {
	if len(v) == 0 {
		return [3]float64{math.NaN(), math.NaN(), math.NaN()}
	}
	f := make([]float64, len(v))
	for i, c := range v {
		f[i] = float64(c)
	}
	slices.Sort(f)
	return [3]float64{f[0], median(f), f[len(f)-1]}
}

// Colours of -plot's lines: the old nodes blue, the added ones orange,
// their min and max paler than their median.
var (
	oldMedian   = color.RGBA{0x1f, 0x77, 0xb4, 0xff}
	oldRange    = color.RGBA{0x6f, 0xa8, 0xd6, 0xff}
	addedMedian = color.RGBA{0xff, 0x7f, 0x0e, 0xff}
	addedRange  = color.RGBA{0xff, 0xb5, 0x70, 0xff}
)

// fleetsimChart is -plot's chart of case c's recorded run, r, from its
// spreads: the old and the added nodes' min, median and max connections
// per interval, the average (dashed) and ±threshold around it, and a
// mark where the run converged (and, when the scale-out adds its nodes
// one after another, where the last one joined).
func fleetsimChart(cfg *fleetsimConfig, c *fleetsimCase, r fleetsim.Result, spreads []connSpread) fleet.Chart {
	x, avg := make([]float64, len(spreads)), make([]float64, len(spreads))
	var lines [6][]float64 // old min, median, max, then the added nodes'
	for i, s := range spreads {
		x[i], avg[i] = float64(s.t), s.avg
		for k := range 3 {
			lines[k] = append(lines[k], s.old[k])
			lines[3+k] = append(lines[3+k], s.added[k])
		}
	}
	ch := fleet.Chart{
		Title: fmt.Sprintf("%d nodes × %d connections, ×2 behind a %s balancer, %s view: connections per node",
			c.size, c.conns, c.balancer, c.view),
		XLabel: fmt.Sprintf("interval (%v each)", fleetsim.Interval), YLabel: "connections per node",
		Band: fleet.RelativeBand(x, avg, cfg.params.Threshold), BandLabel: fmt.Sprintf("±%g%% (threshold)", 100*cfg.params.Threshold),
	}
	for _, g := range []struct {
		name           string
		first          int
		median, bounds color.RGBA
	}{{"old", 0, oldMedian, oldRange}, {"added", 3, addedMedian, addedRange}} {
		ch.Series = append(ch.Series,
			fleet.Series{Name: g.name + " nodes: max", X: x, Y: lines[g.first+2], Color: g.bounds},
			fleet.Series{Name: g.name + " nodes: median", X: x, Y: lines[g.first+1], Color: g.median},
			fleet.Series{Name: g.name + " nodes: min", X: x, Y: lines[g.first], Color: g.bounds})
	}
	ch.Series = append(ch.Series, fleet.Series{Name: "average", X: x, Y: avg, Dashed: true})
	if cfg.joinEvery > 0 && c.size > 1 {
		ch.Marks = append(ch.Marks, fleet.ChartMark{X: float64((c.size - 1) * cfg.joinEvery), Label: "last node joins"})
	}
	if r.Converged {
		ch.Marks = append(ch.Marks, fleet.ChartMark{X: float64(r.Intervals), Label: fmt.Sprintf("converged (interval %d)", r.Intervals)})
	}
	return ch
}

// joinNote says how a scale-out adds its nodes.
func joinNote(every int) string {
	if every == 0 {
		return "all at once"
	}
	return fmt.Sprintf("one every %d interval(s)", every)
}

// timelineWriter returns a Timeline callback that writes one CSV line per
// interval (the interval, then every node's connections) to path, and the
// function that flushes and closes it.
func timelineWriter(path string) (func(int, []int), func() error, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, nil, err
	}
	w := bufio.NewWriter(f)
	width := 0
	var line []byte
	record := func(t int, conns []int) {
		if t == 0 {
			width = len(conns)
			line = append(line[:0], "interval"...)
			for i := range conns {
				line = fmt.Appendf(line, ",n%05d", i)
			}
			w.Write(append(line, '\n'))
		}
		line = strconv.AppendInt(line[:0], int64(t), 10)
		for i := range width {
			line = append(line, ',')
			if i < len(conns) {
				line = strconv.AppendInt(line, int64(conns[i]), 10)
			}
		}
		w.Write(append(line, '\n'))
	}
	finish := func() error {
		err := w.Flush()
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		return err
	}
	return record, finish, nil
}

// fleetsimReport renders the tables: one per scenario.
func fleetsimReport(cfg *fleetsimConfig, cmdline string, cases []*fleetsimCase, took time.Duration) string {
	var b strings.Builder
	p := cfg.params
	settle := "freshness"
	if p.JoinSettle != 0 {
		settle = fmt.Sprintf("%d intervals", int(p.JoinSettle/fleetsim.Interval))
	}
	fmt.Fprintf(&b, "# bench fleetsim\n\n`%s` (%v): a simulated fleet, one decision interval at a time, deciding with the rebalance app's rule "+
		"(threshold %.0f%%, stop band %.0f%%, shed rate %.1f%% per interval, min_connections %d, freshness %d intervals, history %d intervals, join_settle %s). "+
		"A scale-out adds its nodes %s; a shed client reconnects within %d interval(s). "+
		"Views: flow, as the rebalance app decides: every node's own gossipavg estimate (the app's settings, %d exchanges per interval, 0.5%% of messages lost) when the app's rule finds it usable, else the tags as below; tags, every other node's smoothed load late by a lag per (observer, member) "+
		"drawn from a lognormal (median and p99 in intervals: %s; measured at 16 and 128 members, extrapolated in log N beyond); exact, the true average. "+
		"Shed clients reconnect through the outer balancer: random (uniform) or leastconn (fewest connections).\n\n",
		cmdline, took.Round(time.Second), 100*p.Threshold, 50*p.Threshold, 100*p.ShedRate, p.MinConnections, int(p.Freshness/fleetsim.Interval), cfg.history, settle,
		joinNote(cfg.joinEvery), cfg.reconnectDelay, shed.AverageTicks, lagNote(cfg))
	b.WriteString("Medians [min–max] over seeds. Converged: every node within ±threshold of the average and none shedding for 10 intervals (the first of them counted from the scenario's start; — when some seed did not within 3000 intervals). " +
		"Shed/conn: connections shed over the connections in the fleet. Shed/ideal: connections shed over the median of a perfect rebalancer's behind the same balancer (shedsim.IdealShedsFor), from the fleet right after the event (a scale-out: all its nodes in, empty, however they join; rolling restart: after the last restart, so the restarts' own repair is not in the ideal). " +
		"Worst node: largest deviation from the average at the end. Oscillating: nodes that shed in two shedding phases separated by a quiet interval. Relanded: share of the shed connections that reconnected to a node shedding in the same interval. From tags: flow's decisions taken from the tags (its average not usable), per node.\n")
	for _, sc := range cfg.scenarios {
		fmt.Fprintf(&b, "\n## %s\n\n", sc)
		b.WriteString("| nodes | conns/node | view | balancer | converged | intervals to converge | shed/conn | shed/ideal | worst node | oscillating nodes | relanded | from tags |\n")
		b.WriteString("| --: | --: | :-- | :-- | --: | --: | --: | --: | --: | --: | --: | --: |\n")
		for _, c := range cases {
			if c.scenario != sc {
				continue
			}
			var iv, perConn, ratio, worst, osc, reland, fromTags []float64
			conv := 0
			for _, r := range c.results {
				if r.Converged {
					conv++
					iv = append(iv, float64(r.Intervals))
				}
				perConn = append(perConn, float64(r.Shed)/float64(r.Total))
				ratio = append(ratio, r.Ratio)
				worst = append(worst, 100*r.Worst)
				osc = append(osc, float64(r.Oscillating))
				rl := math.NaN()
				if r.Shed > 0 {
					rl = 100 * float64(r.Relanded) / float64(r.Shed)
				}
				reland = append(reland, rl)
				fromTags = append(fromTags, float64(r.TagDecisions)/float64(max(r.Nodes, 1)))
			}
			ivs := "—"
			if conv == len(c.results) {
				ivs = fmtStat(statOf(iv), func(v float64) string { return fmt.Sprintf("%.0f", v) })
			}
			fmt.Fprintf(&b, "| %d | %d | %s | %s | %d/%d | %s | %s | %s | %s | %s | %s | %s |\n", c.size, c.conns, c.view, c.balancer, conv, len(c.results), ivs,
				fmtStat(statOf(perConn), func(v float64) string { return fmt.Sprintf("%.2f", v) }),
				fmtStat(statOf(ratio), func(v float64) string { return fmt.Sprintf("%.2f", v) }),
				fmtStat(statOf(worst), func(v float64) string { return fmt.Sprintf("%.1f%%", v) }),
				fmtStat(statOf(osc), func(v float64) string { return fmt.Sprintf("%.0f", v) }),
				fmtStat(statOf(reland), func(v float64) string { return fmt.Sprintf("%.0f%%", v) }),
				fmtStat(statOf(fromTags), func(v float64) string { return fmt.Sprintf("%.1f", v) }))
		}
	}
	return b.String()
}

// lagNote lists the tag lag used at each size of the run.
func lagNote(cfg *fleetsimConfig) string {
	var parts []string
	for _, n := range cfg.sizes {
		for _, m := range []int{n, 2 * n} {
			med, p99 := fleetsim.TagLag(m)
			parts = append(parts, fmt.Sprintf("%d members %.2f/%.2f", m, med, p99))
		}
	}
	return strings.Join(parts, ", ")
}
