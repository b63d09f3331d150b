package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"

	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/internal/serfnet"
	"github.com/caddy-lbx/lbx/internal/shed"
)

// bench gossip measures how the rebalance app's load reports travel
// through serf as the cluster grows: many real serf members in this
// process on 127.0.0.1, with the cluster app's serf and memberlist
// settings (serfnet.Config), each publishing a changing load in the
// app's tag format every interval, as the app does (SetTags from one
// loop per member, which waits for the broadcast). It reports, per size:
// how long a new report takes to reach half, 99% and all of the other
// members; the share of member pairs whose view is stale by the app's
// freshness rule (no change seen for freshness); the error of each
// member's cluster average against the true one; what each member sends
// (bytes and packets, counted at the transport); CPU per member; and how
// long SetTags blocked.
//
// With -scheme flow the loads travel otherwise: each member averages them
// with gossipavg over direct messages (gossipflow.go) with the app's
// settings (shed.AverageConfig, shed.AverageTicks exchanges per
// interval), and the tags carry no load. It reports each member's error
// of the cluster average and size, whether it knows the lowest member,
// and the same traffic and CPU figures.
//
// -scheme app is what the rebalance app does: the flow scheme's
// averaging, plus load tags published by the app's rule
// (shed.LoadTagDue: on a change of more than 5%, else every
// freshness/2). It reports the averaging's figures, the tags' reach and
// staleness, and the traffic of both together.
//
// In every scheme the loads drift (a sine of ±40% over 20–60 s per
// member) for the first half of the window; then they stop drifting and
// half the members lose 20% at once: the step, which each member takes
// in at its next publication (within an interval, as the app samples its
// load once per interval). Settle is the time from the step until 99% of
// the members' cluster averages are within 1% of the true one, and stays
// so.
//
// With -plot it also draws these times (tag reach, settle) against the
// cluster size, as a PNG.

// gossipConfig is the command's flags.
type gossipConfig struct {
	sizes     []int
	interval  time.Duration
	freshness time.Duration
	warmup    time.Duration
	duration  time.Duration
	seed      uint64
	scheme    string // "tags", "flow" or "app"
	plot      string // the -plot PNG file, as given (empty: none)
}

func parseGossipFlags(args []string, stderr io.Writer) (*gossipConfig, error) {
	fs := flag.NewFlagSet("bench gossip", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sizes := fs.String("sizes", "16,32,64,128", "cluster sizes, comma-separated (2 to 1024)")
	cfg := &gossipConfig{}
	fs.DurationVar(&cfg.interval, "interval", time.Second, "publication interval (the rebalance app's interval; its default)")
	fs.DurationVar(&cfg.freshness, "freshness", 5*time.Second, "the freshness rule (the app's default: 5 × interval)")
	fs.DurationVar(&cfg.warmup, "warmup", 5*time.Second, "unmeasured time after the cluster converged")
	fs.DurationVar(&cfg.duration, "duration", 20*time.Second, "measured window per size")
	fs.Uint64Var(&cfg.seed, "seed", 1, "seed of the loads and publication phases")
	fs.StringVar(&cfg.scheme, "scheme", "tags", "how loads travel: tags (serf tags every interval, as the app did before the gossip average), flow (gossipavg over direct messages), or app (flow, plus tags by the app's rule)")
	fs.StringVar(&cfg.plot, "plot", "", "draw the report age (tag reach, settle) against the cluster size to this PNG file, relative to the lbx module's root (empty: none)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	for _, f := range strings.Split(*sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 2 || n > 1024 {
			return nil, fmt.Errorf("-sizes: %q is not a size from 2 to 1024", f)
		}
		cfg.sizes = append(cfg.sizes, n)
	}
	switch {
	case cfg.interval < 100*time.Millisecond || cfg.interval > time.Minute:
		return nil, fmt.Errorf("-interval %v: want 100ms to 1m", cfg.interval)
	case cfg.freshness < cfg.interval:
		return nil, fmt.Errorf("-freshness %v: want at least -interval", cfg.freshness)
	case cfg.duration < 2*cfg.interval || cfg.duration > time.Hour:
		return nil, fmt.Errorf("-duration %v: want 2 intervals to 1h", cfg.duration)
	case cfg.warmup < 0 || cfg.warmup > time.Hour:
		return nil, fmt.Errorf("-warmup %v: want 0 to 1h", cfg.warmup)
	case cfg.scheme != "tags" && cfg.scheme != "flow" && cfg.scheme != "app":
		return nil, fmt.Errorf("-scheme %q: want tags, flow or app", cfg.scheme)
	case cfg.plot != "" && !isPNGPath(cfg.plot):
		return nil, fmt.Errorf("-plot %q: want a .png file", cfg.plot)
	}
	return cfg, nil
}

// gossipResult is one size's figures.
type gossipResult struct {
	n                        int
	reports                  int
	reach50, reach99, reach1 stat // ms, over reports; reach1 over those that reached all
	neverAll                 float64
	stalePct                 stat // over samples
	viewAge                  stat // ms, over samples: mean age of the reports in view
	avgErrPct                stat // over samples × members
	bytesPerSec, pktsPerSec  stat // per member
	cpuPct                   float64
	setTags                  stat // ms
	setTagsTimeouts          int
	// settle is the time from the step until 99% of the members' averages
	// were within 1% and stayed so (ms); settled false when they never
	// were by the end of the window.
	settle  float64
	settled bool
	// flow only: each member's error of the cluster size (percent, over
	// samples × members), and the share of members that know the lowest
	// member (percent, over samples).
	sizeErrPct, lowestPct stat
}

func runGossip(ctx context.Context, args []string, cmdline string, out, progress io.Writer) error {
	cfg, err := parseGossipFlags(args, progress)
	if err != nil {
		return err
	}
	plotFile, err := plotPath(ctx, cfg.plot)
	if err != nil {
		return err
	}
	began := time.Now()
	var results []gossipResult
	var failed error
	for _, n := range cfg.sizes {
		fmt.Fprintf(progress, "gossip: %d members …\n", n)
		r, err := measureGossip(ctx, cfg, n, progress)
		if err != nil {
			// The sizes measured so far are still reported.
			failed = fmt.Errorf("%d members: %w", n, err)
			break
		}
		results = append(results, r)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# bench gossip\n\n`%s`: real serf members in one process on 127.0.0.1 with the cluster app's settings, each publishing its load every %v; freshness %v; %v warm-up, %v window.\n\n", cmdline, cfg.interval, cfg.freshness, cfg.warmup, cfg.duration)
	msf := func(v float64) string { return fmt.Sprintf("%.0f ms", v) }
	pct := func(v float64) string { return fmt.Sprintf("%.1f%%", v) }
	num := func(v float64) string { return fmt.Sprintf("%.0f", v) }
	settle := func(r gossipResult) string {
		if !r.settled {
			return fmt.Sprintf("> %.0f ms", r.settle)
		}
		return msf(r.settle)
	}
	switch cfg.scheme {
	case "app":
		fmt.Fprintf(&b, "Scheme app: the gossip average as in scheme flow (an exchange every %v per member), plus load tags on a change of more than 5%%, else every freshness/2, as the rebalance app publishes them.\n\n", cfg.interval/shed.AverageTicks)
		b.WriteString("Medians [min–max]. Average error is of the gossip average while the loads drift; settle is after the step. Tag reach and stale are of the load tags, as in scheme tags.\n\n")
		b.WriteString("| members | average error | settle after the step | size error | lowest known | tag reports | tag reach 99% | tags stale | bytes/s sent | packets/s sent | CPU per member |\n")
		b.WriteString("| --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |\n")
		for _, r := range results {
			fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %d | %s | %s | %s | %s | %.2f%% |\n",
				r.n, fmtStat(r.avgErrPct, pct), settle(r), fmtStat(r.sizeErrPct, pct), fmtStat(r.lowestPct, pct),
				r.reports, fmtStat(r.reach99, msf), fmtStat(r.stalePct, pct),
				fmtStat(r.bytesPerSec, num), fmtStat(r.pktsPerSec, num), r.cpuPct)
		}
	case "flow":
		fmt.Fprintf(&b, "Scheme flow: gossipavg over direct messages, with the rebalance app's settings (an exchange every %v per member); the tags carry no load.\n\n", cfg.interval/shed.AverageTicks)
		b.WriteString("Medians [min–max] over samples × members (errors), samples (lowest known, view age) or members (traffic). Average error is while the loads drift; settle is after the step.\n\n")
		b.WriteString("| members | average error | settle after the step | size error | lowest known | last exchange age | bytes/s sent | packets/s sent | CPU per member |\n")
		b.WriteString("| --: | --: | --: | --: | --: | --: | --: | --: | --: |\n")
		for _, r := range results {
			fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %s | %.2f%% |\n",
				r.n, fmtStat(r.avgErrPct, pct), settle(r), fmtStat(r.sizeErrPct, pct), fmtStat(r.lowestPct, pct), fmtStat(r.viewAge, msf),
				fmtStat(r.bytesPerSec, num), fmtStat(r.pktsPerSec, num), r.cpuPct)
		}
	default:
		b.WriteString("Medians [min–max] over reports (reach), samples (stale, view age, average error) or members (traffic). Reach: time from SetTags to the other members' first sight of that report or a newer one. Average error is while the loads drift; settle is after the step.\n\n")
		b.WriteString("| members | reports | reach 50% | reach 99% | reach 100% | never all | stale | view age | average error | settle after the step | bytes/s sent | packets/s sent | CPU per member | SetTags | SetTags timeouts |\n")
		b.WriteString("| --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |\n")
		for _, r := range results {
			fmt.Fprintf(&b, "| %d | %d | %s | %s | %s | %.1f%% | %s | %s | %s | %s | %s | %s | %.2f%% | %s | %d |\n",
				r.n, r.reports, fmtStat(r.reach50, msf), fmtStat(r.reach99, msf), fmtStat(r.reach1, msf), r.neverAll,
				fmtStat(r.stalePct, pct), fmtStat(r.viewAge, msf), fmtStat(r.avgErrPct, pct), settle(r),
				fmtStat(r.bytesPerSec, num), fmtStat(r.pktsPerSec, num), r.cpuPct, fmtStat(r.setTags, msf), r.setTagsTimeouts)
		}
	}
	fmt.Fprintf(&b, "\nTotal %v.\n", time.Since(began).Round(time.Second))
	if failed != nil {
		fmt.Fprintf(&b, "\nStopped: %v.\n", failed)
	}
	if _, err := io.WriteString(out, b.String()); err != nil {
		return err
	}
	if plotFile != "" && len(results) > 0 {
		if err := writePNGFile(plotFile, gossipChart(cfg, results).WritePNG); err != nil {
			return err
		}
		fmt.Fprintf(out, "\nPlot: %s\n", cfg.plot)
	}
	return failed
}

// gossipChart is -plot's chart: the report age against the cluster size,
// a line per figure the scheme measures: the tag reports' reach to 50%
// and 99% of the other members (and 100%, with tags), medians; and, with
// flow and app, the gossip average's settle time after the step (left
// out at the sizes where it did not settle within the window).
func gossipChart(cfg *gossipConfig, results []gossipResult) fleet.Chart {
	c := fleet.Chart{
		Title:  fmt.Sprintf("bench gossip, scheme %s, interval %v: report age against cluster size", cfg.scheme, cfg.interval),
		XLabel: "members (log scale)", YLabel: "milliseconds", LogX: true,
	}
	add := func(name string, y func(gossipResult) float64) {
		s := fleet.Series{Name: name, Points: true}
		for _, r := range results {
			s.X, s.Y = append(s.X, float64(r.n)), append(s.Y, y(r))
		}
		c.Series = append(c.Series, s)
	}
	if cfg.scheme != "flow" {
		add("tag reach 50% (median)", func(r gossipResult) float64 { return r.reach50.Median })
		add("tag reach 99% (median)", func(r gossipResult) float64 { return r.reach99.Median })
	}
	if cfg.scheme == "tags" {
		add("tag reach 100% (median)", func(r gossipResult) float64 { return r.reach1.Median })
	}
	if cfg.scheme != "tags" {
		add("settle after the step", func(r gossipResult) float64 {
			if !r.settled {
				return math.NaN()
			}
			return r.settle
		})
	}
	return c
}

// gossipMember is one serf member of the harness and what it saw.
type gossipMember struct {
	serf *serf.Serf
	net  *countingTransport
	flow *flowMember // the flow scheme's averaging; nil with tags

	mu       sync.Mutex
	seenSeq  []int       // by member index: the last report seen
	seenLoad []float64   // its load
	seenAt   []time.Time // when its sequence last changed
}

// gossipRun is the shared state of one size's run.
type gossipRun struct {
	cfg     *gossipConfig
	n       int
	names   map[string]int
	members []*gossipMember

	mu        sync.Mutex
	pubAt     [][]time.Time // [member][seq]: when SetTags was called
	pubLoad   [][]float64   // [member][seq]: the load that report carried
	latest    []float64     // [member]: its load now
	arrivals  [][][]float64 // [member][seq]: ms to each observer that saw it (or a newer one) first
	measureAt time.Time     // reports published from then on are measured
	setTags   []float64
	timeouts  int
}

// lateReportGrace is the longest a load tag takes to reach every member
// on a loaded machine: serf's 2 s broadcast timeout (cluster), which a tag
// update can wait behind, and a second; TestGossipSmall bounds a report's
// reach by the same.
const lateReportGrace = 3 * time.Second

func measureGossip(ctx context.Context, cfg *gossipConfig, n int, progress io.Writer) (gossipResult, error) {
	run := &gossipRun{cfg: cfg, n: n, names: map[string]int{}, pubAt: make([][]time.Time, n), pubLoad: make([][]float64, n),
		latest: make([]float64, n), arrivals: make([][][]float64, n)}
	stopEvents := make(chan struct{})
	var events sync.WaitGroup
	defer func() {
		close(stopEvents)
		var wg sync.WaitGroup
		for _, m := range run.members {
			wg.Add(1)
			go func() { defer wg.Done(); _ = m.serf.Shutdown() }()
		}
		wg.Wait()
		events.Wait()
	}()
	for i := range n {
		run.names[run.nameOf(i)] = i
	}
	for i := range n {
		m, err := run.start(i, stopEvents, &events)
		if err != nil {
			return gossipResult{}, err
		}
		run.members = append(run.members, m)
	}
	seedAddr := fmt.Sprintf("127.0.0.1:%d", run.members[0].net.port)
	for i, m := range run.members[1:] {
		if _, err := m.serf.Join([]string{seedAddr}, true); err != nil {
			return gossipResult{}, fmt.Errorf("member %d joining: %v", i+1, err)
		}
	}
	deadline := time.Now().Add(60*time.Second + time.Duration(n)*200*time.Millisecond)
	for {
		fewest, short := n, 0
		for _, m := range run.members {
			if k := m.serf.NumNodes(); k != n {
				fewest, short = min(fewest, k), short+1
			}
		}
		if short == 0 {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return gossipResult{}, fmt.Errorf("the members did not all see each other before %v: %d of %d see fewer, the fewest %d",
				deadline.Format(time.TimeOnly), short, n, fewest)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// Publication: one loop per member, at a random phase, as the app's
	// publishLoop (SetTags waits for the broadcast, up to its timeout).
	rng := rand.New(rand.NewPCG(cfg.seed, uint64(n)))
	phases, periods := make([]float64, n), make([]float64, n)
	for i := range n {
		phases[i], periods[i] = rng.Float64()*2*math.Pi, 20+rng.Float64()*40
	}
	start := time.Now()
	run.measureAt = start.Add(cfg.warmup)
	end := run.measureAt.Add(cfg.duration)
	stepAt := run.measureAt.Add(cfg.duration / 2)
	// loadAt is member i's load at t: drifting until the step, then
	// still, and 20% lower on every other member.
	loadAt := func(i int, t time.Time) float64 {
		still := t
		if still.After(stepAt) {
			still = stepAt
		}
		el := still.Sub(start).Seconds()
		load := 1000 + 400*math.Sin(phases[i]+2*math.Pi*el/periods[i])
		if !t.Before(stepAt) && i%2 == 0 {
			load *= 0.8
		}
		return load
	}
	pubCtx, stopPub := context.WithCancel(ctx)
	var pubs sync.WaitGroup
	for i, m := range run.members {
		pubs.Add(1)
		go func() {
			defer pubs.Done()
			t := time.NewTimer(time.Duration(float64(cfg.interval) * float64(i) / float64(n)))
			defer t.Stop()
			since, published := 0, 0.0 // the app's tag rule (shed.LoadTagDue)
			for {
				select {
				case <-pubCtx.Done():
					return
				case <-t.C:
				}
				t.Reset(cfg.interval)
				load := loadAt(i, time.Now())
				run.mu.Lock()
				run.latest[i] = load
				run.mu.Unlock()
				if m.flow != nil {
					m.flow.setLoad(i, load)
				}
				switch {
				case cfg.scheme == "flow":
					continue
				case cfg.scheme == "app" && !shed.LoadTagDue(since, published, load, cfg.interval, cfg.freshness):
					since++
					continue
				}
				since, published = 1, load
				run.mu.Lock()
				run.pubAt[i] = append(run.pubAt[i], time.Now())
				run.pubLoad[i] = append(run.pubLoad[i], load)
				run.arrivals[i] = append(run.arrivals[i], nil)
				seq := len(run.pubAt[i])
				run.mu.Unlock()
				began := time.Now()
				err := m.serf.SetTags(map[string]string{"role": "edge", shed.LoadTag: shed.FormatLoadReport("conns", load, uint64(seq))})
				if time.Now().After(run.measureAt) && time.Now().Before(end) {
					run.mu.Lock()
					run.setTags = append(run.setTags, float64(time.Since(began))/1e6)
					if err != nil {
						run.timeouts++
					}
					run.mu.Unlock()
				}
			}
		}()
	}

	if cfg.scheme != "tags" {
		for _, m := range run.members {
			pubs.Add(1)
			go func() {
				defer pubs.Done()
				m.flow.tickLoop(m.serf, cfg.interval/shed.AverageTicks, pubCtx.Done())
			}()
		}
	}
	// Samples of every member's view, and the process's CPU and traffic.
	var stale, ages, errs, sizeErrs, lowest []float64
	// settleAt is the first sample after the step from which on 99% of
	// the members' averages were within 1%.
	var settleAt time.Time
	select {
	case <-ctx.Done():
	case <-time.After(time.Until(run.measureAt)):
	}
	cpu0 := processCPU()
	sent0 := run.traffic()
	t0 := time.Now()
	tick := time.NewTicker(250 * time.Millisecond)
	for now := time.Now(); now.Before(end) && ctx.Err() == nil; now = <-tick.C {
		var e []float64
		if cfg.scheme != "flow" {
			var s, a float64
			s, a, e = run.sample(now, cfg.freshness)
			stale = append(stale, s)
			if cfg.scheme == "tags" {
				ages = append(ages, a)
			}
		}
		if cfg.scheme != "tags" {
			var se []float64
			var low, a float64
			e, se, low, a = run.sampleFlow(now)
			sizeErrs, lowest, ages = append(sizeErrs, se...), append(lowest, low), append(ages, a)
		}
		if now.Before(stepAt) {
			errs = append(errs, e...)
			continue
		}
		if p99 := quantile(e, 0.99); p99 > 1 {
			settleAt = time.Time{}
		} else if settleAt.IsZero() {
			settleAt = now
		}
	}
	tick.Stop()
	elapsed := time.Since(t0).Seconds()
	cpu := (processCPU() - cpu0).Seconds()
	sent1 := run.traffic()
	// Reports of the window get until a freshness after it to arrive, and
	// at least lateReportGrace: a report published at the window's end may
	// wait that long behind the member's previous tag update, and would
	// otherwise count as never reaching all, not as late (its lateness
	// shows in the reach statistics). The members go on publishing
	// meanwhile, as the app never stops: a window's report whose gossip was
	// lost reaches an observer with the next one (the keep-alive), as it
	// would in the app, instead of never for want of a next one.
	time.Sleep(min(max(cfg.freshness, lateReportGrace), 5*time.Second))
	stopPub()
	pubs.Wait()
	if ctx.Err() != nil {
		return gossipResult{}, ctx.Err()
	}

	r := gossipResult{n: n, stalePct: statOf(stale), viewAge: statOf(ages), avgErrPct: statOf(errs), cpuPct: 100 * cpu / elapsed / float64(n),
		sizeErrPct: statOf(sizeErrs), lowestPct: statOf(lowest)}
	r.settled = !settleAt.IsZero()
	if r.settled {
		r.settle = float64(settleAt.Sub(stepAt)) / 1e6
	} else {
		r.settle = float64(end.Sub(stepAt)) / 1e6
	}
	bps, pps := make([]float64, n), make([]float64, n)
	for i := range n {
		bps[i] = float64(sent1[i].bytes-sent0[i].bytes) / elapsed
		pps[i] = float64(sent1[i].packets-sent0[i].packets) / elapsed
	}
	r.bytesPerSec, r.pktsPerSec = statOf(bps), statOf(pps)
	run.mu.Lock()
	defer run.mu.Unlock()
	r.setTags, r.setTagsTimeouts = statOf(run.setTags), run.timeouts
	var r50, r99, r100 []float64
	never := 0
	for i := range n {
		for s, at := range run.pubAt[i] {
			if at.Before(run.measureAt) || !at.Before(end) {
				continue
			}
			r.reports++
			arr := slices.Clone(run.arrivals[i][s])
			slices.Sort(arr)
			others := n - 1
			q := func(f float64) (float64, bool) {
				k := int(math.Ceil(f*float64(others))) - 1
				if k >= len(arr) {
					return 0, false
				}
				return arr[k], true
			}
			if v, ok := q(0.5); ok {
				r50 = append(r50, v)
			}
			if v, ok := q(0.99); ok {
				r99 = append(r99, v)
			}
			if v, ok := q(1); ok {
				r100 = append(r100, v)
			} else {
				never++
			}
		}
	}
	r.reach50, r.reach99, r.reach1 = statOf(r50), statOf(r99), statOf(r100)
	if r.reports > 0 {
		r.neverAll = 100 * float64(never) / float64(r.reports)
	}
	if cfg.scheme != "tags" {
		fmt.Fprintf(progress, "gossip: %d members: average error %.2f%% (max %.1f%%), settled %v after %.0f ms, size error %.1f%%; %.0f B/s per member; CPU %.2f%% per member\n",
			n, r.avgErrPct.Median, r.avgErrPct.Max, r.settled, r.settle, r.sizeErrPct.Median, r.bytesPerSec.Median, r.cpuPct)
	} else {
		fmt.Fprintf(progress, "gossip: %d members: %d reports, reach 50%% %.0f ms, 99%% %.0f ms; stale %.1f%%; settled %v after %.0f ms; %.0f B/s per member; CPU %.2f%% per member\n",
			n, r.reports, r.reach50.Median, r.reach99.Median, r.stalePct.Median, r.settled, r.settle, r.bytesPerSec.Median, r.cpuPct)
	}
	return r, nil
}

// start creates member i with the app's settings and a counting
// transport, and its event loop.
func (run *gossipRun) start(i int, stop <-chan struct{}, events *sync.WaitGroup) (*gossipMember, error) {
	nt, err := memberlist.NewNetTransport(&memberlist.NetTransportConfig{BindAddrs: []string{"127.0.0.1"}, BindPort: 0, Logger: nil})
	if err != nil {
		return nil, err
	}
	ct := newCountingTransport(nt)
	conf := serfnet.Config(run.nameOf(i), "127.0.0.1", ct.port)
	conf.LogOutput = io.Discard
	conf.MemberlistConfig.LogOutput = io.Discard
	conf.MemberlistConfig.Transport = ct
	conf.MemberlistConfig.AdvertiseAddr = "127.0.0.1"
	conf.MemberlistConfig.AdvertisePort = ct.port
	ch := make(chan serf.Event, 4096)
	conf.EventCh = ch
	m := &gossipMember{net: ct, seenSeq: make([]int, run.n), seenLoad: make([]float64, run.n), seenAt: make([]time.Time, run.n)}
	if run.cfg.scheme != "tags" {
		if m.flow, err = newFlowMember(i, run, conf, ct, run.cfg); err != nil {
			_ = nt.Shutdown()
			return nil, err
		}
	}
	s, err := serf.Create(conf)
	if err != nil {
		_ = conf.MemberlistConfig.Transport.Shutdown()
		return nil, err
	}
	m.serf = s
	if m.flow != nil {
		m.flow.start(s)
	}
	events.Add(1)
	go func() {
		defer events.Done()
		for {
			select {
			case <-stop:
				return
			case e := <-ch:
				if me, ok := e.(serf.MemberEvent); ok {
					run.saw(i, m, me.Members, time.Now())
				}
			}
		}
	}()
	return m, nil
}

// saw records what observer i (member m) learnt from an event at now.
func (run *gossipRun) saw(i int, m *gossipMember, members []serf.Member, now time.Time) {
	for _, mem := range members {
		j, ok := run.names[mem.Name]
		if !ok || j == i {
			continue
		}
		f := strings.Fields(mem.Tags[shed.LoadTag])
		if len(f) != 3 {
			continue
		}
		seq, err := strconv.Atoi(f[2])
		load, err2 := strconv.ParseFloat(f[1], 64)
		if err != nil || err2 != nil {
			continue
		}
		m.mu.Lock()
		prev := m.seenSeq[j]
		if seq > prev {
			m.seenSeq[j], m.seenLoad[j], m.seenAt[j] = seq, load, now
		}
		m.mu.Unlock()
		if seq <= prev {
			continue
		}
		// This report, and any it superseded unseen, reached i now.
		run.mu.Lock()
		for s := prev + 1; s <= seq && s <= len(run.pubAt[j]); s++ {
			run.arrivals[j][s-1] = append(run.arrivals[j][s-1], float64(now.Sub(run.pubAt[j][s-1]))/1e6)
		}
		run.mu.Unlock()
	}
}

// sample returns, at now, the share of (observer, member) pairs that are
// stale by the freshness rule (in percent), the mean age of the reports in
// view (ms), and each observer's error of the cluster average against
// the true one (the latest published loads), in percent.
func (run *gossipRun) sample(now time.Time, freshness time.Duration) (stalePct, ageMs float64, errPct []float64) {
	truth := run.truth()
	run.mu.Lock()
	pubAt := make([][]time.Time, run.n)
	var trueSum float64
	for j := range run.n {
		trueSum += truth[j]
		pubAt[j] = run.pubAt[j]
	}
	run.mu.Unlock()
	trueAvg := trueSum / float64(run.n)
	var staleN, pairs int
	var ageSum float64
	for i, m := range run.members {
		m.mu.Lock()
		sum := truth[i] // its own load it knows
		for j := range run.n {
			if j == i {
				continue
			}
			pairs++
			if m.seenSeq[j] == 0 || now.Sub(m.seenAt[j]) > freshness {
				staleN++
			}
			if s := m.seenSeq[j]; s > 0 && s <= len(pubAt[j]) {
				ageSum += float64(now.Sub(pubAt[j][s-1])) / 1e6
			}
			sum += m.seenLoad[j]
		}
		m.mu.Unlock()
		if trueAvg > 0 {
			errPct = append(errPct, 100*math.Abs(sum/float64(run.n)-trueAvg)/trueAvg)
		}
	}
	return 100 * float64(staleN) / float64(pairs), ageSum / float64(pairs), errPct
}

// truth returns every member's latest load.
func (run *gossipRun) truth() []float64 {
	run.mu.Lock()
	defer run.mu.Unlock()
	return slices.Clone(run.latest)
}

// nameOf returns member j's node name.
func (run *gossipRun) nameOf(j int) string { return fmt.Sprintf("g%04d", j) }

// sentCount is what one member sent.
type sentCount struct{ bytes, packets int64 }

func (run *gossipRun) traffic() []sentCount {
	out := make([]sentCount, len(run.members))
	for i, m := range run.members {
		out[i] = sentCount{m.net.bytes.Load(), m.net.packets.Load()}
	}
	return out
}

// countingTransport is memberlist's network transport, counting what the
// member sends: UDP packets and their bytes, and the bytes it writes on
// TCP streams (push-pull state exchanges), dialled or accepted.
type countingTransport struct {
	*memberlist.NetTransport
	port           int
	bytes, packets atomic.Int64
	streams        chan net.Conn
	done           chan struct{} // closed when Shutdown starts
	netDown        chan struct{} // closed once the NetTransport has shut down
	forwarded      chan struct{} // closed when the stream forwarder ends
	stopOnce       sync.Once
	stopErr        error
}

func newCountingTransport(nt *memberlist.NetTransport) *countingTransport {
	t := &countingTransport{NetTransport: nt, port: nt.GetAutoBindPort(), streams: make(chan net.Conn),
		done: make(chan struct{}), netDown: make(chan struct{}), forwarded: make(chan struct{})}
	// The forwarder reads the NetTransport's streams until it has shut
	// down: its listener hands over every connection it accepts before it
	// ends, so a forwarder that stopped at Shutdown would block it (a
	// push-pull arriving during teardown hung the harness at 256 members).
	go func() {
		defer close(t.forwarded)
		for {
			select {
			case <-t.netDown:
				return
			case c := <-nt.StreamCh():
				select {
				case t.streams <- &countingConn{Conn: c, t: t}:
				case <-t.done:
					c.Close()
				}
			}
		}
	}()
	return t
}

// Shutdown implements memberlist.Transport.
func (t *countingTransport) Shutdown() error {
	t.stopOnce.Do(func() {
		close(t.done)
		t.stopErr = t.NetTransport.Shutdown()
		close(t.netDown)
		<-t.forwarded
	})
	return t.stopErr
}

// WriteTo implements memberlist.Transport.
func (t *countingTransport) WriteTo(b []byte, addr string) (time.Time, error) {
	t.packets.Add(1)
	t.bytes.Add(int64(len(b)))
	return t.NetTransport.WriteTo(b, addr)
}

// WriteToAddress implements memberlist.NodeAwareTransport.
func (t *countingTransport) WriteToAddress(b []byte, addr memberlist.Address) (time.Time, error) {
	return t.WriteTo(b, addr.Addr)
}

// DialTimeout implements memberlist.Transport.
func (t *countingTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	c, err := t.NetTransport.DialTimeout(addr, timeout)
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, t: t}, nil
}

// DialAddressTimeout implements memberlist.NodeAwareTransport.
func (t *countingTransport) DialAddressTimeout(addr memberlist.Address, timeout time.Duration) (net.Conn, error) {
	return t.DialTimeout(addr.Addr, timeout)
}

// StreamCh implements memberlist.Transport.
func (t *countingTransport) StreamCh() <-chan net.Conn { return t.streams }

// countingConn counts the bytes written on a stream.
type countingConn struct {
	net.Conn
	t *countingTransport
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.t.bytes.Add(int64(n))
	return n, err
}

// quantile returns the q-quantile of v by nearest rank (the smallest
// value with at least q of v at or below it); NaN for no values. v is
// reordered.
func quantile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	slices.Sort(v)
	return v[max(0, int(math.Ceil(q*float64(len(v))))-1)]
}
