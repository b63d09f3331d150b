package main

// The scenario classes of issue 24 ("tails under defaults"):
//
//   - hedge: backup requests under GC-like freezes, in the forms users
//     write first (selective groups that name no lb_policy, with only
//     backup_request set), against the best unhedged configuration;
//   - partialfail: one of three backends answers an instant 503 to a
//     fraction of its requests, at 10 concurrent clients, with and
//     without retries.
//
// Both judge every form side by side (the stock balancers too), so a
// reader sees which form meets the issue's criteria and which does not.

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// The hedge class's backends: 1 worker of ≈2 ms. cap2ms is their assumed
// saturated rate: a 2 ms sleep holds the worker ≈2.6 ms on the 2-core VM
// (Go's timers wake ≈0.6 ms late, as measured for the 4 ms model).
const (
	hedgeService = 2 * time.Millisecond
	cap2ms       = 385.0
	hedgeLoad    = 0.45
)

// Defaults of the issue 24 classes.
const (
	// defaultHedgeBackup is near the healthy p95 of the hedge class's
	// backends at 45% busy.
	defaultHedgeBackup = 10 * time.Millisecond
	// selectiveDefaultBudget is selective's backup_budget when none is
	// given, the budget the forms written with defaults run under (in %).
	selectiveDefaultBudget = 10.0
	// partialClients is the partial-failure class's closed-loop clients.
	partialClients = 10
)

// Verdict kinds of the issue 24 classes.
const (
	// targetsHedge judges every hedged form against the best unhedged
	// one: p99.9 cut ≥ 2×, p99 ≤ 1.1 × best + 1 ms, extra requests ≤
	// the budget.
	targetsHedge verdictKind = iota + 100
	// targetsPartial judges every policy's share to the flaky backend
	// against its success-weighted fair share, and the client errors
	// against that share times its failure rate.
	targetsPartial
	// targetsPartialRetries adds 0 client errors.
	targetsPartialRetries
)

// hedgeForms are the hedged configurations of the hedge class: selective
// written with defaults only (no lb_policy in the groups, no
// backup_budget), as two groups of two and as one group of four, with a
// fixed backup_request and with `backup_request auto`.
func hedgeForms() []policy {
	return []policy{
		{key: "sel2_backup", label: "selective 2 groups of 2, backup_request", kind: kindCaddy, selective: true, groups: 2, backup: true},
		{key: "sel1_backup", label: "selective 1 group of 4, backup_request", kind: kindCaddy, selective: true, groups: 1, backup: true},
		{key: "sel2_auto", label: "selective 2 groups of 2, backup_request auto", kind: kindCaddy, selective: true, groups: 2, backup: true, backupAuto: true},
		{key: "sel1_auto", label: "selective 1 group of 4, backup_request auto", kind: kindCaddy, selective: true, groups: 1, backup: true, backupAuto: true},
	}
}

// unhedgedKeys are the baselines of the hedge class: lbx ewma on one pool
// of 4 (the best unhedged lbx form) and the stock least-connections
// balancers.
var unhedgedKeys = []string{"ewma", "least_conn", "nginx", "haproxy"}

// partialKeys are the policies of the partial-failure class: the
// one-liner `lb_policy ewma` a new user writes, and the stock balancers.
var partialKeys = []string{"ewma", "least_conn", "random_choose_2", "nginx", "haproxy"}

// issue24Variants returns the variants of the hedge and partialfail
// classes.
func issue24Variants() []variant {
	var vs []variant
	rate := math.Round(hedgeLoad * 4 * cap2ms)
	freeze := loadmodel.Freeze{Every: 3 * time.Second, Min: 20 * time.Millisecond, Max: 60 * time.Millisecond}
	for _, all := range []bool{false, true} {
		ms := pool(4, hedgeService)
		v := variant{
			class: "hedge", rate: rate, directRate: rate / 4,
			load:  "45% of capacity (4 × ≈385 req/s)",
			stock: unhedgedKeys, forms: hedgeForms(), kind: targetsHedge,
			notes: []string{
				"hedged forms are written with defaults only: no lb_policy in the groups, no backup_budget (selective's default, 10%), backup_request the -hedge-backup flag or `auto`",
				"extra requests: attempts the backends received beyond the client's requests, as a share of them",
				"best unhedged: the lowest p99.9 and the lowest p99 among " + strings.Join(unhedgedKeys, ", ") + " (each criterion against its own best)",
			},
		}
		if all {
			for i := range ms {
				ms[i].Freeze = freeze
			}
			v.name, v.title = "hedge-all-freeze", "every backend freezes 20–60 ms about every 3 s, each on its own schedule"
		} else {
			ms[3].Freeze = freeze
			v.name, v.title = "hedge-1of4-freezes", "1 of 4 backends freezes 20–60 ms about every 3 s"
			v.marked, v.markLabel = lastMarked(4, 1), "freezing"
		}
		v.about = "Backends of 1 worker, 2 ms ±25%, with GC-like freezes. Backups should cut the tail the freezes cause " +
			"without raising p99, in the forms users write first."
		v.models = ms
		vs = append(vs, v)
	}
	for _, f := range []float64{0.1, 0.2, 0.5} {
		for _, retries := range []bool{false, true} {
			ms := []loadmodel.Model{healthy(classService), healthy(50 * time.Millisecond), healthy(classService)}
			ms[2].Fail, ms[2].FailRate = loadmodel.Fail503, f
			v := variant{
				class:  "partialfail",
				name:   fmt.Sprintf("partialfail-%.0f", 100*f),
				title:  fmt.Sprintf("1 of 3 answers an instant 503 to %.0f%% of requests", 100*f),
				models: ms, marked: lastMarked(3, 1), markLabel: "flaky",
				about: "Three backends: b1 fast (4 ms), b2 slow (50 ms), b3 as fast as b1 but answering an instant 503 to a fraction of its requests. " +
					"Fast failures keep its queue short, so it looks cheap; it should get less traffic in proportion to its failures.",
				load:        fmt.Sprintf("%d concurrent clients, closed loop", partialClients),
				concurrency: partialClients,
				stock:       partialKeys, kind: targetsPartial,
				notes: []string{
					"success-weighted fair share of b3: its capacity times its success rate over the sum of every backend's (capacity = workers ÷ mean service time)",
					"no active health checks: b3's GET /health would pass anyway",
				},
			}
			if retries {
				v.name += "-retries"
				v.title += ", with retries"
				v.proxy.Retries = true
				v.kind = targetsPartialRetries
				v.notes = append(v.notes, "retries as in the fastfail class; the share counts attempts, so a retried request counts twice")
			} else {
				v.title += ", no retries"
			}
			vs = append(vs, v)
		}
	}
	return vs
}

// variantPolicies returns the policies a variant runs: every policy of the
// run for the older classes; for a class of issue 24, those of the run
// among its stock keys, then its forms (less the `auto` ones when the
// Caddy under test rejects them).
func variantPolicies(v variant, pols []policy, autoOK bool) []policy {
	if v.stock == nil && v.forms == nil {
		return pols
	}
	var out []policy
	for _, p := range pols {
		if slices.Contains(v.stock, p.key) {
			out = append(out, p)
		}
	}
	for _, f := range v.forms {
		if f.backupAuto && !autoOK {
			continue
		}
		out = append(out, f)
	}
	return out
}

// fairShare returns backend idx's success-weighted fair share of the
// attempts: its capacity (workers ÷ mean service time) times its success
// rate, over the same sum for every backend.
func fairShare(models []loadmodel.Model, idx int) float64 {
	var mine, all float64
	for i, m := range models {
		if m.Service <= 0 {
			return math.NaN()
		}
		ok := 1.0
		if m.Fail != loadmodel.FailNone {
			ok = 0
			if m.FailRate > 0 {
				ok = 1 - m.FailRate
			}
		}
		w := float64(m.Workers) / m.Service.Seconds() * ok
		all += w
		if i == idx {
			mine = w
		}
	}
	if all == 0 {
		return math.NaN()
	}
	return mine / all
}

// hedgeVerdicts judges every hedged row against the best unhedged rows.
func hedgeVerdicts(rowList []scenRow, pols []policy, budget float64) []verdict {
	rows := map[string]*scenRow{}
	for i := range rowList {
		rows[rowList[i].Policy] = &rowList[i]
	}
	p999 := best(rows, unhedgedKeys, func(r *scenRow) float64 { return r.P999.Median })
	p99 := best(rows, unhedgedKeys, func(r *scenRow) float64 { return r.P99.Median })
	var out []verdict
	for _, p := range pols {
		r := rows[p.key]
		if r == nil || !p.backup {
			continue
		}
		pre := r.Label + ": "
		if p999 == nil || p99 == nil {
			out = append(out, missing(pre+"p99.9 ≤ best unhedged ÷ 2", "no unhedged policy ran"))
			continue
		}
		out = append(out,
			compare(pre+"p99.9 ≤ best unhedged ÷ 2", r.P999.Median, p999.P999.Median/2, "≤", "ms",
				fmt.Sprintf("best unhedged: %s %s", p999.Label, fmtMs(p999.P999.Median))),
			compare(pre+"p99 ≤ 1.1 × best unhedged + 1 ms", r.P99.Median, 1.1*p99.P99.Median+1, "≤", "ms",
				fmt.Sprintf("best unhedged: %s %s", p99.Label, fmtMs(p99.P99.Median))))
		extra := math.NaN()
		if r.ExtraPct != nil {
			extra = r.ExtraPct.Median
		}
		out = append(out, compare(pre+"extra requests ≤ budget", extra, budget, "≤", "%", "selective's default backup_budget"),
			compare(pre+"0 errors in every seed", r.ErrorPct.Max, 0, "≤", "%", ""))
	}
	return out
}

// partialVerdicts judges every row of a partial-failure variant: the
// flaky backend's share against its success-weighted fair share, client
// errors against that share times its failure rate, and with retries 0
// client errors.
func partialVerdicts(k verdictKind, rowList []scenRow, models []loadmodel.Model, marked []bool) []verdict {
	idx := slices.Index(marked, true)
	if idx < 0 {
		return nil
	}
	fair := 100 * fairShare(models, idx)
	f := models[idx].FailRate
	var out []verdict
	for _, r := range rowList {
		pre := r.Label + ": "
		share := math.NaN()
		if r.MarkedShare != nil {
			share = r.MarkedShare.Median
		}
		out = append(out,
			compare(pre+"share to the flaky backend ≤ its success-weighted fair share", share, fair, "≤", "%", ""),
			compare(pre+"client errors ≤ fair share × failure rate", r.ErrorPct.Median, fair*f, "≤", "%",
				fmt.Sprintf("%.1f%% × %.0f%%", fair, 100*f)))
		if k == targetsPartialRetries {
			out = append(out, compare(pre+"0 client errors in every seed", r.ErrorPct.Max, 0, "≤", "%", ""))
		}
	}
	return out
}

// caddyAcceptsAuto reports whether the Caddy under test adapts a config
// with `backup_request auto`, by running `caddy adapt` on one in dir; if
// not, why.
func caddyAcceptsAuto(ctx context.Context, caddy, dir string) (bool, string) {
	pol := hedgeForms()[3]
	c, err := newProxyConfig(pol, dir, []string{"127.0.0.1:9001", "127.0.0.1:9002"}, proxyOptions{Backup: defaultHedgeBackup})
	if err != nil {
		return false, err.Error()
	}
	c.Port, c.AdminPort = 18080, 12019
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return false, err.Error()
	}
	path := filepath.Join(dir, "Caddyfile")
	if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
		return false, err.Error()
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, caddy, "adapt", "--config", path, "--adapter", "caddyfile")
	cmd.Env = proxyEnv(dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		msg := strings.TrimSpace(string(out))
		if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
			msg = msg[i+1:]
		}
		return false, msg
	}
	return true, ""
}

// needsAuto reports whether any of the variants runs a `backup_request
// auto` form.
func needsAuto(vs []variant) bool {
	for _, v := range vs {
		for _, f := range v.forms {
			if f.backupAuto {
				return true
			}
		}
	}
	return false
}
