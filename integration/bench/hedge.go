package main

// `bench hedge` measures the selective handler's backup requests: the same
// pool behind Caddy with lb_policy ewma alone, behind a selective with one
// group (no backup requests), and behind the same selective with
// backup_request set near the healthy p95, side by side over seeds, under
// GC-like freezes. It reports the tail latency and the extra requests the
// backups cost.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// hedgeVariant is one freeze pattern.
type hedgeVariant struct {
	name, about string
	models      []loadmodel.Model
}

func hedgeVariants() []hedgeVariant {
	oneFreezes := pool(4, classService)
	oneFreezes[3].Freeze = loadmodel.Freeze{Every: 2 * time.Second, Min: 50 * time.Millisecond, Max: 150 * time.Millisecond}
	rare := pool(4, classService)
	for i := range rare {
		rare[i].Freeze = loadmodel.Freeze{Every: 8 * time.Second, Min: 100 * time.Millisecond, Max: 200 * time.Millisecond}
	}
	return []hedgeVariant{
		{"hedge-1of4-freezes", "1 of 4 backends freezes 50–150 ms about every 2 s (GC pauses on one machine)", oneFreezes},
		{"hedge-rare-freezes", "every backend freezes 100–200 ms about every 8 s, each on its own schedule (rare GC pauses everywhere)", rare},
	}
}

// hedgeConfig is `bench hedge`'s configuration.
type hedgeConfig struct {
	seeds             int
	warmup, duration  time.Duration
	timeout           time.Duration
	backup            time.Duration
	budget            float64
	utilization       float64
	caddyBin, variant string
}

func parseHedgeFlags(args []string, stderr io.Writer) (*hedgeConfig, error) {
	fs := flag.NewFlagSet("bench hedge", flag.ContinueOnError)
	fs.SetOutput(stderr)
	c := &hedgeConfig{}
	fs.IntVar(&c.seeds, "seeds", 3, "seeds per variant")
	fs.DurationVar(&c.warmup, "warmup", defaultScenWarmup, "unmeasured warm-up before each window")
	fs.DurationVar(&c.duration, "duration", defaultScenDuration, "measured window per case")
	fs.DurationVar(&c.timeout, "timeout", 2*time.Second, "client timeout")
	fs.DurationVar(&c.backup, "backup", 10*time.Millisecond, "backup_request of the hedged case (near the healthy p95: 4 ms backends at 65% busy)")
	fs.Float64Var(&c.budget, "budget", 10, "backup_budget, percent")
	fs.Float64Var(&c.utilization, "load", 0.65, "utilization the rate aims at")
	fs.StringVar(&c.caddyBin, "caddy", "", "a Caddy binary built with lbx (default: build ./cmd/caddy)")
	fs.StringVar(&c.variant, "variants", "all", "hedge-1of4-freezes, hedge-rare-freezes or all")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if c.seeds < 1 || c.duration <= 0 || c.backup <= 0 || c.budget <= 0 || c.budget > 100 || c.utilization <= 0 || c.utilization >= 1 {
		return nil, errors.New("bench hedge: -seeds ≥ 1, -duration and -backup > 0, 0 < -budget ≤ 100, 0 < -load < 1")
	}
	return c, nil
}

// hedgePolicies are the contenders: the same pool and policy, without and
// with the selective handler, and with backup requests.
func hedgePolicies() []policy {
	return []policy{
		{key: "ewma", label: "lbx ewma (no selective)", kind: kindCaddy, caddyPolicy: "ewma"},
		{key: "selective", label: "selective, no backup", kind: kindCaddy, caddyPolicy: "ewma", selective: true},
		{key: "selective_backup", label: "selective, backup_request", kind: kindCaddy, caddyPolicy: "ewma", selective: true, backup: true},
	}
}

// hedgeRow is a policy's result over the seeds of a variant: the scenario
// classes' aggregate, and the extra requests backups cost.
type hedgeRow struct {
	scenRow
	extraPct stat
}

func runHedge(ctx context.Context, args []string, cmdline string, out, progress io.Writer) error {
	cfg, err := parseHedgeFlags(args, progress)
	if err != nil {
		return err
	}
	began := time.Now()
	tmp, err := os.MkdirTemp("", "lbx-bench-hedge-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	t, source, versions, _, pols, err := setupTools(ctx, cfg.caddyBin, hedgePolicies(), tmp, progress)
	if err != nil {
		return err
	}
	rate := math.Round(cfg.utilization * 4 * cap4ms)
	var b strings.Builder
	fmt.Fprintf(&b, "# bench hedge\n\n`%s`; %s; Go %s, Caddy %s. 4 backends of 1 worker, 4 ms ± 25%%, open loop at %.0f req/s (%.0f%% busy), %d seeds, %v warm-up, %v window; backup_request %v, backup_budget %g%%.\n\n",
		cmdline, source, versions["go"], versions["caddy"], rate, 100*cfg.utilization, cfg.seeds, cfg.warmup, cfg.duration, cfg.backup, cfg.budget)
	b.WriteString("Medians over seeds in ms, [min–max]. Extra requests: attempts the backends received beyond the client's requests, as a share of them.\n")
	for _, v := range hedgeVariants() {
		if cfg.variant != "all" && cfg.variant != v.name {
			continue
		}
		cs := caseSpec{
			scenario: v.name, rate: rate, directRate: rate / 4,
			warmup: cfg.warmup, duration: cfg.duration, timeout: cfg.timeout,
			proxy: proxyOptions{Backup: cfg.backup, BackupBudget: cfg.budget},
		}
		byPolicy := map[string][]caseResult{}
		for seed := 1; seed <= cfg.seeds; seed++ {
			sv := variant{name: v.name, models: v.models}
			models := seedModels(sv, seed, cfg.warmup)
			cases, err := runSeed(ctx, t, cs, models, pols, seed, seed, filepath.Join(tmp, v.name), func(cr caseResult) {
				fmt.Fprintf(progress, "%s seed %d %-18s p50 %6.2f ms  p99 %7.2f ms  p999 %7.2f ms  errors %d  extra %.1f%%\n",
					v.name, seed, cr.Policy, ms(cr.Summary.P50), ms(cr.Summary.P99), ms(cr.Summary.P999), cr.Summary.Errors, 100*extraShare(cr))
			})
			if err != nil {
				return err
			}
			for _, c := range cases {
				byPolicy[c.Policy] = append(byPolicy[c.Policy], c)
			}
		}
		fmt.Fprintf(&b, "\n## %s\n\n%s.\n\n| policy | p50 | p99 | p99.9 | errors | extra requests |\n| --- | --: | --: | --: | --: | --: |\n", v.name, v.about)
		for _, p := range pols {
			r := hedgeRowOf(p, byPolicy[p.key])
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", p.label, fmtStat(r.P50, fmtMs), fmtStat(r.P99, fmtMs), fmtStat(r.P999, fmtMs), fmtStat(r.ErrorPct, fmtPct), fmtStat(r.extraPct, fmtPct))
		}
	}
	fmt.Fprintf(&b, "\nTotal %v.\n", time.Since(began).Round(time.Second))
	_, err = io.WriteString(out, b.String())
	return err
}

func hedgeRowOf(p policy, runs []caseResult) hedgeRow {
	extra := make([]float64, len(runs))
	for i, c := range runs {
		extra[i] = 100 * extraShare(c)
	}
	return hedgeRow{scenRow: aggregateRow(p, runs, nil, nil), extraPct: statOf(extra)}
}

// extraShare is the attempts the backends received beyond the client's
// measured requests, as a share of them.
func extraShare(c caseResult) float64 {
	var arrivals int64
	for _, b := range c.Backends {
		arrivals += b.Arrivals
	}
	if c.Summary.Requests == 0 {
		return math.NaN()
	}
	return math.Max(0, float64(arrivals)/float64(c.Summary.Requests)-1)
}
