package main

// `bench hash` is issue 28's acceptance for consistent hashing with
// bounded loads: 8 backends, and three fronts in turn on the same seeded
// key stream — lbx's `lb_policy consistent_hash` as a user writes it
// first (no options), stock Caddy's `lb_policy uri_hash` on the same
// binary, and HAProxy's `balance uri` with `hash-type consistent` and
// `hash-balance-factor 125`.
//
// Two measurements per front and seed:
//
//   - load: a closed loop of clients sends a Zipf-distributed stream of
//     keys (/k/<n>) while the benchmark samples every backend's requests in
//     flight every few milliseconds; each sample's busiest backend is
//     compared with the average, and with the bound the policy promises;
//   - removal: every key of the key set is sent once, one at a time (no
//     load, so where a key goes is the hash's choice alone), to 8
//     backends and again after one is removed; the keys whose backend
//     changed are counted against the minimum, the removed backend's 1/8,
//     and the backends they moved to.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// hashFronts are the fronts of `bench hash`, in the order of the report.
// lbx's runs in the form users write first: `lb_policy consistent_hash`,
// no options, so its key is the request URI and its balance factor 1.25.
var hashFronts = []policy{
	{key: "consistent_hash", label: "lbx consistent_hash", kind: kindCaddy, caddyPolicy: "consistent_hash"},
	{key: "uri_hash", label: "Caddy uri_hash", kind: kindCaddy, caddyPolicy: "uri_hash"},
	{key: "haproxy", label: "HAProxy uri, consistent, factor 125", kind: kindHAProxy,
		options: []string{"balance uri", "hash-type consistent", "hash-balance-factor 125"}},
}

func hashFrontKeys() []string {
	keys := make([]string, len(hashFronts))
	for i, f := range hashFronts {
		keys[i] = f.key
	}
	return keys
}

// Settings of `bench hash`.
//
// The backends sleep 40 ms ± 25% per request and never queue (1024
// workers), so what they hold is what the front sent them. 64 clients in
// a closed loop then keep ≈64 requests in flight, ≈8 per backend, at
// ≈1500 req/s: well within what Caddy proxies on one of the 2 shared
// cores. A Zipf exponent of 1.1 over 10,000 keys gives the hottest key
// ≈15% of the requests, more than a backend's fair share of 12.5%, so an
// unbounded hash must overload its owner.
const (
	hashBackends           = 8
	hashFactor             = 1.25
	hashWorkers            = 1024
	defaultHashKeys        = 10000
	defaultHashZipf        = 1.1
	defaultHashClients     = 64
	defaultHashSeeds       = 3
	defaultHashWarmup      = 2 * time.Second
	defaultHashDuration    = 10 * time.Second
	defaultHashService     = 40 * time.Millisecond
	defaultHashSampleEvery = 2 * time.Millisecond
	hashJitter             = 0.25
	// hashStreamLen is the length of a seed's key stream; a load
	// longer than it starts the stream again.
	hashStreamLen = 1 << 17
	// hashCaseOverheadGuess is a case's time beyond its load: starting
	// the fronts, the removal's two passes and the reload.
	hashCaseOverheadGuess = 8 * time.Second
)

// hashConfig is `bench hash`'s configuration, from flags.
type hashConfig struct {
	fronts      []policy
	seeds       int
	firstSeed   int
	keys        int
	zipf        float64
	clients     int
	warmup      time.Duration
	duration    time.Duration
	service     time.Duration
	sampleEvery time.Duration
	timeout     time.Duration
	caddyBin    string
	jsonPath    string
	outPath     string
}

// parseHashFlags reads `bench hash`'s flags.
func parseHashFlags(args []string, stderr io.Writer) (*hashConfig, error) {
	fs := flag.NewFlagSet("bench hash", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" hash [flags]\n\n"+
			"Issue 28's hashing acceptance: lbx consistent_hash, stock Caddy uri_hash and HAProxy's\n"+
			"bounded-load consistent hash in turn in front of 8 backends, on the same seeded Zipf key\n"+
			"stream (the busiest backend's requests in flight against the average), and the keys that\n"+
			"move when one backend is removed. Prints Markdown tables and a verdict.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &hashConfig{}
	var fronts string
	var quick bool
	fs.StringVar(&fronts, "fronts", strings.Join(hashFrontKeys(), ","), "fronts to compare")
	fs.IntVar(&c.seeds, "seeds", defaultHashSeeds, "seeds; a seed selects the key stream, which key is hottest, the backends' jitter and the backend removed")
	fs.IntVar(&c.firstSeed, "first-seed", 1, "the first seed; seeds run from it up")
	fs.IntVar(&c.keys, "keys", defaultHashKeys, "distinct keys (/k/0 … /k/<keys-1>); the removal sends each once")
	fs.Float64Var(&c.zipf, "zipf", defaultHashZipf, "Zipf exponent of the key stream (above 1)")
	fs.IntVar(&c.clients, "clients", defaultHashClients, "clients of the closed loop: requests in flight")
	fs.DurationVar(&c.warmup, "warmup", defaultHashWarmup, "unmeasured load before each front's measured window")
	fs.DurationVar(&c.duration, "duration", defaultHashDuration, "measured window per front and seed")
	fs.DurationVar(&c.service, "service", defaultHashService, "mean service time of the backends under load (±25%)")
	fs.DurationVar(&c.sampleEvery, "sample", defaultHashSampleEvery, "interval between samples of the backends' requests in flight")
	fs.DurationVar(&c.timeout, "timeout", defaultTimeout, "per-request client timeout; a timeout is an error")
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.StringVar(&c.jsonPath, "json", "", "also write the raw results and the aggregates as JSON to this file")
	fs.StringVar(&c.outPath, "out", "", "write the Markdown report to this file instead of standard output")
	fs.BoolVar(&quick, "quick", false, "smoke test of about a minute: 1 seed, 1s warm-up, 3s window, 2000 keys (flags given explicitly still win)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["seeds"] {
			c.seeds = 1
		}
		if !set["warmup"] {
			c.warmup = time.Second
		}
		if !set["duration"] {
			c.duration = 3 * time.Second
		}
		if !set["keys"] {
			c.keys = 2000
		}
	}
	switch {
	case c.seeds < 1 || c.seeds > 100:
		return nil, fmt.Errorf("-seeds must be between 1 and 100, got %d", c.seeds)
	case c.firstSeed < 0:
		return nil, fmt.Errorf("-first-seed must not be negative, got %d", c.firstSeed)
	case c.keys < hashBackends*10 || c.keys > 1_000_000:
		return nil, fmt.Errorf("-keys must be between %d and 1000000, got %d", hashBackends*10, c.keys)
	case !(c.zipf > 1) || c.zipf > 10:
		return nil, fmt.Errorf("-zipf must be above 1 and at most 10, got %v", c.zipf)
	case c.clients < 1 || c.clients > hashWorkers:
		return nil, fmt.Errorf("-clients must be between 1 and %d, got %d", hashWorkers, c.clients)
	case c.warmup < 0:
		return nil, fmt.Errorf("-warmup must not be negative, got %v", c.warmup)
	case c.duration < time.Second || c.duration > 10*time.Minute:
		return nil, fmt.Errorf("-duration must be between 1s and 10m, got %v", c.duration)
	case c.service < time.Millisecond || c.service > time.Second:
		return nil, fmt.Errorf("-service must be between 1ms and 1s, got %v", c.service)
	case c.sampleEvery < 100*time.Microsecond || c.sampleEvery > c.duration/10:
		return nil, fmt.Errorf("-sample must be between 100µs and a tenth of -duration, got %v", c.sampleEvery)
	case c.timeout <= 0:
		return nil, fmt.Errorf("-timeout must be positive, got %v", c.timeout)
	}
	want := map[string]bool{}
	for _, k := range strings.Split(fronts, ",") {
		k = strings.ToLower(strings.TrimSpace(k))
		if k == "" {
			continue
		}
		if !slices.Contains(hashFrontKeys(), k) {
			return nil, fmt.Errorf("-fronts: unknown front %q (known: %s)", k, strings.Join(hashFrontKeys(), ", "))
		}
		want[k] = true
	}
	for _, f := range hashFronts {
		if want[f.key] {
			c.fronts = append(c.fronts, f)
		}
	}
	if len(c.fronts) == 0 {
		return nil, errors.New("-fronts: no front selected")
	}
	return c, nil
}

// keyStream draws n keys in [0, keys) from a Zipf distribution of
// exponent s, seeded: the key of rank r (from 0) has probability
// proportional to (r+1)^-s. Which key has which rank is a seeded
// permutation, so the hottest key differs from seed to seed. The stream
// is a pure function of its arguments.
func keyStream(seed uint64, s float64, keys, n int) []int32 {
	r := rand.New(rand.NewPCG(seed, 0x28))
	perm := r.Perm(keys)
	z := rand.NewZipf(r, s, 1, uint64(keys-1))
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(perm[z.Uint64()])
	}
	return out
}

// zipfTopShare is the probability of the hottest of keys keys under a
// Zipf distribution of exponent s.
func zipfTopShare(s float64, keys int) float64 {
	h := 0.0
	for r := keys; r >= 1; r-- { // smallest terms first
		h += math.Pow(float64(r), -s)
	}
	return 1 / h
}

// keyPath is the path of key k.
func keyPath(k int) string { return "/k/" + strconv.Itoa(k) }

// inFlight is one sample of the backends' requests in flight: the busiest
// backend's, and the sum over all.
type inFlight struct {
	max, total int
}

// hashBound is the bound lbx's consistent_hash documents for n equal
// upstreams with total requests in flight: ceil(factor × (total + 1) / n).
func hashBound(factor float64, total, n int) int {
	return int(math.Ceil(factor * float64(total+1) / float64(n)))
}

// balance is how evenly the requests in flight were spread over a
// measured window.
type balance struct {
	// Samples counts the samples taken into account: those in which the
	// backends held at least half the requests the front can (see
	// balanceOf); Thin counts those left out.
	Samples int `json:"samples"`
	Thin    int `json:"thin"`
	// MeanInFlight is the average over samples of the requests in flight
	// per backend.
	MeanInFlight float64 `json:"mean_in_flight"`
	// RatioP50, RatioP99 and RatioMax are quantiles over samples of the
	// busiest backend's requests in flight divided by the average per
	// backend in the same sample.
	RatioP50 float64 `json:"ratio_p50"`
	RatioP99 float64 `json:"ratio_p99"`
	RatioMax float64 `json:"ratio_max"`
	// BoundRatio is ceil(1.25 × (total + 1) / 8) over the average, at
	// the median total: what lbx's documented bound allows.
	BoundRatio float64 `json:"bound_ratio"`
	// OverBoundPct is the share of samples, in %, in which the busiest
	// backend held more than ceil(1.25 × (total + 1) / 8).
	OverBoundPct float64 `json:"over_bound_pct"`
	// OverFactorPct is the share of samples, in %, in which it held more
	// than 1.25 × the average (the factor without rounding up).
	OverFactorPct float64 `json:"over_factor_pct"`
	// OverCapPct is the share of samples, in %, in which it held more
	// than the bound at the most the front can have in flight (the
	// clients of the closed loop): certain breaches of the bound. The
	// backends see fewer requests in flight than the front counts (those
	// on their way in or out), so OverBoundPct also counts samples in
	// which the front kept to its own bound.
	OverCapPct float64 `json:"over_cap_pct"`
}

// balanceOf condenses samples taken over n backends, behind a front that
// has at most most requests in flight. Samples in which the backends held
// fewer than half of most are left out: there the front (or the clients)
// held the rest, starved of CPU on a busy machine, and a ratio over a
// handful of requests says little about balance — 3 on one backend of 8
// with 5 in flight is 4.8 × the average.
func balanceOf(samples []inFlight, n int, factor float64, most int) balance {
	var b balance
	var ratios []float64
	var totals []int
	sum := 0
	over, overFactor, overCap := 0, 0, 0
	for _, s := range samples {
		if s.total <= 0 || 2*s.total < most {
			b.Thin++
			continue
		}
		mean := float64(s.total) / float64(n)
		ratios = append(ratios, float64(s.max)/mean)
		totals = append(totals, s.total)
		sum += s.total
		if s.max > hashBound(factor, s.total, n) {
			over++
		}
		if float64(s.max) > factor*mean {
			overFactor++
		}
		if s.max > hashBound(factor, most, n) {
			overCap++
		}
	}
	b.Samples = len(ratios)
	if b.Samples == 0 {
		nan := math.NaN()
		return balance{Thin: b.Thin, RatioP50: nan, RatioP99: nan, RatioMax: nan, BoundRatio: nan, MeanInFlight: nan, OverBoundPct: nan, OverFactorPct: nan, OverCapPct: nan}
	}
	slices.Sort(ratios)
	slices.Sort(totals)
	b.MeanInFlight = float64(sum) / float64(b.Samples) / float64(n)
	b.RatioP50 = quantileOf(ratios, 0.5)
	b.RatioP99 = quantileOf(ratios, 0.99)
	b.RatioMax = ratios[len(ratios)-1]
	mid := totals[len(totals)/2]
	b.BoundRatio = float64(hashBound(factor, mid, n)) / (float64(mid) / float64(n))
	b.OverBoundPct = 100 * float64(over) / float64(b.Samples)
	b.OverFactorPct = 100 * float64(overFactor) / float64(b.Samples)
	b.OverCapPct = 100 * float64(overCap) / float64(b.Samples)
	return b
}

// quantileOf returns the q-quantile of sorted (nearest rank).
func quantileOf(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// movement is what removing one backend did to where keys go.
type movement struct {
	// Keys counts the keys placed in both passes (answered 200 both
	// times); Failed those that were not.
	Keys   int `json:"keys"`
	Failed int `json:"failed"`
	// Owned counts the keys the removed backend had: they must move.
	Owned int `json:"owned"`
	// Moved counts the keys whose backend changed; MovedOther those of
	// them that were not on the removed backend (moves no removal needs).
	Moved      int `json:"moved"`
	MovedOther int `json:"moved_other"`
	// MovedPct is Moved over Keys in %, and OfMinimum Moved over Keys ÷ 8
	// (the least a removal of one of 8 can move when every backend owns
	// its share).
	MovedPct  float64 `json:"moved_pct"`
	OfMinimum float64 `json:"of_minimum"`
	// Receivers counts the backends the removed backend's keys went to;
	// LargestPart is the largest share of them one of those took, in %.
	Receivers   int     `json:"receivers"`
	LargestPart float64 `json:"largest_part_pct"`
	// RemovedAfter counts the keys the removed backend still served
	// after its removal (must be 0: the change took effect).
	RemovedAfter int `json:"removed_after"`
}

// movementOf compares where each key went before (8 backends) and after
// (backend removed gone): before[k] and after[k] are backend indexes in
// [0, n), or -1 for a key that was not answered.
func movementOf(before, after []int, removed, n int) movement {
	var m movement
	got := make([]int, n)
	for k := range before {
		b, a := before[k], after[k]
		if a == removed {
			m.RemovedAfter++
		}
		if b < 0 || a < 0 {
			m.Failed++
			continue
		}
		m.Keys++
		if b == removed {
			m.Owned++
		}
		if a == b {
			continue
		}
		m.Moved++
		if b == removed {
			got[a]++
		} else {
			m.MovedOther++
		}
	}
	most := 0
	for _, c := range got {
		if c > 0 {
			m.Receivers++
			most = max(most, c)
		}
	}
	if m.Keys > 0 {
		m.MovedPct = 100 * float64(m.Moved) / float64(m.Keys)
		m.OfMinimum = float64(m.Moved) / (float64(m.Keys) / float64(n))
	}
	if m.Owned > 0 {
		m.LargestPart = 100 * float64(most) / float64(m.Owned)
	}
	return m
}

// hashCase is one front's measurements in one seed.
type hashCase struct {
	Front string `json:"front"`
	Seed  int    `json:"seed"`
	// Load: latency and errors of the closed loop, each backend's share
	// of the requests answered (b1 first, in %), and the balance of the
	// requests in flight.
	Load    loadmodel.Summary `json:"load"`
	Shares  []jsonNum         `json:"shares_pct"`
	Balance balance           `json:"balance"`
	// CPUPressure is the share of the measured window in which some task
	// waited for a CPU (Linux PSI), where known.
	CPUPressure *float64 `json:"cpu_pressure,omitempty"`
	// Removed is the backend the removal took out, and How how.
	Removed  string   `json:"removed"`
	How      string   `json:"how"`
	Movement movement `json:"movement"`
	Notes    []string `json:"notes,omitempty"`
}

// hashRow is a front's aggregate over seeds.
type hashRow struct {
	Front        string `json:"front"`
	Label        string `json:"label"`
	How          string `json:"how"`
	MeanInFlight stat   `json:"mean_in_flight"`
	RatioP50     stat   `json:"ratio_p50"`
	RatioP99     stat   `json:"ratio_p99"`
	RatioMax     stat   `json:"ratio_max"`
	BoundRatio   stat   `json:"bound_ratio"`
	OverBound    stat   `json:"over_bound_pct"`
	OverFactor   stat   `json:"over_factor_pct"`
	OverCap      stat   `json:"over_cap_pct"`
	ThinPct      stat   `json:"thin_pct"`
	CPUPressure  stat   `json:"cpu_pressure"`
	LargestShare stat   `json:"largest_share_pct"`
	LeastShare   stat   `json:"least_share_pct"`
	P50          stat   `json:"p50_ms"`
	P99          stat   `json:"p99_ms"`
	Throughput   stat   `json:"throughput"`
	ErrorPct     stat   `json:"error_pct"`
	MovedPct     stat   `json:"moved_pct"`
	OfMinimum    stat   `json:"of_minimum"`
	MovedOther   stat   `json:"moved_other"`
	Receivers    stat   `json:"receivers"`
	LargestPart  stat   `json:"largest_part_pct"`
}

// hashReport is everything `bench hash` measured.
type hashReport struct {
	Command string `json:"command"`
	Source  string `json:"source"`
	runHeader
	Versions    map[string]string `json:"versions"`
	Seeds       int               `json:"seeds"`
	FirstSeed   int               `json:"first_seed"`
	Keys        int               `json:"keys"`
	Zipf        float64           `json:"zipf"`
	TopShare    float64           `json:"top_key_share_pct"`
	Clients     int               `json:"clients"`
	Warmup      string            `json:"warmup"`
	Duration    string            `json:"duration"`
	Service     string            `json:"service"`
	SampleEvery string            `json:"sample_every"`
	Notes       []string          `json:"notes,omitempty"`
	Rows        []hashRow         `json:"rows"`
	Verdicts    []verdict         `json:"verdicts"`
	Cases       []hashCase        `json:"cases"`
}

// runHash is `bench hash`: it parses args, runs every seed's fronts,
// writes the Markdown report (and JSON if asked), and logs progress to
// progress. It stops every process and backend it started before
// returning, also when ctx is cancelled.
func runHash(ctx context.Context, args []string, cmdline string, out, progress io.Writer) (*hashReport, error) {
	cfg, err := parseHashFlags(args, progress)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	tmp, err := os.MkdirTemp("", "lbx-bench-hash-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	t, source, versions, notes, fronts, err := setupTools(ctx, cfg.caddyBin, cfg.fronts, tmp, progress)
	if err != nil {
		return nil, err
	}
	if len(fronts) == 0 {
		return nil, errors.New("no selected front can run")
	}
	rep := &hashReport{
		Command: cmdline, Source: source, runHeader: startRun(began), Versions: versions, Notes: notes,
		Seeds: cfg.seeds, FirstSeed: cfg.firstSeed, Keys: cfg.keys, Zipf: cfg.zipf,
		TopShare: 100 * zipfTopShare(cfg.zipf, cfg.keys), Clients: cfg.clients,
		Warmup: cfg.warmup.String(), Duration: cfg.duration.String(), Service: cfg.service.String(),
		SampleEvery: cfg.sampleEvery.String(),
	}
	total := cfg.seeds * len(fronts)
	est := time.Duration(total) * (cfg.warmup + cfg.duration + hashCaseOverheadGuess)
	rep.estimated(est)
	fmt.Fprintf(progress, "%d seeds × %d fronts = %d cases, estimated %v\n", cfg.seeds, len(fronts), total, est.Round(time.Second))
	var runErr error
	for r := range cfg.seeds {
		seed := cfg.firstSeed + r
		cases, err := runHashSeed(ctx, cfg, t, fronts, r%len(fronts), seed, filepath.Join(tmp, fmt.Sprintf("seed%d", seed)), progress)
		rep.Cases = append(rep.Cases, cases...)
		if err != nil {
			runErr = fmt.Errorf("seed %d: %w", seed, err)
			break
		}
	}
	rep.Rows = summarizeHash(fronts, rep.Cases)
	rep.Verdicts = hashVerdicts(rep.Rows)
	rep.finish()
	w := out
	if cfg.outPath != "" {
		f, err := os.Create(cfg.outPath)
		if err != nil {
			return nil, errors.Join(runErr, err)
		}
		defer f.Close()
		w = f
	}
	if err := writeRun(rep, &rep.Notes, len(rep.Cases) > 0, w, cfg.jsonPath, runErr); err != nil {
		return nil, err
	}
	return rep, nil
}

// startHashBackends starts n backends of model m (named b1…bn), seeded
// apart, or stops those started and returns an error.
func startHashBackends(m loadmodel.Model, n int, seed int) ([]*loadmodel.Backend, error) {
	var bs []*loadmodel.Backend
	for i := range n {
		m.Name = fmt.Sprintf("b%d", i+1)
		m.Seed = uint64(seed)*1_000_003 + uint64(i+1)*7919
		b, err := loadmodel.StartBackend(m)
		if err != nil {
			closeBackends(bs)
			return nil, err
		}
		bs = append(bs, b)
	}
	return bs, nil
}

func closeBackends(bs []*loadmodel.Backend) {
	for _, b := range bs {
		_ = b.Close()
	}
}

func backendAddrs(bs []*loadmodel.Backend) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = b.Addr()
	}
	return out
}

// runHashSeed runs every front once in a seed, starting with front first:
// each under load on its own process, then the removal on another.
func runHashSeed(ctx context.Context, cfg *hashConfig, t tools, fronts []policy, first, seed int, dir string, progress io.Writer) ([]hashCase, error) {
	// Backends under load sleep; those the removal places keys on answer
	// at once, so that a pass over every key takes seconds.
	loaded, err := startHashBackends(loadmodel.Model{Workers: hashWorkers, Service: cfg.service, Jitter: hashJitter}, hashBackends, seed)
	if err != nil {
		return nil, err
	}
	defer closeBackends(loaded)
	placing, err := startHashBackends(loadmodel.Model{Workers: hashWorkers}, hashBackends, seed)
	if err != nil {
		return nil, err
	}
	defer closeBackends(placing)
	stream := keyStream(uint64(seed), cfg.zipf, cfg.keys, hashStreamLen)
	removed := (seed - 1 + hashBackends) % hashBackends
	var cases []hashCase
	for i := range fronts {
		f := fronts[(first+i)%len(fronts)]
		c := hashCase{Front: f.key, Seed: seed, Removed: placing[removed].Name()}
		c.Notes = settleBackends(ctx, loaded)
		if err := runHashLoad(ctx, cfg, t, f, loaded, stream, filepath.Join(dir, f.key+"-load"), &c); err != nil {
			return cases, fmt.Errorf("%s, load: %w", f.key, err)
		}
		if err := runHashRemoval(ctx, cfg, t, f, placing, removed, filepath.Join(dir, f.key+"-removal"), &c); err != nil {
			return cases, fmt.Errorf("%s, removal: %w", f.key, err)
		}
		cases = append(cases, c)
		fmt.Fprintf(progress, "seed %d %-16s max/mean p50 %.2f p99 %.2f max %.2f (%.1f%% of samples above the bound) · p50 %s p99 %s · removing %s moved %.1f%% (%.2f × 1/8, %d elsewhere) to %d backends\n",
			seed, f.key, c.Balance.RatioP50, c.Balance.RatioP99, c.Balance.RatioMax, c.Balance.OverBoundPct,
			fmtMs(ms(c.Load.P50)), fmtMs(ms(c.Load.P99)), c.Removed, c.Movement.MovedPct, c.Movement.OfMinimum, c.Movement.MovedOther, c.Movement.Receivers)
	}
	return cases, nil
}

// runHashLoad runs front f under the closed loop on the seed's key
// stream, sampling the backends' requests in flight through the measured
// window, and records the result in c.
func runHashLoad(ctx context.Context, cfg *hashConfig, t tools, f policy, backends []*loadmodel.Backend, stream []int32, dir string, c *hashCase) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	px, err := startProxy(ctx, t, f, dir, backendAddrs(backends), proxyOptions{})
	if err != nil {
		return err
	}
	defer func() { _ = px.stop() }()
	measuring := make(chan struct{})
	var once sync.Once
	var samples []inFlight
	var sampler sync.WaitGroup
	sctx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	sampler.Go(func() {
		select {
		case <-sctx.Done():
			return
		case <-measuring:
		}
		start := time.Now()
		psi0, psiOK := cpuPressure()
		defer func() {
			if psi1, ok := cpuPressure(); ok && psiOK {
				p := float64(psi1-psi0) / float64(time.Since(start))
				c.CPUPressure = &p
			}
		}()
		end := start.Add(cfg.duration)
		tick := time.NewTicker(cfg.sampleEvery)
		defer tick.Stop()
		for {
			select {
			case <-sctx.Done():
				return
			case now := <-tick.C:
				if now.After(end) {
					return
				}
				var s inFlight
				for _, b := range backends {
					n := int(b.InSystem())
					s.total += n
					s.max = max(s.max, n)
				}
				samples = append(samples, s)
			}
		}
	})
	l := loadmodel.Load{
		URL: px.url, Concurrency: cfg.clients, Warmup: cfg.warmup, Duration: cfg.duration, Timeout: cfg.timeout,
		Path:      func(n uint64) string { return keyPath(int(stream[n%uint64(len(stream))])) },
		OnMeasure: func() { once.Do(func() { close(measuring) }) },
	}
	res, err := l.Run(ctx)
	stopSampling()
	sampler.Wait()
	if err != nil {
		return err
	}
	c.Load = loadmodel.Summarize(res)
	c.Balance = balanceOf(samples, len(backends), hashFactor, cfg.clients)
	c.Shares = make([]jsonNum, len(backends))
	for i, b := range backends {
		c.Shares[i] = jsonNum(math.NaN())
		if c.Load.OK > 0 {
			c.Shares[i] = jsonNum(100 * float64(c.Load.ByBackend[b.Name()]) / float64(c.Load.OK))
		}
	}
	return nil
}

// runHashRemoval places every key on 8 backends through front f, removes
// backend removed, and places them again, recording the movement in c.
// Caddy is reloaded in place through its admin API (POST /load of the
// Caddyfile without the backend); HAProxy is restarted without the
// backend's server line, its other servers keeping their ids.
func runHashRemoval(ctx context.Context, cfg *hashConfig, t tools, f policy, backends []*loadmodel.Backend, removed int, dir string, c *hashCase) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	all := backendAddrs(backends)
	ids := make([]int, len(all))
	for i := range ids {
		ids[i] = i + 1
	}
	px, err := startProxy(ctx, t, f, dir, all, proxyOptions{ServerIDs: ids})
	if err != nil {
		return err
	}
	defer func() { _ = px.stop() }()
	index := map[string]int{}
	for i, b := range backends {
		index[b.Name()] = i
	}
	before, err := placeKeys(ctx, px.url, cfg.keys, index, cfg.timeout)
	if err != nil {
		return err
	}
	rest := slices.Delete(slices.Clone(all), removed, removed+1)
	restIDs := slices.Delete(slices.Clone(ids), removed, removed+1)
	switch f.kind {
	case kindCaddy:
		c.How = "POST /load of the Caddyfile without it (same process)"
		if err := reloadCaddy(ctx, px, f, filepath.Join(dir, "reload"), rest); err != nil {
			return err
		}
	case kindHAProxy:
		c.How = "restart without its server line; the others keep their ids"
		if err := px.stop(); err != nil {
			return err
		}
		d := filepath.Join(dir, "restart")
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
		if px, err = startProxy(ctx, t, f, d, rest, proxyOptions{ServerIDs: restIDs}); err != nil {
			return err
		}
	default:
		return fmt.Errorf("front %s has no way to remove a backend", f.key)
	}
	after, err := placeKeys(ctx, px.url, cfg.keys, index, cfg.timeout)
	if err != nil {
		return err
	}
	c.Movement = movementOf(before, after, removed, len(backends))
	if c.Movement.RemovedAfter > 0 {
		return fmt.Errorf("the removed backend %s still served %d keys after the removal", backends[removed].Name(), c.Movement.RemovedAfter)
	}
	return nil
}

// placeKeys sends GET /k/0 … /k/<keys-1> through the proxy at base, one
// at a time on one connection, and returns the index of the backend that
// answered each (-1 where none answered 200). More than 1% unanswered is
// an error.
func placeKeys(ctx context.Context, base string, keys int, index map[string]int, timeout time.Duration) ([]int, error) {
	client := loadmodel.NewClient(timeout)
	defer client.CloseIdleConnections()
	out := make([]int, keys)
	failed := 0
	var lastErr error
	for k := range keys {
		out[k] = -1
		rctx, cancel := context.WithTimeout(ctx, timeout)
		req, err := http.NewRequestWithContext(rctx, http.MethodGet, strings.TrimSuffix(base, "/")+keyPath(k), nil)
		if err != nil {
			cancel()
			return nil, err
		}
		resp, err := client.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
			if i, ok := index[resp.Header.Get(loadmodel.BackendHeader)]; ok && err == nil && resp.StatusCode == http.StatusOK {
				out[k] = i
			} else if err == nil {
				err = fmt.Errorf("status %d from %q", resp.StatusCode, resp.Header.Get(loadmodel.BackendHeader))
			}
		}
		cancel()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if err != nil {
			failed++
			lastErr = err
		}
	}
	if failed*100 > keys {
		return nil, fmt.Errorf("%d of %d keys unanswered, the last: %v", failed, keys, lastErr)
	}
	return out, nil
}

// reloadCaddy loads the Caddyfile of front f in front of upstreams into
// the running Caddy px, on its ports, through its admin API.
func reloadCaddy(ctx context.Context, px *proxy, f policy, dir string, upstreams []string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	c, err := newProxyConfig(f, dir, upstreams, proxyOptions{})
	if err != nil {
		return err
	}
	if c.Port, err = urlPort(px.url); err != nil {
		return err
	}
	if c.AdminPort, err = urlPort(px.adminURL); err != nil {
		return err
	}
	path := filepath.Join(dir, "Caddyfile")
	if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
		return err
	}
	body, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, px.adminURL+"load", strings.NewReader(string(body)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("POST /load: %w", err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: status %d: %s", resp.StatusCode, strings.TrimSpace(string(msg)))
	}
	return nil
}

// urlPort returns the port of an http://host:port/ URL.
func urlPort(raw string) (int, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(u.Port())
}

// summarizeHash aggregates the cases per front over seeds.
func summarizeHash(fronts []policy, cases []hashCase) []hashRow {
	var rows []hashRow
	for _, f := range fronts {
		var v struct {
			mean, p50r, p99r, maxr, bound, over, overF, overC, thin, psi, most, least, p50, p99, tput, errs, moved, ofMin, other, recv, part []float64
		}
		how := ""
		for _, c := range cases {
			if c.Front != f.key {
				continue
			}
			how = c.How
			b := c.Balance
			v.mean = append(v.mean, b.MeanInFlight)
			v.p50r = append(v.p50r, b.RatioP50)
			v.p99r = append(v.p99r, b.RatioP99)
			v.maxr = append(v.maxr, b.RatioMax)
			v.bound = append(v.bound, b.BoundRatio)
			v.over = append(v.over, b.OverBoundPct)
			v.overF = append(v.overF, b.OverFactorPct)
			v.overC = append(v.overC, b.OverCapPct)
			v.thin = append(v.thin, 100*float64(b.Thin)/float64(max(1, b.Thin+b.Samples)))
			psi := math.NaN()
			if c.CPUPressure != nil {
				psi = *c.CPUPressure
			}
			v.psi = append(v.psi, psi)
			shares := make([]float64, 0, len(c.Shares))
			for _, s := range c.Shares {
				if !math.IsNaN(float64(s)) {
					shares = append(shares, float64(s))
				}
			}
			if len(shares) > 0 {
				v.most = append(v.most, slices.Max(shares))
				v.least = append(v.least, slices.Min(shares))
			}
			v.p50 = append(v.p50, ms(c.Load.P50))
			v.p99 = append(v.p99, ms(c.Load.P99))
			v.tput = append(v.tput, c.Load.Throughput)
			errPct := math.NaN()
			if c.Load.Requests > 0 {
				errPct = 100 * float64(c.Load.Errors) / float64(c.Load.Requests)
			}
			v.errs = append(v.errs, errPct)
			m := c.Movement
			v.moved = append(v.moved, m.MovedPct)
			v.ofMin = append(v.ofMin, m.OfMinimum)
			v.other = append(v.other, float64(m.MovedOther))
			v.recv = append(v.recv, float64(m.Receivers))
			v.part = append(v.part, m.LargestPart)
		}
		if len(v.p50) == 0 {
			continue
		}
		rows = append(rows, hashRow{
			Front: f.key, Label: f.label, How: how,
			MeanInFlight: statOf(v.mean), RatioP50: statOf(v.p50r), RatioP99: statOf(v.p99r), RatioMax: statOf(v.maxr),
			BoundRatio: statOf(v.bound), OverBound: statOf(v.over), OverFactor: statOf(v.overF), OverCap: statOf(v.overC), ThinPct: statOf(v.thin), CPUPressure: statOf(v.psi),
			LargestShare: statOf(v.most), LeastShare: statOf(v.least),
			P50: statOf(v.p50), P99: statOf(v.p99), Throughput: statOf(v.tput), ErrorPct: statOf(v.errs),
			MovedPct: statOf(v.moved), OfMinimum: statOf(v.ofMin), MovedOther: statOf(v.other),
			Receivers: statOf(v.recv), LargestPart: statOf(v.part),
		})
	}
	return rows
}

// atLeast is a verdict of value ≥ limit.
func atLeast(name string, value, limit float64, unit, detail string) verdict {
	v := verdict{Name: name, Value: value, Limit: limit, Op: "≥", Unit: unit, Detail: detail}
	if !math.IsNaN(value) {
		v.Evaluated, v.Pass = true, value >= limit
	}
	return v
}

// hashVerdicts judges every front by issue 28's criteria, on the medians
// over seeds: the busiest backend within the factor of the average (at
// the 99th percentile of samples), and rarely above the bound lbx
// documents, which rounds up to whole requests; the keys moved within 10%
// of 1/8; and, in every seed, the removed backend's keys spread over all
// 7 others.
func hashVerdicts(rows []hashRow) []verdict {
	var out []verdict
	for _, r := range rows {
		pre := r.Label + ": "
		out = append(out,
			compare(pre+"busiest backend ÷ average in flight, p99 of samples ≤ 1.25", r.RatioP99.Median, hashFactor, "≤", "",
				fmt.Sprintf("max over samples %.2f; rounding up to whole requests allows %.2f at this load", r.RatioMax.Median, r.BoundRatio.Median)),
			compare(pre+"samples above ceil(1.25 × (in flight at the backends + 1) ÷ 8)", r.OverBound.Median, 1, "≤", "%", "worst seed "+fmtPct(r.OverBound.Max)),
			compare(pre+"samples with a backend above the bound at the clients' in flight (certain breaches)", r.OverCap.Median, 0.1, "≤", "%", "worst seed "+fmtPct(r.OverCap.Max)),
			compare(pre+"keys moved, off 1/8 by", 100*math.Abs(r.OfMinimum.Median-1), 10, "≤", "%",
				fmt.Sprintf("%.3f × 1/8; seeds %.3f–%.3f; moved elsewhere %.0f", r.OfMinimum.Median, r.OfMinimum.Min, r.OfMinimum.Max, r.MovedOther.Max)),
			atLeast(pre+"backends the removed one's keys went to, fewest over seeds", r.Receivers.Min, hashBackends-1, "", ""),
		)
	}
	return out
}

// writeMarkdown renders the report.
func (r *hashReport) writeMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("# lbx: consistent hashing with bounded loads (issue 28)\n\n")
	fmt.Fprintf(&b, "Command: `%s`\n\n", r.Command)
	fmt.Fprintf(&b, "Proxy under test: %s.\n\n", r.Source)
	r.runHeader.writeMarkdown(&b, "")
	writeVersions(&b, r.Versions, "go", "caddy", "haproxy")
	fmt.Fprintf(&b, "Load: %d backends that sleep %s ±25%% per request and never queue; %d clients in a closed loop send GET /k/<key>, "+
		"keys drawn from a Zipf distribution of exponent %g over %d keys (the hottest is %.1f%% of the requests; a backend's fair share is %.1f%%), "+
		"the same seeded stream for every front of a seed; %s warm-up, then %s measured, while every backend's requests in flight are sampled every %s. "+
		"Seeds %d–%d (a seed selects the stream, which key is hottest, the jitter and the backend removed); fronts run in turn, in an order rotated per seed. "+
		"Tables show the median over seeds and [min–max].\n\n",
		hashBackends, r.Service, r.Clients, r.Zipf, r.Keys, r.TopShare, 100.0/hashBackends, r.Warmup, r.Duration, r.SampleEvery,
		r.FirstSeed, r.FirstSeed+r.Seeds-1)
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "Note: %s.\n\n", n)
	}
	b.WriteString("## Load: the busiest backend against the average\n\n")
	b.WriteString("Per sample: the busiest backend's requests in flight ÷ the average per backend; its median, 99th percentile and maximum over the samples. ")
	fmt.Fprintf(&b, "Samples in which the backends held fewer than half of the %d requests the clients keep in flight are left out (the rest were in the front or the clients, "+
		"starved of CPU): a ratio over a handful of requests says little about balance. CPU pressure: the share of the window in which some task waited for a CPU (Linux PSI). ", r.Clients)
	b.WriteString("Above 1.25 ×: samples in which the busiest backend held more than 1.25 × the average. ")
	b.WriteString("Above the bound: more than ceil(1.25 × (in flight + 1) ÷ 8), the bound lbx documents (HAProxy's rounds alike), with the backends' own total; ")
	b.WriteString("the backends see fewer requests in flight than the front counts (some are on their way in or out), so this counts some samples in which the front kept its bound. ")
	fmt.Fprintf(&b, "Above the clients' bound: more than ceil(1.25 × (%d + 1) ÷ 8) = %d, the bound at the most the front can hold (the %d clients): certain breaches. ",
		r.Clients, hashBound(hashFactor, r.Clients, hashBackends), r.Clients)
	b.WriteString("Rounding up to whole requests, no front can keep the busiest backend within 1.25 × the average at every sample: with 64 in flight the bound is 11 where the average is 8 (1.375 ×).\n\n")
	b.WriteString("| front | in flight per backend | busiest ÷ average: p50 | p99 | max | above 1.25 × | above the bound | above the clients' bound | largest share | smallest share | p50 | p99 | req/s | errors | samples left out | CPU pressure |\n")
	b.WriteString("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	f2 := func(x float64) string { return fmt.Sprintf("%.2f", x) }
	f1 := func(x float64) string { return fmt.Sprintf("%.1f", x) }
	pct := func(x float64) string { return fmtPct(x) }
	for _, x := range r.Rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", x.Label, fmtStat(x.MeanInFlight, f1),
			fmtStat(x.RatioP50, f2), fmtStat(x.RatioP99, f2), fmtStat(x.RatioMax, f2), fmtStat(x.OverFactor, pct), fmtStat(x.OverBound, pct), fmtStat(x.OverCap, pct),
			fmtStat(x.LargestShare, pct), fmtStat(x.LeastShare, pct), fmtStat(x.P50, fmtMs), fmtStat(x.P99, fmtMs),
			fmtStat(x.Throughput, func(v float64) string { return fmt.Sprintf("%.0f", v) }), fmtStat(x.ErrorPct, pct),
			fmtStat(x.ThinPct, pct), fmtStat(x.CPUPressure, func(v float64) string { return fmtPct(100 * v) }))
	}
	b.WriteString("\n## Removal: the keys that move when one of 8 backends leaves\n\n")
	fmt.Fprintf(&b, "Every one of the %d keys is sent once, one at a time, to backends that answer at once (no load: where a key goes is the hash's choice alone), "+
		"before and after one backend is removed. Moved: the keys whose backend changed; ÷ 1/8: moved over the minimum when every backend owns its share; "+
		"moved elsewhere: keys that were not on the removed backend and moved anyway; receivers: the backends the removed one's keys went to (of 7), "+
		"and the largest part of them one took.\n\n", r.Keys)
	b.WriteString("| front | how the backend is removed | moved | ÷ 1/8 | moved elsewhere | receivers | largest part |\n|---|---|--:|--:|--:|--:|--:|\n")
	for _, x := range r.Rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", x.Label, x.How, fmtStat(x.MovedPct, pct),
			fmtStat(x.OfMinimum, func(v float64) string { return fmt.Sprintf("%.3f", v) }),
			fmtStat(x.MovedOther, func(v float64) string { return fmt.Sprintf("%.0f", v) }),
			fmtStat(x.Receivers, func(v float64) string { return fmt.Sprintf("%.0f", v) }), fmtStat(x.LargestPart, pct))
	}
	b.WriteString("\n## Verdict\n\n")
	for _, v := range r.Verdicts {
		b.WriteString("- " + v.String() + "\n")
	}
	b.WriteString("\n## Per seed\n\n| seed | front | shares b1–b8 | busiest ÷ average p99 | removed | owned | moved | moved elsewhere | receivers |\n|--:|---|---|--:|---|--:|--:|--:|--:|\n")
	for _, c := range r.Cases {
		var shares []string
		for _, s := range c.Shares {
			shares = append(shares, fmt.Sprintf("%.1f", float64(s)))
		}
		m := c.Movement
		fmt.Fprintf(&b, "| %d | %s | %s | %.2f | %s | %d | %d | %d | %d |\n", c.Seed, c.Front, strings.Join(shares, " "), c.Balance.RatioP99,
			c.Removed, m.Owned, m.Moved, m.MovedOther, m.Receivers)
		for _, n := range c.Notes {
			fmt.Fprintf(&b, "\nNote (seed %d, %s): %s.\n\n", c.Seed, c.Front, n)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// MarshalJSON writes the balance with null for what it lacks.
func (b balance) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Samples       int     `json:"samples"`
		Thin          int     `json:"thin"`
		MeanInFlight  jsonNum `json:"mean_in_flight"`
		RatioP50      jsonNum `json:"ratio_p50"`
		RatioP99      jsonNum `json:"ratio_p99"`
		RatioMax      jsonNum `json:"ratio_max"`
		BoundRatio    jsonNum `json:"bound_ratio"`
		OverBoundPct  jsonNum `json:"over_bound_pct"`
		OverFactorPct jsonNum `json:"over_factor_pct"`
		OverCapPct    jsonNum `json:"over_cap_pct"`
	}{b.Samples, b.Thin, jsonNum(b.MeanInFlight), jsonNum(b.RatioP50), jsonNum(b.RatioP99), jsonNum(b.RatioMax),
		jsonNum(b.BoundRatio), jsonNum(b.OverBoundPct), jsonNum(b.OverFactorPct), jsonNum(b.OverCapPct)})
}
