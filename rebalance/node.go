package rebalance

import (
	"bytes"
	"fmt"
	"log"
	"maps"
	"math"
	"net"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/dustin/go-humanize"
	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// LoadTag is the serf member tag in which a node gossips its load:
// "<metric> <smoothed load> <sequence>". The sequence grows with every
// report, so a receiver sees a live node's tag change every interval and
// judges freshness with its own clock (clock skew between nodes does not
// matter).
const LoadTag = "lbx_load"

// nodes holds the serf members of this process, keyed by bind address: a
// config reload starts the new config (which finds the member here) before
// stopping the old one, so the member survives without leaving, rejoining
// or binding its port twice. Its Destruct leaves the cluster.
var nodes = caddy.NewUsagePool()

// settings are what one config asks of the node. The node runs with the
// settings of the most recently started config that still runs.
type settings struct {
	owner     *App
	params    Params
	interval  time.Duration
	history   time.Duration
	boundary  time.Duration // boundary_timeout; 0: never forced
	tags      map[string]string
	join      []string
	metric    string
	source    loadSource
	logger    *zap.Logger
	events    emitter
	name      string // node name: fixed for the member's life
	keyID     string // fingerprint of the gossip key: fixed too
	advertise string
}

// loadSource measures this node's load and sheds its connections.
type loadSource interface {
	// Sweep runs once per interval, before Sample: it forgets closed
	// upgraded connections, counts shed connections open recountAfter
	// after the shed toward the load again, and closes those still
	// without a response boundary after boundaryTimeout (0: never).
	Sweep(recountAfter, boundaryTimeout time.Duration) SweepResult
	// Sample returns the load in the metric's unit and the connections
	// held (those shed and still closing excluded; overdue ones count).
	Sample(metric string) (load float64, held int)
	// Shed sheds up to n connections.
	Shed(n int) ShedResult
}

// seenReport is what this node last saw in a member's load tag, and when
// it changed.
type seenReport struct {
	raw string
	at  time.Time // zero until the tag is seen to change
}

// node is this process's serf member and its decision loop.
type node struct {
	key    string
	name   string
	serf   *serf.Serf
	logger *zap.Logger

	mu       sync.Mutex
	owners   []*settings // oldest first; the last one drives
	window   *Window
	seq      uint64
	shedding bool      // the high rule's hysteresis state
	lift     LiftState // the lift rule's state
	seen     map[string]seenReport
	members  []Report // as of the last decision
	last     Decision
	lastAt   time.Time
	local    float64
	current  float64
	held     int
	shed     ShedResult // totals since the node started
	forced   uint64     // shed connections closed at boundary_timeout, since the node started
	// lastForced is the number forced in the last interval.
	lastForced int
	// shedDecisions counts the intervals that shed since the node started.
	shedDecisions uint64
	joined        bool
	joinErr       string
	// conflict is set once serf shut this member down because another
	// member claims its name (see lostMember).
	conflict string
	// conflictWith is the address of a member that claims this node's
	// name, as serf last logged it, and resolving when serf started its
	// vote on the name (monoSince; 0: no vote running). Not under mu:
	// serf logs while it holds its own locks.
	conflictWith atomic.Pointer[string]
	resolving    atomic.Int64

	// steps is the node's coarse clock: when its last decision step
	// took in the members' reports, as monoSince. It advances once per
	// interval; policies that cache what they read from the node compare
	// it with their cache's age instead of reading the clock per request.
	steps atomic.Int64

	stop chan struct{}
	done sync.WaitGroup
}

// monoEpoch is the origin of monoSince.
var monoEpoch = time.Now()

// monoSince returns t on a monotonic clock, in nanoseconds since the
// process loaded this package (wall-clock changes do not move it).
func monoSince(t time.Time) int64 { return int64(t.Sub(monoEpoch)) }

// newNode creates the serf member for s and starts its loops. It binds the
// gossip port.
func newNode(key string, s *settings, key32 []byte, bindHost string, bindPort int) (*node, error) {
	n := &node{
		key:    key,
		name:   s.name,
		logger: s.logger.With(zap.String("node", s.name)),
		seen:   make(map[string]seenReport),
		window: NewWindow(windowSize(s.history, s.interval)),
		stop:   make(chan struct{}),
		owners: []*settings{s},
	}

	conf := serf.DefaultConfig()
	conf.Init()
	conf.NodeName = n.name
	conf.Tags = n.tagsFor(s, "")
	stdlog := log.New(&zapWriter{logger: n.logger.Named("serf"), conflict: n.sawConflict, conflictOver: n.conflictOver}, "", 0)
	conf.LogOutput = nil
	conf.Logger = stdlog
	conf.EnableNameConflictResolution = true
	// SetTags waits for its broadcast up to BroadcastTimeout (default 5 s,
	// also the Leave broadcast's wait): keep a step within about two
	// intervals when no peer acknowledges.
	conf.BroadcastTimeout = min(max(2*s.interval, 500*time.Millisecond), 5*time.Second)
	ml := conf.MemberlistConfig
	ml.BindAddr = bindHost
	ml.BindPort = bindPort
	ml.LogOutput = nil
	ml.Logger = stdlog
	if s.advertise != "" {
		host, port, err := splitHostPort(s.advertise, "advertise")
		if err != nil {
			return nil, err
		}
		ml.AdvertiseAddr = host
		ml.AdvertisePort = port
	}
	if key32 != nil {
		kr, err := memberlist.NewKeyring(nil, key32)
		if err != nil {
			return nil, fmt.Errorf("encrypt_key: %v", err)
		}
		ml.Keyring = kr
	}
	sf, err := serf.Create(conf)
	if err != nil {
		return nil, fmt.Errorf("starting serf on %s: %v", key, err)
	}
	n.serf = sf
	n.done.Add(2)
	go n.run()
	go n.joinLoop()
	return n, nil
}

// windowSize is the number of samples in history at one per interval.
func windowSize(history, interval time.Duration) int {
	if interval <= 0 {
		return 1
	}
	return max(1, int(history/interval))
}

// Destruct leaves the cluster gracefully and stops serf: the last config
// using the node has stopped. Leave first: Shutdown alone looks like a
// crash to the other members.
func (n *node) Destruct() error {
	close(n.stop)
	n.done.Wait()
	if err := n.serf.Leave(); err != nil {
		n.logger.Warn("leaving the cluster", zap.Error(err))
	}
	err := n.serf.Shutdown()
	n.logger.Info("left the cluster")
	return err
}

// attach makes s the settings that drive the node (a newer config).
func (n *node) attach(s *settings) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.owners = append(n.owners, s)
	n.window.Resize(windowSize(s.history, s.interval))
}

// detach removes the settings of a config that stopped.
func (n *node) detach(owner *App) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.owners = slices.DeleteFunc(n.owners, func(s *settings) bool { return s.owner == owner })
	if len(n.owners) > 0 {
		s := n.owners[len(n.owners)-1]
		n.window.Resize(windowSize(s.history, s.interval))
	}
}

// driver returns the driving settings, or nil.
func (n *node) driver() *settings {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.owners) == 0 {
		return nil
	}
	return n.owners[len(n.owners)-1]
}

// tagsFor returns the member tags for s with the load tag value load.
func (n *node) tagsFor(s *settings, load string) map[string]string {
	tags := maps.Clone(s.tags)
	if tags == nil {
		tags = make(map[string]string)
	}
	if load != "" {
		tags[LoadTag] = load
	}
	return tags
}

// run is the decision loop: every interval, sample, publish, decide, shed.
func (n *node) run() {
	defer n.done.Done()
	timer := time.NewTimer(0)
	defer timer.Stop()
	// Destruct closes stop before it shuts serf down: a shutdown seen
	// here is serf's own.
	down := n.serf.ShutdownCh()
	for {
		select {
		case <-n.stop:
			return
		case <-down:
			down = nil
			n.lostMember()
			continue
		case <-timer.C:
		}
		s := n.driver()
		if s == nil {
			timer.Reset(time.Second)
			continue
		}
		if down != nil {
			n.safeStep(s)
		}
		timer.Reset(s.interval)
	}
}

// sawConflict records that serf logged another member claiming this
// node's name, at addr: serf starts its vote on the name.
func (n *node) sawConflict(addr string) {
	n.conflictWith.Store(&addr)
	n.resolving.Store(max(monoSince(time.Now()), 1))
}

// conflictOver records that serf's vote on the name ended with this
// member keeping it (or could not run).
func (n *node) conflictOver() { n.resolving.Store(0) }

// maxConflictVote bounds how long the node waits for serf's vote on a
// name (serf's query timeout is a few seconds) before it publishes again,
// should it miss the vote's end.
const maxConflictVote = 30 * time.Second

// resolvingConflict reports whether serf is voting on this node's name
// at now.
func (n *node) resolvingConflict(now time.Time) bool {
	since := n.resolving.Load()
	return since != 0 && monoSince(now)-since < int64(maxConflictVote)
}

// lostMember handles serf shutting this member down on its own, which it
// does when it loses the vote on a name conflict (another member has the
// same node_name). Caddy keeps serving: failing the process would turn a
// naming mistake into an outage, and the vote happens seconds after
// Start, so Start cannot wait for it. But the node no longer gossips,
// sees the cluster or sheds, and says so: an error in the log, the admin
// view's name_conflict and the metric caddy_lbx_rebalance_name_conflict.
func (n *node) lostMember() {
	n.mu.Lock()
	msg := "this node's serf member shut down on its own"
	if with := n.conflictWith.Load(); with != nil {
		msg = fmt.Sprintf("node_name %q is also used by the member at %s, which kept it in serf's name conflict vote; this node's serf member shut down",
			n.name, *with)
	}
	msg += ": the node no longer gossips its load, sees the cluster or sheds (Caddy keeps serving); give every node a unique node_name and restart Caddy"
	n.conflict = msg
	n.last = Decision{Reason: msg}
	n.members = nil
	n.mu.Unlock()
	n.logger.Error("rebalance member stopped: name conflict", zap.String("error", msg))
}

// safeStep runs one step, logging a panic instead of crashing Caddy.
func (n *node) safeStep(s *settings) {
	defer func() {
		if r := recover(); r != nil {
			n.logger.Error("rebalance step panicked", zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
		}
	}()
	n.step(s, time.Now())
}

// step sweeps the connections, samples the load, gossips it, reads the
// others' reports, decides and sheds.
func (n *node) step(s *settings, now time.Time) {
	sw := s.source.Sweep(s.history, s.boundary)
	load, held := s.source.Sample(s.metric)

	n.mu.Lock()
	local := n.window.Add(load)
	n.seq++
	tag := s.metric + " " + strconv.FormatFloat(local, 'g', 6, 64) + " " + strconv.FormatUint(n.seq, 10)
	shedding, lift := n.shedding, n.lift
	n.mu.Unlock()

	if n.resolvingConflict(now) {
		// serf reads this member's node unlocked while it resolves a
		// name conflict, and SetTags writes it: skip this report.
		if c := n.logger.Check(zapcore.DebugLevel, "not publishing load while serf resolves a name conflict"); c != nil {
			c.Write()
		}
	} else if err := n.serf.SetTags(n.tagsFor(s, tag)); err != nil {
		if c := n.logger.Check(zapcore.DebugLevel, "publishing load"); c != nil {
			c.Write(zap.Error(err))
		}
	}

	members := n.serf.Members()
	n.mu.Lock()
	reports := make([]Report, 0, len(members))
	present := make(map[string]bool, len(members))
	for _, m := range members {
		present[m.Name] = true
		r := Report{Name: m.Name, Status: memberStatus(m.Status)}
		raw := m.Tags[LoadTag]
		prev, ok := n.seen[m.Name]
		switch {
		case !ok:
			// First sight: its age is unknown, so it does not count
			// until it changes.
			n.seen[m.Name] = seenReport{raw: raw}
		case raw != prev.raw:
			n.seen[m.Name] = seenReport{raw: raw, at: now}
		}
		r.At = n.seen[m.Name].at
		if m.Name == n.name {
			r.At = now
		}
		// An invalid tag gives load NaN: Decide does not count it.
		r.Metric, r.Load, _ = parseLoadTag(raw)
		reports = append(reports, r)
	}
	for name := range n.seen {
		if !present[name] {
			delete(n.seen, name)
		}
	}
	n.mu.Unlock()

	d := Decide(s.params, Input{
		Self: n.name, Local: local, Current: load, Held: held,
		Members: reports, Shedding: shedding, Lift: lift, Now: now,
	})
	var res ShedResult
	if d.Shed > 0 {
		res = s.source.Shed(d.Shed)
	}

	n.mu.Lock()
	n.shedding, n.lift = d.Shedding, d.Lift
	n.members = reports
	n.last, n.lastAt = d, now
	n.steps.Store(monoSince(now))
	n.local, n.current, n.held = local, load, held
	n.shed.Idle += res.Idle
	n.shed.Active += res.Active
	n.shed.Hijacked += res.Hijacked
	if res.Total() > 0 {
		n.shedDecisions++
	}
	n.forced += uint64(sw.Forced)
	n.lastForced = sw.Forced
	n.mu.Unlock()

	n.logDecision(s, d, shedding || lift.Lifting, local, res, sw)
	if res.Total() > 0 || sw.Forced > 0 {
		s.events.emitShed(n.name, s.metric, local, d, res, sw.Forced)
	}
}

// logDecision writes one line per decision that sheds, changes state or
// forces shed connections closed, and a debug line otherwise.
func (n *node) logDecision(s *settings, d Decision, was bool, local float64, res ShedResult, sw SweepResult) {
	lvl := zapcore.DebugLevel
	msg := "rebalance decision"
	switch {
	case res.Total() > 0:
		lvl, msg = zapcore.InfoLevel, "shedding connections"
	case sw.Forced > 0:
		lvl, msg = zapcore.InfoLevel, "closed shed connections past boundary_timeout"
	case d.Active() && !was:
		lvl, msg = zapcore.InfoLevel, "started shedding"
	case !d.Active() && was:
		lvl, msg = zapcore.InfoLevel, "stopped shedding"
	}
	c := n.logger.Check(lvl, msg)
	if c == nil {
		return
	}
	c.Write(
		zap.String("metric", s.metric),
		zap.String("local", formatLoad(s.metric, local)),
		zap.String("average", formatLoad(s.metric, d.Average)),
		zap.String("balance", fmt.Sprintf("%.2fx", d.Balance)),
		zap.Int("members_counted", d.Counted),
		zap.String("lowest", humanize.FormatFloat("#,###.#", d.Lowest)),
		zap.String("lowest_member", d.LowestName),
		zap.Bool("lifting", d.Lift.Lifting),
		zap.Int("shed", res.Total()),
		zap.Int("shed_idle", res.Idle),
		zap.Int("shed_active", res.Active),
		zap.Int("shed_hijacked", res.Hijacked),
		zap.Int("forced", sw.Forced),
		zap.Int("overdue", sw.Overdue),
		zap.String("reason", d.Reason),
	)
}

// formatLoad writes a load for people in its metric's unit: bytes per
// second in SI units for throughput ("12 MB/s", as network rates are
// quoted), otherwise the number ("1,234" connections, "45.1" percent of a
// core).
func formatLoad(metric string, v float64) string {
	if metric == MetricThroughput {
		if !(v > 0) {
			return "0 B/s"
		}
		// Far beyond any link; keeps the conversion defined.
		return humanize.Bytes(uint64(min(v, 1e18))) + "/s"
	}
	return humanize.FormatFloat("#,###.#", v)
}

// joinLoop joins the configured addresses, and joins again with backoff
// while this node sees no other alive member (a node that starts before
// its peers, or after a partition).
func (n *node) joinLoop() {
	defer n.done.Done()
	backoff := time.Second
	for {
		s := n.driver()
		if s != nil && len(s.join) > 0 && n.aliveOthers() == 0 {
			_, err := n.serf.Join(s.join, true)
			if err != nil {
				// serf returns a multierror spread over lines.
				err = fmt.Errorf("joining %s: %s (a peer with another encrypt_key, or none, cannot be joined either)",
					strings.Join(s.join, ", "), strings.Join(strings.Fields(err.Error()), " "))
			}
			n.mu.Lock()
			n.joined = err == nil
			n.joinErr = ""
			if err != nil {
				n.joinErr = err.Error()
			}
			n.mu.Unlock()
			if err != nil {
				n.logger.Warn("cannot join the cluster", zap.Error(err), zap.Duration("retry_in", backoff))
				backoff = min(2*backoff, 30*time.Second)
			} else {
				n.logger.Info("joined the cluster", zap.Strings("join", s.join), zap.Int("members", n.serf.NumNodes()))
				backoff = time.Second
			}
		}
		select {
		case <-n.stop:
			return
		case <-time.After(backoff):
		}
	}
}

// aliveOthers counts the alive members other than this node.
func (n *node) aliveOthers() int {
	c := 0
	for _, m := range n.serf.Members() {
		if m.Name != n.name && m.Status == serf.StatusAlive {
			c++
		}
	}
	return c
}

// memberStatus converts serf's status.
func memberStatus(s serf.MemberStatus) MemberStatus {
	switch s {
	case serf.StatusAlive:
		return StatusAlive
	case serf.StatusLeaving:
		return StatusLeaving
	case serf.StatusLeft:
		return StatusLeft
	}
	return StatusFailed
}

// parseLoadTag reads "<metric> <load> <seq>". ok is false, and load NaN
// (which Params.standing never counts), when the tag does not hold a
// valid load (validLoad).
func parseLoadTag(raw string) (metric string, load float64, ok bool) {
	f := strings.Fields(raw)
	if len(f) != 3 {
		return "", math.NaN(), false
	}
	v, err := strconv.ParseFloat(f[1], 64)
	if err != nil || !validLoad(v) {
		return "", math.NaN(), false
	}
	return f[0], v, true
}

// splitHostPort parses "host:port" for option opt.
func splitHostPort(addr, opt string) (string, int, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("%s %q: want host:port: %v", opt, addr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("%s %q: invalid port %q", opt, addr, portStr)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	return host, port, nil
}

// zapWriter turns serf's and memberlist's log lines ("[WARN] serf: …")
// into zap entries at the matching level. Warnings and errors go through
// a rate limiter (gossipLogLimit): a peer sending garbage packets makes
// memberlist log one line per packet.
type zapWriter struct {
	logger *zap.Logger
	// conflict is told the address of a member that claims this node's
	// name, when serf logs one; conflictOver, when serf's vote on the
	// name keeps it here or cannot run.
	conflict     func(addr string)
	conflictOver func()

	mu    sync.Mutex
	kinds map[string]*logKind
}

// Rate limit of the gossip library's warnings and errors: per kind of
// message, at most gossipLogBurst lines per gossipLogPeriod; the first
// line after a period that suppressed some says how many.
const (
	gossipLogBurst  = 5
	gossipLogPeriod = 10 * time.Second
	// gossipLogKinds bounds the kinds tracked; further kinds share one.
	gossipLogKinds = 64
)

// gossipLogs counts the gossip library's warning and error lines in the
// process, and those suppressed (metrics).
var gossipLogs struct {
	lines, suppressed atomic.Uint64
}

// logKind is the rate limiter's state for one kind of message.
type logKind struct {
	start      time.Time // of the current period
	n          int       // lines written in it
	suppressed int       // lines dropped since the last one written
}

// serfLevels maps the gossip library's level prefixes to zap's.
var serfLevels = []struct {
	prefix string
	level  zapcore.Level
}{
	{"[DEBUG]", zapcore.DebugLevel}, {"[TRACE]", zapcore.DebugLevel}, {"[INFO]", zapcore.InfoLevel},
	{"[WARN]", zapcore.WarnLevel}, {"[ERR]", zapcore.ErrorLevel}, {"[ERROR]", zapcore.ErrorLevel},
}

// conflictPrefix starts serf's line on a member that claims this node's
// name: "serf: Node name conflicts with another node at 10.0.0.1:7946.
// Names must be unique! …".
const conflictPrefix = "serf: Node name conflicts with another node at "

// serf's lines when its vote on the name keeps it here, or cannot start.
const (
	conflictKept   = "serf: majority in name conflict resolution"
	conflictNoVote = "serf: Failed to start name resolution query"
)

func (w *zapWriter) Write(p []byte) (int, error) {
	line := string(bytes.TrimSpace(p))
	lvl := zapcore.InfoLevel
	for _, l := range serfLevels {
		if rest, ok := strings.CutPrefix(line, l.prefix); ok {
			lvl, line = l.level, strings.TrimSpace(rest)
			break
		}
	}
	if rest, ok := strings.CutPrefix(line, conflictPrefix); ok && w.conflict != nil {
		addr, _, _ := strings.Cut(rest, " ")
		w.conflict(strings.TrimSuffix(addr, "."))
	}
	if w.conflictOver != nil && (strings.HasPrefix(line, conflictKept) || strings.HasPrefix(line, conflictNoVote)) {
		w.conflictOver()
	}
	// Serf logs every member update (every load report of every member,
	// every interval) at INFO: that is debug detail here.
	if lvl == zapcore.InfoLevel && strings.Contains(line, "EventMemberUpdate") {
		lvl = zapcore.DebugLevel
	}
	var suppressed int
	if lvl >= zapcore.WarnLevel {
		gossipLogs.lines.Add(1)
		var ok bool
		if ok, suppressed = w.allow(logKindOf(line), time.Now()); !ok {
			gossipLogs.suppressed.Add(1)
			return len(p), nil
		}
	}
	if c := w.logger.Check(lvl, line); c != nil {
		if suppressed > 0 {
			c.Write(zap.Int("suppressed_similar", suppressed), zap.Duration("rate_limit_period", gossipLogPeriod))
		} else {
			c.Write()
		}
	}
	return len(p), nil
}

// allow reports whether a line of kind may be written at t, and how many
// of that kind were suppressed before it.
func (w *zapWriter) allow(kind string, t time.Time) (ok bool, suppressed int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.kinds == nil {
		w.kinds = make(map[string]*logKind)
	}
	k := w.kinds[kind]
	if k == nil {
		if len(w.kinds) >= gossipLogKinds {
			kind = "other"
			k = w.kinds[kind]
		}
		if k == nil {
			k = &logKind{start: t}
			w.kinds[kind] = k
		}
	}
	if t.Sub(k.start) >= gossipLogPeriod {
		k.start, k.n = t, 0
	}
	if k.n >= gossipLogBurst {
		k.suppressed++
		return false, 0
	}
	k.n++
	suppressed, k.suppressed = k.suppressed, 0
	return true, suppressed
}

// logKindOf returns the kind of a gossip log line: its text up to the
// first colon after the library's name ("memberlist: Failed to decode
// ping: …" is "memberlist: Failed to decode ping"), without the details
// (addresses, errors) that vary from line to line.
func logKindOf(line string) string {
	lib, rest, ok := strings.Cut(line, ": ")
	if !ok {
		lib, rest = "", line
	}
	// Details start at a colon or a quote (memberlist quotes what a
	// packet carried).
	msg := rest
	if i := strings.IndexAny(rest, ":\"'"); i >= 0 {
		msg = rest[:i]
	}
	// Numbers in the message itself vary too.
	msg = strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' {
			return -1
		}
		return r
	}, msg)
	if len(msg) > 80 {
		msg = msg[:80]
	}
	return lib + ": " + msg
}
