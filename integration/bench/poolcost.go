package main

// `bench poolcost` measures what a request costs as a partition handler's
// naming file grows (issue 24): 3 live replicas, one per partition of a
// 3-partition scheme, and the rest in a scheme that can take no traffic
// (a 2-partition scheme whose second partition has no replica), so every
// request is served by the same 3 backends whatever the file's size. At
// each size it measures the request latency at fixed rates, Caddy's CPU,
// the time to serve the admin views and /metrics, and Caddy's RSS; at the
// end it shrinks the file back to 3 and measures the RSS again.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/template"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// poolCostConfig is `bench poolcost`'s configuration.
type poolCostConfig struct {
	sizes        []int
	rates        []float64
	warmup       time.Duration
	duration     time.Duration
	adminTimeout time.Duration
	applyTimeout time.Duration
	caddyBin     string
}

// Bounds of `bench poolcost`'s flags.
const (
	poolCostLive     = 3
	poolCostMaxSize  = 1_000_000
	poolCostMaxRate  = 5000.0
	defaultPoolSizes = "3,1000,50000,200000"
	defaultPoolRates = "100,200"
)

// parsePoolCostFlags reads `bench poolcost`'s flags.
func parsePoolCostFlags(args []string, stderr io.Writer) (*poolCostConfig, error) {
	fs := flag.NewFlagSet("bench poolcost", flag.ContinueOnError)
	fs.SetOutput(stderr)
	c := &poolCostConfig{}
	var sizes, rates string
	fs.StringVar(&sizes, "sizes", defaultPoolSizes, "comma-separated naming-file sizes (replicas), in the order run; each at least 3 (the live ones)")
	fs.StringVar(&rates, "rates", defaultPoolRates, "comma-separated request rates (req/s) measured at every size")
	fs.DurationVar(&c.warmup, "warmup", time.Second, "unmeasured warm-up before each measured window")
	fs.DurationVar(&c.duration, "duration", 5*time.Second, "measured window per size and rate")
	fs.DurationVar(&c.adminTimeout, "admin-timeout", 10*time.Second, "how long GET /lbx/upstreams, /lbx/partitions and /metrics may take before they count as timed out")
	fs.DurationVar(&c.applyTimeout, "apply-timeout", 2*time.Minute, "how long a naming-file version may take to be applied")
	fs.StringVar(&c.caddyBin, "caddy", "", "a Caddy binary built with lbx (default: build ./cmd/caddy)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	var err error
	if c.sizes, err = parseSizes(sizes); err != nil {
		return nil, err
	}
	if c.rates, err = parseRates(rates); err != nil {
		return nil, err
	}
	switch {
	case c.duration < time.Second:
		return nil, fmt.Errorf("-duration must be at least 1s, got %v", c.duration)
	case c.warmup < 0:
		return nil, fmt.Errorf("-warmup must not be negative, got %v", c.warmup)
	case c.adminTimeout <= 0:
		return nil, fmt.Errorf("-admin-timeout must be positive, got %v", c.adminTimeout)
	case c.applyTimeout <= 0:
		return nil, fmt.Errorf("-apply-timeout must be positive, got %v", c.applyTimeout)
	}
	return c, nil
}

// parseSizes parses -sizes.
func parseSizes(list string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < poolCostLive || n > poolCostMaxSize {
			return nil, fmt.Errorf("-sizes: %q is not a size between %d and %d", f, poolCostLive, poolCostMaxSize)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, errors.New("-sizes: no size given")
	}
	return out, nil
}

// parseRates parses -rates.
func parseRates(list string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		r, err := strconv.ParseFloat(f, 64)
		if err != nil || !(r > 0) || r > poolCostMaxRate {
			return nil, fmt.Errorf("-rates: %q is not a rate above 0 and at most %g", f, poolCostMaxRate)
		}
		out = append(out, r)
	}
	if len(out) == 0 {
		return nil, errors.New("-rates: no rate given")
	}
	return out, nil
}

// writeNamingFile writes a naming file of n replicas: live[i] tagged
// i/len(live), then n − len(live) replicas on distinct loopback addresses
// (127.1.0.0 on, never dialled) all tagged 0/2, a scheme whose partition 1
// has no replica and so takes no traffic. It writes next to path and
// renames, as the partition docs ask.
func writeNamingFile(path string, n int, live []string) error {
	var b bytes.Buffer
	w := bufio.NewWriter(&b)
	fmt.Fprintf(w, "# bench poolcost: %d replicas, %d live\n", n, len(live))
	for i, a := range live {
		fmt.Fprintf(w, "%s %d/%d\n", a, i, len(live))
	}
	for i := range max(0, n-len(live)) {
		fmt.Fprintf(w, "127.%d.%d.%d:9 0/2\n", 1+i>>16, (i>>8)&0xff, i&0xff)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b.Bytes(), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// poolCostTemplate is the Caddy config: the admin API, info logs (the
// naming file's "loaded" line tells when a version is applied), and a
// partition handler on the naming file with every default but those a
// benchmark needs: a short poll, any shrink allowed, concatenated
// answers.
var poolCostTemplate = template.Must(template.New("Caddyfile").Parse(`{
	admin 127.0.0.1:{{.AdminPort}}
	persist_config off
	auto_https off
	grace_period 1s
}

http://:{{.Port}} {
	bind 127.0.0.1
	partition {
		naming_file {{.Naming}}
		naming_max_removed_percent 100%
		poll_interval 200ms
		merge concat
	}
}
`))

// poolCostPorts fill poolCostTemplate.
type poolCostPorts struct {
	Port, AdminPort int
	Naming          string
}

// adminTiming is one GET of an admin view.
type adminTiming struct {
	Path     string
	Took     time.Duration
	Bytes    int64
	Status   int
	TimedOut bool
	Err      string
}

// String renders the timing for a table cell.
func (a adminTiming) String() string {
	switch {
	case a.TimedOut:
		return fmt.Sprintf("> %v (timeout)", a.Took.Round(time.Millisecond))
	case a.Err != "":
		return "error: " + a.Err
	case a.Status != http.StatusOK:
		return fmt.Sprintf("%d in %v", a.Status, a.Took.Round(time.Millisecond))
	}
	return fmt.Sprintf("%v, %s", a.Took.Round(time.Millisecond), fmtBytes(a.Bytes))
}

func fmtBytes(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.0f kB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// poolCostRate is one measured window at one size.
type poolCostRate struct {
	Rate     float64
	P50, P99 time.Duration
	Requests int
	Errors   int
	CPUPct   float64 // Caddy's CPU over the window, % of one core; NaN if unknown
}

// poolCostSize is everything measured at one size.
type poolCostSize struct {
	Size  int
	Apply time.Duration
	RSS   int64 // bytes, after applying; 0 if unknown
	Rates []poolCostRate
	Admin []adminTiming
}

// poolCostResult is a whole run.
type poolCostResult struct {
	Sizes       []poolCostSize
	RSSStart    int64
	RSSAfter    int64
	ShrinkApply time.Duration
}

// runPoolCost is `bench poolcost`.
func runPoolCost(ctx context.Context, args []string, cmdline string, out, progress io.Writer) error {
	cfg, err := parsePoolCostFlags(args, progress)
	if err != nil {
		return err
	}
	began := time.Now()
	tmp, err := os.MkdirTemp("", "lbx-bench-poolcost-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	bin, source, err := caddyBinary(ctx, cfg.caddyBin, tmp, progress)
	if err != nil {
		return err
	}
	var live []string
	for i := range poolCostLive {
		b, err := loadmodel.StartBackend(loadmodel.Model{Name: fmt.Sprintf("p%d", i), Workers: 8, Service: time.Millisecond, Jitter: 0.25})
		if err != nil {
			return err
		}
		defer b.Close()
		live = append(live, b.Addr())
	}
	naming := filepath.Join(tmp, "server_list")
	if err := writeNamingFile(naming, poolCostLive, live); err != nil {
		return err
	}
	ports, err := fleet.FreePorts(2)
	if err != nil {
		return err
	}
	pc := poolCostPorts{Port: ports[0], AdminPort: ports[1], Naming: naming}
	cfgPath := filepath.Join(tmp, "Caddyfile")
	var cb bytes.Buffer
	if err := poolCostTemplate.Execute(&cb, pc); err != nil {
		return err
	}
	if err := os.WriteFile(cfgPath, cb.Bytes(), 0o644); err != nil {
		return err
	}
	logPath := filepath.Join(tmp, "caddy.log")
	p, err := startProcess("caddy", logPath, proxyEnv(tmp), bin, "run", "--config", cfgPath, "--adapter", "caddyfile")
	if err != nil {
		return err
	}
	defer p.stop()
	url := fmt.Sprintf("http://127.0.0.1:%d/", pc.Port)
	admin := fmt.Sprintf("http://127.0.0.1:%d/", pc.AdminPort)
	if err := waitReady(ctx, url, p); err != nil {
		return fmt.Errorf("caddy: %w\n%s", err, p.logTail())
	}
	res := &poolCostResult{}
	res.RSSStart, _ = processRSS(p.pid())
	fmt.Fprintf(progress, "caddy ready, RSS %s with %d replicas\n", fmtBytes(res.RSSStart), poolCostLive)

	measure := func(n int, apply time.Duration) (poolCostSize, error) {
		s := poolCostSize{Size: n, Apply: apply}
		s.RSS, _ = processRSS(p.pid())
		for _, rate := range cfg.rates {
			r, err := poolCostWindow(ctx, p, url, rate, cfg.warmup, cfg.duration)
			if err != nil {
				return s, err
			}
			s.Rates = append(s.Rates, r)
			fmt.Fprintf(progress, "%7d replicas  %4.0f req/s  p50 %6.2f ms  p99 %7.2f ms  errors %d/%d  caddy CPU %.0f%%\n",
				n, rate, ms(r.P50), ms(r.P99), r.Errors, r.Requests, r.CPUPct)
		}
		for _, path := range []string{"lbx/upstreams", "lbx/partitions", "metrics"} {
			a := timeGet(ctx, admin+path, cfg.adminTimeout)
			a.Path = "/" + path
			s.Admin = append(s.Admin, a)
			fmt.Fprintf(progress, "%7d replicas  GET %s: %s\n", n, a.Path, a)
		}
		return s, nil
	}
	current := poolCostLive
	for _, n := range cfg.sizes {
		var apply time.Duration
		if n != current {
			if apply, err = applyNaming(ctx, naming, n, live, logPath, cfg.applyTimeout); err != nil {
				return err
			}
			current = n
		}
		s, err := measure(n, apply)
		if err != nil {
			return err
		}
		res.Sizes = append(res.Sizes, s)
	}
	if current != poolCostLive {
		if res.ShrinkApply, err = applyNaming(ctx, naming, poolCostLive, live, logPath, cfg.applyTimeout); err != nil {
			return err
		}
		// A window of traffic after the shrink, so that what is released
		// has had the time a running server would give it.
		if _, err := poolCostWindow(ctx, p, url, cfg.rates[0], 0, cfg.duration); err != nil {
			return err
		}
	}
	res.RSSAfter, _ = processRSS(p.pid())
	fmt.Fprintf(progress, "after shrinking back to %d: RSS %s\n", poolCostLive, fmtBytes(res.RSSAfter))

	var b strings.Builder
	fmt.Fprintf(&b, "# bench poolcost\n\n`%s`; %s. %d live replicas (1 ms, 8 workers each) in a 3-partition scheme, the rest of the naming file in a 2-partition scheme with no replica for partition 1 (no capacity, never chosen). "+
		"Per size and rate: %v warm-up, %v measured, open loop. Total %v.\n\n",
		cmdline, source, poolCostLive, cfg.warmup, cfg.duration, time.Since(began).Round(time.Second))
	b.WriteString(res.markdown())
	_, err = io.WriteString(out, b.String())
	return err
}

// applyNaming writes a naming file of n replicas and waits until Caddy's
// log says a version of n upstreams was loaded; it returns how long that
// took.
func applyNaming(ctx context.Context, path string, n int, live []string, logPath string, timeout time.Duration) (time.Duration, error) {
	before, err := os.ReadFile(logPath)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := writeNamingFile(path, n, live); err != nil {
		return 0, err
	}
	want := fmt.Sprintf(`"upstreams":%d,`, n)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(logPath)
		if err != nil {
			return 0, err
		}
		if len(b) > len(before) && loadedLine(b[len(before):], want) {
			return time.Since(start), nil
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("a naming file of %d replicas was not applied within %v", n, timeout)
		case <-tick.C:
		}
	}
}

// loadedLine reports whether log holds a "loaded naming file" line with
// want in it.
func loadedLine(log []byte, want string) bool {
	for line := range bytes.Lines(log) {
		if bytes.Contains(line, []byte("loaded naming file")) && bytes.Contains(line, []byte(want)) {
			return true
		}
	}
	return false
}

// poolCostWindow sends the load at rate and measures it with Caddy's CPU.
func poolCostWindow(ctx context.Context, p *process, url string, rate float64, warmup, d time.Duration) (poolCostRate, error) {
	r := poolCostRate{Rate: rate, CPUPct: math.NaN()}
	var cpu0 time.Duration
	var ok0 bool
	var t0 time.Time
	l := loadmodel.Load{URL: url, Rate: rate, Warmup: warmup, Duration: d, Timeout: 2 * time.Second,
		OnMeasure: func() { t0 = time.Now(); cpu0, ok0 = groupCPUOK(p.pid()) }}
	res, err := l.Run(ctx)
	if err != nil {
		return r, err
	}
	if cpu1, ok1 := groupCPUOK(p.pid()); ok0 && ok1 {
		r.CPUPct = 100 * float64(cpu1-cpu0) / float64(time.Since(t0))
	}
	s := loadmodel.Summarize(res)
	r.P50, r.P99, r.Requests, r.Errors = s.P50, s.P99, s.Requests, s.Errors
	return r, nil
}

// groupCPUOK is groupCPU where supported.
func groupCPUOK(pid int) (time.Duration, bool) {
	if !cpuSupported {
		return 0, false
	}
	d, err := groupCPU(pid)
	return d, err == nil
}

// timeGet times a GET of url, reading the whole body, within timeout.
func timeGet(ctx context.Context, url string, timeout time.Duration) adminTiming {
	var a adminTiming
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		a.Err = err.Error()
		return a
	}
	resp, err := http.DefaultClient.Do(req)
	if err == nil {
		a.Status = resp.StatusCode
		a.Bytes, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	a.Took = time.Since(start)
	if err != nil {
		if ctx.Err() != nil {
			a.TimedOut = true
		} else {
			a.Err = err.Error()
		}
	}
	return a
}

// markdown renders the result and the criteria.
func (r *poolCostResult) markdown() string {
	var b strings.Builder
	b.WriteString("| replicas | applied in | RSS | rate | p50 | p99 | errors | Caddy CPU | /lbx/upstreams | /lbx/partitions | /metrics |\n")
	b.WriteString("| --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |\n")
	for _, s := range r.Sizes {
		for i, x := range s.Rates {
			apply, rss, admin := "", "", []string{"", "", ""}
			if i == 0 {
				apply, rss = "—", fmtBytes(s.RSS)
				if s.Apply > 0 {
					apply = s.Apply.Round(time.Millisecond).String()
				}
				for j, a := range s.Admin {
					admin[j] = a.String()
				}
			}
			fmt.Fprintf(&b, "| %d | %s | %s | %.0f | %s | %s | %d of %d | %.0f%% | %s | %s | %s |\n",
				s.Size, apply, rss, x.Rate, fmtMs(ms(x.P50)), fmtMs(ms(x.P99)), x.Errors, x.Requests, x.CPUPct, admin[0], admin[1], admin[2])
		}
	}
	fmt.Fprintf(&b, "\nRSS: %s at the start, %s after shrinking back to %d (applied in %v).\n\n",
		fmtBytes(r.RSSStart), fmtBytes(r.RSSAfter), poolCostLive, r.ShrinkApply.Round(time.Millisecond))
	for _, v := range r.verdicts() {
		b.WriteString("- " + v.String() + "\n")
	}
	return b.String()
}

// verdicts evaluates issue 24's criteria: at every rate the p50 at the
// largest size within 2× of the smallest's, the admin views and /metrics
// under a second at the largest size, and the RSS after shrinking within
// 1.5× of the start.
func (r *poolCostResult) verdicts() []verdict {
	if len(r.Sizes) == 0 {
		return nil
	}
	small, large := r.Sizes[0], r.Sizes[0]
	for _, s := range r.Sizes {
		if s.Size < small.Size {
			small = s
		}
		if s.Size > large.Size {
			large = s
		}
	}
	var out []verdict
	for i, x := range large.Rates {
		name := fmt.Sprintf("p50 at %d replicas ≤ 2 × at %d, %.0f req/s", large.Size, small.Size, x.Rate)
		if i >= len(small.Rates) {
			out = append(out, missing(name, "not measured"))
			continue
		}
		out = append(out, compare(name, ms(x.P50), 2*ms(small.Rates[i].P50), "≤", "ms", ""))
		out = append(out, compare(fmt.Sprintf("errors at %d replicas, %.0f req/s", large.Size, x.Rate), float64(x.Errors), 0, "≤", "", ""))
	}
	for _, a := range large.Admin {
		name := fmt.Sprintf("GET %s at %d replicas < 1 s", a.Path, large.Size)
		took := ms(a.Took)
		if a.Err != "" || (!a.TimedOut && a.Status != http.StatusOK) {
			took = math.Inf(1)
		}
		out = append(out, compare(name, took, 1000, "<", "ms", a.String()))
	}
	if r.RSSStart > 0 && r.RSSAfter > 0 {
		out = append(out, compare("RSS after shrinking ≤ 1.5 × at the start", float64(r.RSSAfter)/float64(r.RSSStart), 1.5, "≤", "",
			fmt.Sprintf("%s → %s", fmtBytes(r.RSSStart), fmtBytes(r.RSSAfter))))
	} else {
		out = append(out, missing("RSS after shrinking ≤ 1.5 × at the start", "RSS not readable here"))
	}
	return out
}
