package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
)

// reloadConfig is the configuration of `bench reload`.
type reloadConfig struct {
	caddyBin, stockBin string
	runs, reloads      int
	clients            int
	gap                time.Duration
	// tls serves HTTPS (tls internal); http2 speaks HTTP/2 over it.
	tls, http2 bool
}

func parseReloadFlags(args []string, stderr io.Writer) (*reloadConfig, error) {
	fs := flag.NewFlagSet("bench reload", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: "+benchCommand+" reload [flags]\n\n"+
			"Counts the requests a config reload loses under a stream of new\n"+
			"connections, side by side in each run: stock Caddy, an lbx node\n"+
			"(cluster, rebalance and rebalance_close), and stock Caddy's config on\n"+
			"the lbx build with the lbx_handoff listener wrapper. Every client opens a new\n"+
			"connection for each request; each reload changes the config, so Caddy\n"+
			"starts new servers and stops the old ones. Prints a Markdown table.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	c := &reloadConfig{}
	fs.StringVar(&c.caddyBin, "caddy", "", "use this Caddy binary (built with lbx) instead of building ./cmd/caddy")
	fs.StringVar(&c.stockBin, "stock", "", "use this stock Caddy binary instead of building the version lbx requires")
	fs.IntVar(&c.runs, "runs", 3, "runs; each runs every build, in an order that rotates")
	fs.IntVar(&c.reloads, "reloads", 20, "reloads per build and run")
	fs.IntVar(&c.clients, "clients", 64, "clients, each sending its next request on a new connection as soon as the last returns")
	fs.DurationVar(&c.gap, "gap", 300*time.Millisecond, "time between reloads")
	fs.BoolVar(&c.tls, "tls", false, "serve HTTPS (tls internal) and connect with TLS; leaves out the lbx node build")
	fs.BoolVar(&c.http2, "http2", false, "with -tls: HTTP/2 (each request still on a new connection)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	case c.runs < 1 || c.runs > 100:
		return nil, fmt.Errorf("-runs %d: want 1 to 100", c.runs)
	case c.reloads < 1 || c.reloads > 1000:
		return nil, fmt.Errorf("-reloads %d: want 1 to 1000", c.reloads)
	case c.clients < 1 || c.clients > 1000:
		return nil, fmt.Errorf("-clients %d: want 1 to 1000", c.clients)
	case c.gap < 50*time.Millisecond || c.gap > time.Minute:
		return nil, fmt.Errorf("-gap %v: want 50ms to 1m", c.gap)
	case c.http2 && !c.tls:
		return nil, fmt.Errorf("-http2 needs -tls (Caddy speaks cleartext HTTP/2 only to clients that know it does)")
	}
	return c, nil
}

// reloadRun is one build's result in one run.
type reloadRun struct {
	requests, failed int
	kinds            map[string]int // failures by the error's last part
	// handedOver is caddy_lbx_handoff_connections_total at the end, or
	// -1 where the build has no lbx_handoff.
	handedOver int
}

// reloadTarget is a running Caddy the benchmark reloads, serving "ok" at
// url.
type reloadTarget struct {
	node   *fleet.Node
	url    string
	reload func(gen int) error
}

// runReload is `bench reload`; it returns each build's runs.
func runReload(ctx context.Context, args []string, cmdline string, out, progress io.Writer) (map[string][]reloadRun, error) {
	cfg, err := parseReloadFlags(args, progress)
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "lbx-bench-reload-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	lbxBin, source, err := caddyBinary(ctx, cfg.caddyBin, tmp, progress)
	if err != nil {
		return nil, err
	}
	stockBin, stockSource := cfg.stockBin, "stock Caddy given with -stock"
	if stockBin == "" {
		root, err := moduleRoot(ctx)
		if err != nil {
			return nil, err
		}
		stockBin = filepath.Join(tmp, "stock-caddy")
		fmt.Fprintf(progress, "building stock Caddy …\n")
		if err := fleet.BuildStockCaddy(ctx, root, stockBin); err != nil {
			return nil, err
		}
		stockSource = "stock Caddy as lbx's go.mod requires it, built"
	}
	proto := "HTTP/1.1"
	switch {
	case cfg.http2:
		proto = "HTTP/2 over TLS"
	case cfg.tls:
		proto = "HTTP/1.1 over TLS"
	}
	fmt.Fprintf(out, "# Requests lost to reloads\n\n`%s`; %s; %s; %d clients, each request on a new connection (%s); %d reloads %v apart per build and run; load average %s at the start.\n\n",
		cmdline, source, stockSource, cfg.clients, proto, cfg.reloads, cfg.gap, loadAverage())

	builds := []string{buildStock, buildLbx, buildHandoff}
	if cfg.tls {
		builds = []string{buildStock, buildHandoff} // the lbx node serves HTTP only
	}
	results := map[string][]reloadRun{}
	for i := range cfg.runs {
		order := append(slices.Clone(builds[i%len(builds):]), builds[:i%len(builds)]...)
		for _, b := range order {
			if ctx.Err() != nil {
				return results, ctx.Err()
			}
			fmt.Fprintf(progress, "run %d of %d: %s …\n", i+1, cfg.runs, b)
			dir := filepath.Join(tmp, fmt.Sprintf("run%d-%d", i+1, len(results[b])))
			var target *reloadTarget
			switch b {
			case buildLbx:
				target, err = startLbxReloadTarget(lbxBin, dir, "")
			case buildHandoff:
				target, err = startStockReloadTarget(lbxBin, dir, cfg.tls, "\tservers {\n\t\tlistener_wrappers {\n\t\t\tlbx_handoff\n\t\t\ttls\n\t\t}\n\t}\n", "")
			default:
				target, err = startStockReloadTarget(stockBin, dir, cfg.tls, "", "")
			}
			if err != nil {
				return results, fmt.Errorf("run %d, %s: %w", i+1, b, err)
			}
			r, err := measureReloads(ctx, target, cfg)
			r.handedOver = -1
			if b == buildHandoff && err == nil {
				r.handedOver, err = handedOver(target.node)
			}
			if kerr := target.node.Proc.Kill(); err == nil {
				err = kerr
			}
			if err != nil {
				return results, fmt.Errorf("run %d, %s: %w", i+1, b, err)
			}
			results[b] = append(results[b], r)
		}
	}

	fmt.Fprintf(out, "| build | run | requests | failed | failed per reload | by error | handed over |\n|---|--:|--:|--:|--:|---|--:|\n")
	perReload := map[string][]float64{}
	for _, b := range builds {
		for i, r := range results[b] {
			per := float64(r.failed) / float64(cfg.reloads)
			perReload[b] = append(perReload[b], per)
			var kinds []string
			for k, n := range r.kinds {
				kinds = append(kinds, fmt.Sprintf("%d %s", n, k))
			}
			slices.Sort(kinds)
			handed := "–"
			if r.handedOver >= 0 {
				handed = fmt.Sprint(r.handedOver)
			}
			fmt.Fprintf(out, "| %s | %d | %d | %d | %.1f | %s | %s |\n", b, i+1, r.requests, r.failed, per, strings.Join(kinds, ", "), handed)
		}
	}
	fmt.Fprintf(out, "\nMedian failed per reload: ")
	for i, b := range builds {
		v := slices.Clone(perReload[b])
		slices.Sort(v)
		if i > 0 {
			fmt.Fprintf(out, "; ")
		}
		fmt.Fprintf(out, "%s %.1f [%.1f–%.1f]", b, median(slices.Clone(v)), v[0], v[len(v)-1])
	}
	fmt.Fprintf(out, ".\n")
	return results, nil
}

// The builds `bench reload` compares.
const (
	buildStock   = "stock Caddy"
	buildLbx     = "lbx"
	buildHandoff = "lbx_handoff"
)

// startStockReloadTarget starts bin with a site serving "ok" (over HTTPS
// with tls internal if useTLS), with handler when given (a reverse_proxy
// to a backend that answers "ok"), and the global options extra
// (tab-indented lines), and reloads it with a header that changes, so
// that every load is a new config.
func startStockReloadTarget(bin, dir string, useTLS bool, extra, handler string) (*reloadTarget, error) {
	if handler == "" {
		handler = `respond "ok"`
	}
	ports, err := fleet.FreePorts(2)
	if err != nil {
		return nil, err
	}
	n := &fleet.Node{Name: "stock", Admin: fmt.Sprintf("127.0.0.1:%d", ports[0]), HTTP: fmt.Sprintf("127.0.0.1:%d", ports[1])}
	scheme, https, site := "http", "\tauto_https off\n", ""
	if useTLS {
		scheme, https, site = "https", "\tauto_https disable_redirects\n\tlocal_certs\n\tskip_install_trust\n", "\ttls internal\n"
	}
	caddyfile := func(gen int) string {
		return fmt.Sprintf("{\n\tadmin %s\n\tpersist_config off\n%s\tdefault_bind 127.0.0.1\n%s}\n\n%s://%s {\n%s\theader X-Config-Generation %d\n\t%s\n}\n",
			n.Admin, https, extra, scheme, n.HTTP, site, gen, handler)
	}
	if n.Proc, err = fleet.StartProc(bin, dir, caddyfile(0)); err != nil {
		return nil, err
	}
	t := &reloadTarget{node: n, url: scheme + "://" + n.HTTP + "/", reload: func(gen int) error { return n.Load(caddyfile(gen)) }}
	if err := t.waitServing(); err != nil {
		_ = n.Proc.Kill()
		return nil, err
	}
	return t, nil
}

// startLbxReloadTarget starts an lbx node (a one-member cluster, the
// rebalance app, rebalance_close in the site) without lbx_handoff,
// proxying to backend when given, and reloads it with a tag that changes.
func startLbxReloadTarget(bin, dir, backend string) (*reloadTarget, error) {
	spec := fleet.NodeSpec{Name: "lbx", NoHandoff: true, Settings: fleet.Settings{
		Interval: "1s", History: "5s", Freshness: "5s", Threshold: 20, ShedRate: 0.5, MinConnections: 5, Backend: backend,
	}}
	n, err := fleet.StartNode(bin, dir, spec)
	if err != nil {
		return nil, err
	}
	t := &reloadTarget{node: n, url: "http://" + n.HTTP + "/", reload: func(gen int) error {
		s := spec
		s.Tags = map[string]string{"generation": fmt.Sprint(gen)}
		return n.Reload(s)
	}}
	if err := t.waitServing(); err != nil {
		_ = n.Proc.Kill()
		return nil, err
	}
	return t, nil
}

// handedOver reads caddy_lbx_handoff_connections_total from n's /metrics.
func handedOver(n *fleet.Node) (int, error) {
	res, err := http.Get("http://" + n.Admin + "/metrics")
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(body)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "caddy_lbx_handoff_connections_total "); ok {
			var f float64
			_, err := fmt.Sscan(v, &f)
			return int(f), err
		}
	}
	return 0, fmt.Errorf("%s: no caddy_lbx_handoff_connections_total in /metrics", n.Name)
}

// waitServing waits up to 20 s for the target's site to answer.
func (t *reloadTarget) waitServing() error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := newConnGet(t.url, false)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not serve within 20s: %v\n%s", t.node.Name, err, t.node.Proc.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// insecureTLS trusts the test's own certificates (tls internal). Each
// transport gets its own: one that attempts HTTP/2 adds "h2" to the
// NextProtos of the config it was given.
func insecureTLS() *tls.Config { return &tls.Config{InsecureSkipVerify: true} }

// h1Transport sends each request on a new HTTP/1.1 connection.
var h1Transport = &http.Transport{DisableKeepAlives: true, TLSClientConfig: insecureTLS()}

// newConnGet sends one GET to url on a new connection, over HTTP/2 if
// http2 (and TLS), and wants 200 "ok".
func newConnGet(url string, http2 bool) error {
	tr := h1Transport
	if http2 {
		// A transport of its own: HTTP/2 would send the next request on
		// the same connection.
		tr = &http.Transport{TLSClientConfig: insecureTLS(), ForceAttemptHTTP2: true}
		defer tr.CloseIdleConnections()
	}
	return getOK(&http.Client{Transport: tr, Timeout: 5 * time.Second}, url)
}

// measureReloads runs the clients against target for cfg.reloads reloads
// and counts the requests that failed.
func measureReloads(ctx context.Context, target *reloadTarget, cfg *reloadConfig) (reloadRun, error) {
	r := reloadRun{kinds: map[string]int{}}
	var mu sync.Mutex
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range cfg.clients {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				err := newConnGet(target.url, cfg.http2)
				mu.Lock()
				r.requests++
				if err != nil {
					r.failed++
					r.kinds[errorKind(err)]++
				}
				mu.Unlock()
			}
		})
	}
	var err error
	for gen := 1; gen <= cfg.reloads && err == nil && ctx.Err() == nil; gen++ {
		time.Sleep(cfg.gap)
		err = target.reload(gen)
	}
	time.Sleep(cfg.gap)
	close(stop)
	wg.Wait()
	return r, errors.Join(err, ctx.Err())
}

// getOK sends one GET and wants 200 "ok".
func getOK(cl *http.Client, url string) error {
	res, err := cl.Get(url)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	if err != nil {
		return err
	}
	if res.StatusCode != http.StatusOK || string(body) != "ok" {
		return fmt.Errorf("status %d", res.StatusCode)
	}
	return nil
}

// errorKind names an error by its last part ("EOF", "connection reset by
// peer"), without the addresses.
func errorKind(err error) string {
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 {
		s = s[i+2:]
	}
	return s
}
