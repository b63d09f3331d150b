package rebalance

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/bounds"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/internal/jsonfield"
	"github.com/caddy-lbx/lbx/internal/shed"
)

func init() {
	caddy.RegisterModule(App{})
}

// Metrics a node can balance on (shed states them).
const (
	metricConnections = shed.MetricConnections
	metricThroughput  = shed.MetricThroughput
	metricCPU         = shed.MetricCPU
	metricNodeCPU     = shed.MetricNodeCPU
)

// What metric cpu measures (App.CPU).
const (
	cpuNode    = "node"
	cpuProcess = "process"
)

// Defaults. DefaultInterval is also lb_policy cluster_load's refresh.
const (
	DefaultInterval       = time.Second
	defaultHistory        = 10 * time.Second
	defaultThreshold      = 20.0 // percent
	defaultShedRate       = 0.5  // percent
	defaultMinConnections = 50
)

// App gossips this Caddy node's load through the cluster app (by default
// the connections its HTTP servers hold, smoothed over `history`), and
// sheds a share of its connections every interval while it holds far more
// than the cluster average, so that clients reconnect through the outer
// load balancer to another node.
//
// The cluster average travels by gossip averaging: a few exchanges per
// interval with other members over the cluster's direct messages, whose
// cost per node does not grow with the cluster. A decision uses it when
// this node exchanged within `freshness` and the averaging's estimate of
// the number of members agrees with serf's (within 10%); otherwise it
// uses the members' load tags (lbx_load, published on a change of more
// than 5% and at least every freshness/2), counting only members that
// serf sees alive and whose tag changed within `freshness`: a failed,
// left or silent member never skews the average. A node starts shedding above average × (1 + threshold)
// and keeps shedding down to average × (1 + stop_band); while a member is
// below average × (1 − threshold) (one that joined), every node above the
// average sheds toward the average until that member reaches
// average × (1 − stop_band). It never sheds more than that needs, at most
// `shed_rate` of its connections per interval, never below
// `min_connections`, and not at all with fewer than 2 fresh members.
// Shedding is graceful: idle connections first, then active HTTP
// connections at their next response boundary, upgraded streams last. No
// HTTP/1.1 connection a request may be on is closed: a shed idle one
// closes at its next response boundary (with rebalance_close), or once it
// has stayed idle for `idle_close_after` with no request arriving.
// A shed connection whose response does not end (server-sent events, a
// long poll) counts toward the load again once it has been open `history`
// since the shed, and is closed anyway after `boundary_timeout` if set.
//
// It needs the cluster app in the same config (the `cluster` global
// option). Its state (the load window, whether it is shedding) survives
// config reloads along with the cluster member.
type App struct {
	// The load to balance: "connections" (the HTTP connections
	// held, in any state), "throughput" (bytes per second read from and
	// written to this process's HTTP connections over the last interval,
	// TLS records included), or "cpu" (the node's CPU or this process's,
	// as `cpu` says).
	//
	// Throughput needs the `rebalance` listener wrapper
	// (caddy.listeners.rebalance) before `tls` in the listener_wrappers of
	// at least one HTTP server of the config; a config without it does not
	// load. With throughput and cpu, the connections to shed are sized as
	// connections × (1 − stop line / current load): that assumes the load
	// is spread evenly over the connections, and a node whose bytes flow
	// through a few heavy streams sheds its idle connections first, which
	// carry none, so it keeps shedding at up to shed_rate per interval
	// until the measured load falls into the stop band. Default:
	// connections.
	Metric string `json:"metric,omitempty"`

	// What metric cpu measures: "node", the node's CPU
	// utilisation over the last interval in percent of all its CPUs (0 to
	// 100, from /proc/stat: the other work on the node counts, as it does
	// for OneFS SmartConnect's CPU balancing), or "process", this
	// process's CPU use in percent of one core. Only with metric cpu.
	// Nodes measuring one do not average with nodes measuring the other:
	// they report different metrics. Asking for node where /proc/stat
	// cannot be read fails. Default: node where /proc/stat can be read
	// (Linux), else process.
	CPU string `json:"cpu,omitempty"`

	// How often the node samples its load, gossips it,
	// decides and sheds, from 100ms to 10m. Default: 1s.
	Interval caddy.Duration `json:"interval,omitempty"`

	// The window over which samples are averaged before they
	// are gossiped (one sample per interval): at least interval, at most
	// 24h and 3600 intervals. Default: 10s.
	History caddy.Duration `json:"history,omitempty"`

	// How recently a member's load tag must have changed
	// for the member to count, and how long the gossip average may go
	// without an exchange (and a peer stay silent) before the decision
	// falls back to the tags, from interval to 24h. Default: 5 ×
	// interval, at least 3s.
	Freshness caddy.Duration `json:"freshness,omitempty"`

	// The percentage above the cluster average at which a
	// node starts shedding, above 0 and at most 1000. Default: 20.
	Threshold float64 `json:"threshold,omitempty"`

	// The percentage above the average down to which a
	// shedding node keeps shedding; above 0 and at most `threshold`.
	// Stopping at the threshold itself would leave new nodes stuck below
	// −threshold. Default: `threshold` / 2.
	StopBand float64 `json:"stop_band,omitempty"`

	// The largest percentage of its connections a node sheds
	// per interval (at least one connection), above 0 and at most 100.
	// Default: 0.5.
	ShedRate float64 `json:"shed_rate,omitempty"`

	// The number of connections a node never sheds
	// below, and below which it does not shed at all: with few
	// connections, imbalance is noise. At most 10,000,000. Default: 50.
	MinConnections *int `json:"min_connections,omitempty"`

	// How long a shed active connection is given to
	// reach a response boundary (the end of its response in flight:
	// server-sent events, a long poll, an endless download, a long
	// HTTP/2 stream); once exceeded, it is closed anyway, cutting that
	// response, and counted and logged as forced. Whatever it is, a shed
	// connection still open `history` after the shed counts toward this
	// node's load again (it is not shed twice). At most 24h. Default: 0,
	// never forced: as with gRPC's MaxConnectionAgeGrace, a response in
	// flight is not cut unless the operator asks.
	BoundaryTimeout caddy.Duration `json:"boundary_timeout,omitempty"`

	// How long no node sheds after a member joins (became
	// alive), so that nodes added one after another, as autoscalers and
	// deploys add them, are filled once: connections shed before the last
	// of them is in land on the nodes there, which must shed them again.
	// Joins less than `join_settle` apart make one burst, which holds
	// shedding for at most 4 × `join_settle` from its first join, so steady
	// churn in a large fleet cannot stop it. At most 24h; a negative
	// value (the Caddyfile's `off`) turns the wait off. Default:
	// freshness.
	JoinSettle caddy.Duration `json:"join_settle,omitempty"`

	// How long a shed HTTP/1.1 connection must stay
	// idle before it is closed outright, from 1s to 24h. Until then it is
	// only marked: a request on it gets "Connection: close" on its
	// response (through rebalance_close) and the connection closes after
	// that response, so no request races the close. A connection with
	// bytes arriving (a request on its way) is never closed outright. It
	// also bounds a shed active connection on a route without
	// rebalance_close, which goes the same way once its response is done.
	// Longer than the keep-alive pools of common clients (Go's 90s,
	// nginx's 60s, libcurl's 118s), which drop the connection first, and
	// shorter than Caddy's own idle_timeout (5m). Default: 2m.
	IdleCloseAfter caddy.Duration `json:"idle_close_after,omitempty"`

	cluster *cluster.App
	source  loadSource
	logger  *zap.Logger
	events  emitter
	node    *node // set by Start, cleared by Stop (Caddy calls them in turn)

	// cpuScope is what metric cpu measures (cpuNode or cpuProcess); empty
	// with the other metrics.
	cpuScope string
	// procStat is the /proc/stat file to read the node's CPU from; empty:
	// procStatPath. Tests set it.
	procStat string
	// nodeCPU samples the node's CPU (cpu node), primed by Provision.
	nodeCPU *nodeCPUSampler

	// conns are the process's connections (one process is one cluster
	// node: connections of servers from an earlier config stay counted
	// until they close), from Provision to Cleanup.
	conns *processConns

	// httpApp is the config's HTTP app, when it has one and the process is
	// measured (no test source).
	httpApp *caddyhttp.App
	// checkWrapper says that metric throughput must find a server with the
	// listener wrapper.
	checkWrapper bool
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "rebalance",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision sets defaults, finds the cluster app and registers the
// process's connection tracker with every HTTP server of the config. It
// does not touch the network (it also runs for `caddy validate`).
func (a *App) Provision(ctx caddy.Context) error {
	a.logger = ctx.Logger()
	a.events = newEmitter(ctx)
	a.conns = acquireConns()
	if err := registerMetrics(ctx, a.conns); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	// Before anything sized or timed by the options exists.
	if err := a.validate(); err != nil {
		return err
	}
	a.setDefaults()
	if err := a.resolveCPU(); err != nil {
		return err
	}

	if a.cluster == nil { // tests set their own
		clusterApp, err := cluster.Lookup(ctx, "rebalance")
		if err != nil {
			return err
		}
		a.cluster = clusterApp
	}
	a.cluster.Provide(requireRebalance)
	if err := a.cluster.CheckTagsFit(map[string]string{shed.LoadTag: longestLoadTag(a.reportedMetric())}); err != nil {
		return fmt.Errorf("rebalance: cluster %v", err)
	}

	if a.source == nil {
		src := &processSource{tracker: a.conns.tracker, counters: a.conns.counters, nodeCPU: a.nodeCPU, idleCloseAfter: time.Duration(a.IdleCloseAfter)}
		src.bytes.prime(src.counters.Totals().Total(), time.Now())
		a.source = src
		a.registerServers(ctx)
		a.checkWrapper = a.Metric == metricThroughput
	}
	return nil
}

// requireRebalance is what lb_policy cluster_load requires of the cluster
// app: a rebalance app publishing loads through it (see cluster.App.Require).
const requireRebalance = "the rebalance app (the `rebalance` global option, or the \"rebalance\" app in JSON), which publishes the loads"

// setDefaults writes the default of every option left unset into its
// field, as Caddy's own modules do in Provision, so that the rest of the
// app, its log and its admin view read the options in one place. What
// metric cpu measures by default depends on the machine the config runs
// on, which resolveCPU reads.
func (a *App) setDefaults() {
	if a.Metric == "" {
		a.Metric = metricConnections
	}
	if a.Interval == 0 {
		a.Interval = caddy.Duration(DefaultInterval)
	}
	if a.History == 0 {
		a.History = caddy.Duration(defaultHistory)
	}
	if a.Freshness == 0 {
		a.Freshness = caddy.Duration(max(5*time.Duration(a.Interval), 3*time.Second))
	}
	if a.Threshold == 0 {
		a.Threshold = defaultThreshold
	}
	if a.StopBand == 0 {
		a.StopBand = a.Threshold / 2
	}
	if a.ShedRate == 0 {
		a.ShedRate = defaultShedRate
	}
	if a.MinConnections == nil {
		n := defaultMinConnections
		a.MinConnections = &n
	}
	if a.JoinSettle == 0 {
		a.JoinSettle = a.Freshness
	}
	if a.IdleCloseAfter == 0 {
		a.IdleCloseAfter = caddy.Duration(conntrack.DefaultIdleCloseAfter)
	}
}

// params returns the decision's parameters, once the defaults are in:
// the one place percentages become ratios.
func (a *App) params() shed.Params {
	return shed.Params{
		Threshold:      a.Threshold / 100,
		StopBand:       a.StopBand / 100,
		ShedRate:       a.ShedRate / 100,
		MinConnections: *a.MinConnections,
		Freshness:      time.Duration(a.Freshness),
		Metric:         a.reportedMetric(),
		JoinSettle:     time.Duration(a.JoinSettle),
	}
}

// reportedMetric is the metric the node reports: metric, or
// metricNodeCPU when metric cpu measures the node's CPU.
func (a *App) reportedMetric() string {
	if a.cpuScope == cpuNode {
		return metricNodeCPU
	}
	return a.Metric
}

// resolveCPU settles what metric cpu measures, once the options are valid
// (Provision): cpu as configured, by default node where the node's CPU
// can be read from /proc/stat, else process; with node, the node reports
// metricNodeCPU (reportedMetric). It reads /proc/stat once, which is the node sampler's
// first reading, and fails when cpu node was asked for and /proc/stat
// cannot be read.
func (a *App) resolveCPU() error {
	a.cpuScope, a.nodeCPU = "", nil
	if a.Metric != metricCPU {
		return nil
	}
	scope := a.CPU
	if scope != cpuProcess {
		path := cmp.Or(a.procStat, procStatPath)
		s := newNodeCPUSampler(path)
		_, err := s.sample()
		switch {
		case err == nil:
			scope, a.nodeCPU = cpuNode, s
		case scope == cpuNode:
			return fmt.Errorf("cpu %s: the node's CPU cannot be read from %s (%v); cpu %s measures this process's CPU instead",
				cpuNode, path, err, cpuProcess)
		default:
			a.logger.Debug("the node's CPU cannot be read: metric cpu measures this process's CPU",
				zap.String("file", path), zap.Error(err))
			scope = cpuProcess
		}
	}
	a.cpuScope = scope
	return nil
}

// UnmarshalJSON decodes the app's JSON as Caddy does, naming the field
// of a value that does not decode.
func (a *App) UnmarshalJSON(b []byte) error {
	type appJSON App
	return jsonfield.Decode(b, (*appJSON)(a))
}

// errNoListenerWrapper says how to make metric throughput measure
// something.
const errNoListenerWrapper = "metric throughput needs the rebalance listener wrapper: add `listener_wrappers { rebalance tls }` " +
	"to the servers global option (JSON: \"listener_wrappers\": [{\"wrapper\": \"rebalance\"}, {\"wrapper\": \"tls\"}] in a server)"

// autoHTTPSRedirectServer is the server Caddy's automatic HTTPS adds for
// the HTTP-to-HTTPS redirects no configured server serves
// (caddyhttp/autohttps.go).
const autoHTTPSRedirectServer = "remaining_auto_https_redirects"

// checkThroughputWrapper returns an error when metric throughput has no
// bytes to measure: no HTTP server of the config has the rebalance
// listener wrapper. Servers without it are named in a warning (their
// bytes are not part of the load), except the one Caddy creates itself.
func (a *App) checkThroughputWrapper() error {
	if !a.checkWrapper {
		return nil
	}
	if a.httpApp == nil {
		return fmt.Errorf("%s; this config has no HTTP app", errNoListenerWrapper)
	}
	var counted, uncounted []string
	for name, srv := range a.httpApp.Servers {
		if name == autoHTTPSRedirectServer {
			continue // the operator cannot give it listener wrappers
		}
		if a.conns.servers.has(srv) {
			counted = append(counted, name)
		} else {
			uncounted = append(uncounted, name)
		}
	}
	if len(counted) == 0 {
		return fmt.Errorf("%s; no HTTP server of this config has it", errNoListenerWrapper)
	}
	if len(uncounted) > 0 {
		slices.Sort(uncounted)
		a.logger.Warn("metric throughput: these HTTP servers have no rebalance listener wrapper, their bytes are not part of the load",
			zap.Strings("servers", uncounted))
	}
	return nil
}

// registerServers hooks the tracker into every server of the config's
// HTTP app. Caddy applies RegisterConnState and RegisterConnContext
// callbacks when the HTTP app starts, after every app is provisioned.
func (a *App) registerServers(ctx caddy.Context) {
	appIface, err := ctx.AppIfConfigured("http")
	if err != nil {
		if a.Metric == metricConnections {
			a.logger.Warn("no HTTP app in this config: there are no connections to count or shed", zap.Error(err))
		}
		return
	}
	httpApp := appIface.(*caddyhttp.App)
	a.httpApp = httpApp
	for _, srv := range httpApp.Servers {
		srv.RegisterConnState(a.conns.tracker.ConnState)
		srv.RegisterConnContext(a.conns.tracker.ConnContext)
	}
}

// Validate checks the configuration. The HTTP app is provisioned by now
// (registerServers asked for it, and no module of the HTTP app asks for
// this one), so the listener wrappers of its servers are known.
func (a *App) Validate() error {
	if err := a.validate(); err != nil {
		return err
	}
	return a.checkThroughputWrapper()
}

// Bounds of the app's options. Each rule is stated once, in its check
// function below, for JSON and the Caddyfile alike.
const (
	// minInterval: below it, sampling, gossip and decisions cost a core.
	minInterval = 100 * time.Millisecond
	maxInterval = 10 * time.Minute
	maxHistory  = 24 * time.Hour
	// maxWindowSamples bounds history / interval, the samples the node
	// keeps.
	maxWindowSamples = 3600
	maxFreshness     = 24 * time.Hour
	// maxThreshold, percent: a node may sit several times above the
	// average, but not a thousand.
	maxThreshold       = 1000.0
	maxMinConnections  = 10_000_000
	maxBoundaryTimeout = 24 * time.Hour
	maxJoinSettle      = 24 * time.Hour
	// minIdleCloseAfter: a shorter bound closes connections that clients
	// still hold for reuse, racing their next request.
	minIdleCloseAfter = time.Second
	maxIdleCloseAfter = 24 * time.Hour
)

// appOptions are the app's options, as the Caddyfile names them.
var appOptions = []string{
	"metric", "cpu", "interval", "history", "freshness",
	"threshold", "stop_band", "shed_rate", "min_connections", "boundary_timeout",
	"join_settle", "idle_close_after",
}

// validate checks every option that is set (0 or empty: the default),
// each with the check the Caddyfile runs as it reads the option, then the
// options against each other. It is the app's one validation: Provision
// runs it before anything sized by the options exists, and Validate runs
// it again.
func (a *App) validate() error {
	var minConns error
	if a.MinConnections != nil {
		minConns = checkMinConnections(*a.MinConnections)
	}
	for _, err := range []error{
		unlessZero(a.Metric, checkMetric),
		unlessZero(a.CPU, checkCPU),
		unlessZero(a.Interval, checkInterval),
		unlessZero(a.History, checkHistory),
		unlessZero(a.Freshness, checkFreshness),
		unlessZero(a.Threshold, checkThreshold),
		unlessZero(a.StopBand, checkStopBand),
		unlessZero(a.ShedRate, checkShedRate),
		minConns,
		unlessZero(a.BoundaryTimeout, checkBoundaryTimeout),
		unlessZero(a.JoinSettle, checkJoinSettle),
		unlessZero(a.IdleCloseAfter, checkIdleCloseAfter),
	} {
		if err != nil {
			return err
		}
	}
	return a.checkRelations()
}

// unlessZero checks v with check unless v is its option's zero value,
// which stands for the default.
func unlessZero[T comparable](v T, check func(T) error) error {
	var zero T
	if v == zero {
		return nil
	}
	return check(v)
}

// The rules for each option, shared by validate and the Caddyfile: the
// error names the option, the value and why.

func checkMetric(m string) error {
	switch m {
	case metricConnections, metricThroughput, metricCPU:
		return nil
	}
	return fmt.Errorf("metric %q: want %s, %s or %s", m, metricConnections, metricThroughput, metricCPU)
}

func checkCPU(scope string) error {
	switch scope {
	case cpuNode, cpuProcess:
		return nil
	}
	return fmt.Errorf("cpu %q: want %s or %s", scope, cpuNode, cpuProcess)
}

func checkInterval(d caddy.Duration) error {
	return bounds.Duration("interval", time.Duration(d), minInterval, maxInterval)
}

func checkHistory(d caddy.Duration) error {
	return bounds.Duration("history", time.Duration(d), minInterval, maxHistory)
}

func checkFreshness(d caddy.Duration) error {
	return bounds.Duration("freshness", time.Duration(d), minInterval, maxFreshness)
}

func checkBoundaryTimeout(d caddy.Duration) error {
	return bounds.Duration("boundary_timeout", time.Duration(d), 0, maxBoundaryTimeout)
}

// checkJoinSettle allows a negative join_settle: off.
func checkJoinSettle(d caddy.Duration) error {
	if d < 0 {
		return nil
	}
	return bounds.Duration("join_settle", time.Duration(d), 0, maxJoinSettle)
}

func checkIdleCloseAfter(d caddy.Duration) error {
	return bounds.Duration("idle_close_after", time.Duration(d), minIdleCloseAfter, maxIdleCloseAfter)
}

func checkThreshold(p float64) error { return checkPercent("threshold", p, maxThreshold) }
func checkStopBand(p float64) error  { return checkPercent("stop_band", p, maxThreshold) }
func checkShedRate(p float64) error  { return checkPercent("shed_rate", p, 100) }

func checkMinConnections(n int) error {
	if n < 0 || n > maxMinConnections {
		return fmt.Errorf("min_connections %d: want a whole number from 0 to %d", n, maxMinConnections)
	}
	return nil
}

// checkPercent checks that percentage option opt is above 0 and at most
// hi.
func checkPercent(opt string, v, hi float64) error {
	if v > 0 && v <= hi {
		return nil
	}
	return fmt.Errorf("%s %v%%: want a percentage above 0%% and at most %v%%", opt, v, hi)
}

// checkRelations checks the options against each other, with the
// defaults of those left unset.
func (a *App) checkRelations() error {
	c := *a
	c.setDefaults()
	interval, history, freshness := time.Duration(c.Interval), time.Duration(c.History), time.Duration(c.Freshness)
	switch {
	case c.CPU != "" && c.Metric != metricCPU:
		return fmt.Errorf("cpu %q: cpu is only used with metric %s, and metric is %s", c.CPU, metricCPU, c.Metric)
	case history < interval:
		return fmt.Errorf("history (%v) must be at least interval (%v)", history, interval)
	case windowSize(history, interval) > maxWindowSamples:
		return fmt.Errorf("history %v over interval %v is %d samples, above the maximum %d; lengthen interval or shorten history",
			history, interval, windowSize(history, interval), maxWindowSamples)
	case freshness < interval:
		return fmt.Errorf("freshness %v is below interval %v: a report changes once per interval, so none would count", freshness, interval)
	case c.StopBand > c.Threshold:
		return fmt.Errorf("stop_band %v%% is above threshold %v%%; the stop band must lie inside it", c.StopBand, c.Threshold)
	}
	return nil
}

// longestLoadTag is the longest value the load tag takes for metric: the
// longest number strconv's 'g' format with 6 digits writes, and the
// largest sequence.
func longestLoadTag(metric string) string {
	return metric + " -1.23457e-308 " + strconv.FormatUint(math.MaxUint64, 10)
}

// settings returns what this config asks of the node.
func (a *App) settings() *settings {
	return &settings{
		owner:     a,
		cluster:   a.cluster,
		params:    a.params(),
		interval:  time.Duration(a.Interval),
		history:   time.Duration(a.History),
		boundary:  time.Duration(a.BoundaryTimeout),
		metric:    a.reportedMetric(),
		idleClose: time.Duration(a.IdleCloseAfter),
		source:    a.source,
		logger:    a.logger,
		events:    a.events,
	}
}

// Start starts shedding, or takes over the shedding state of the config
// this one replaces (same cluster member).
func (a *App) Start() error {
	s := a.settings()
	key := a.cluster.Key()
	val, loaded, err := nodes.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newNode(key, a.cluster.NodeName, s), nil
	})
	if err != nil {
		return fmt.Errorf("rebalance: %v", err)
	}
	n := val.(*node)
	if loaded {
		n.attach(s)
	}
	a.node = n
	if p, ok := a.source.(*processSource); ok {
		p.applyIdleClose()
		a.warnNoCloseHandler()
	}
	cpu := zap.Skip()
	if a.cpuScope != "" {
		cpu = zap.String("cpu", a.cpuScope)
	}
	a.logger.Info("rebalance started",
		zap.String("node_name", n.name), zap.Bool("reused_state", loaded),
		zap.String("metric", a.Metric), cpu, zap.Float64("threshold_percent", a.Threshold),
		zap.Float64("stop_band_percent", a.StopBand), zap.Float64("shed_rate_percent", a.ShedRate),
		zap.Int("min_connections", *a.MinConnections), zap.Stringer("interval", s.interval), zap.Stringer("history", s.history),
		zap.Stringer("boundary_timeout", s.boundary), zap.Stringer("join_settle", s.params.EffectiveJoinSettle()),
		zap.Stringer("idle_close_after", s.idleClose))
	return nil
}

// Stop hands the shedding state back: to the config that replaces this
// one, or, when none does, the node stops and withdraws its load tag.
func (a *App) Stop() error {
	n := a.node
	a.node = nil
	if n == nil {
		return nil
	}
	n.detach(a)
	_, err := nodes.Delete(n.key)
	return err
}

// Cleanup releases the member if Stop did not, and the process's
// connections. It is idempotent.
func (a *App) Cleanup() error {
	err := a.Stop()
	if a.conns != nil {
		a.conns = nil
		releaseConns()
	}
	return err
}

// ShedResult says how a shed was carried out, by kind of connection: what
// the node totals, the admin view's shed_total and the rebalance_shed
// event report.
type ShedResult = conntrack.ShedResult

// processSource measures this process: its tracked connections, the
// bytes its listener wrappers count, and its CPU or the node's.
type processSource struct {
	tracker  *conntrack.Tracker
	counters *conntrack.ByteCounters
	nodeCPU  *nodeCPUSampler // cpu node; nil otherwise
	// idleCloseAfter is idle_close_after, which the tracker applies to
	// the connections it sheds.
	idleCloseAfter time.Duration

	mu      sync.Mutex
	lastCPU time.Duration
	lastAt  time.Time
	bytes   rateMeter
}

// Sweep runs the tracker's once-per-interval pass.
func (p *processSource) Sweep(recountAfter, boundaryTimeout time.Duration) conntrack.SweepResult {
	return p.tracker.Sweep(recountAfter, boundaryTimeout)
}

// Sample returns the load in the metric's unit and the connections held.
func (p *processSource) Sample(metric string) (float64, int) {
	held := p.tracker.Counts().Held()
	switch metric {
	case metricCPU:
		return p.cpuPercent(), held
	case metricNodeCPU:
		return p.nodeCPUPercent(), held
	case metricThroughput:
		return p.bytesPerSecond(p.counters.Totals().Total(), time.Now()), held
	}
	return float64(held), held
}

// bytesPerSecond returns the bytes read and written per second since the
// previous sample, total being the bytes counted so far.
func (p *processSource) bytesPerSecond(total uint64, now time.Time) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.bytes.sample(total, now)
}

// Shed sheds n connections through the tracker, with this config's
// idle_close_after (the tracker is the process's: a reload may change
// it).
func (p *processSource) Shed(n int) ShedResult {
	p.applyIdleClose()
	return p.tracker.Shed(n)
}

// applyIdleClose gives the tracker this config's idle_close_after.
func (p *processSource) applyIdleClose() { p.tracker.SetIdleCloseAfter(p.idleCloseAfter) }

// cpuPercent returns the process's CPU use since the previous call, in
// percent of one core (0 on the first call).
func (p *processSource) cpuPercent() float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	cpu, err := processCPUTime()
	now := time.Now()
	if err != nil {
		return 0
	}
	var pct float64
	if !p.lastAt.IsZero() {
		if wall := now.Sub(p.lastAt); wall > 0 {
			pct = 100 * float64(cpu-p.lastCPU) / float64(wall)
		}
	}
	p.lastCPU, p.lastAt = cpu, now
	return pct
}

// nodeCPUPercent returns the node's CPU utilisation since the previous
// call, in percent of all its CPUs (0 when it cannot be read).
func (p *processSource) nodeCPUPercent() float64 {
	if p.nodeCPU == nil {
		return 0
	}
	pct, _ := p.nodeCPU.sample()
	return pct
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.Validator    = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
	_ json.Unmarshaler   = (*App)(nil)
	_ caddy.Destructor   = (*node)(nil)
)
