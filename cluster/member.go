package cluster

import (
	"errors"
	"fmt"
	"log"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/serfnet"
)

// members holds the serf members of this process, keyed by bind address:
// a config reload starts the new config (which finds the member here)
// before stopping the old one, so the member survives without leaving,
// rejoining or binding its port twice. Its Destruct leaves the cluster.
var members = caddy.NewUsagePool()

// settings are what one config asks of the member. The member runs with
// the settings of the most recently started config that still runs.
type settings struct {
	owner     *App
	tags      map[string]string
	join      []string
	logger    *zap.Logger
	name      string   // node name: fixed for the member's life
	keys      [][]byte // configured gossip keys, primary first; nil: none
	advertise string
	// change is what this config's key list changed in the keyring when
	// it started, until committed or undone (detach); prevConfigured, the
	// key list it replaced. Under the member's mu.
	change         *keyChange
	prevConfigured [][]byte
}

// member is this process's serf member.
type member struct {
	key    string
	name   string
	serf   *serf.Serf
	direct *serfnet.Transport // serf's transport, and the direct messages
	logger *zap.Logger
	// addr is the gossip address memberlist advertises, read once when
	// serf starts: memberlist's LocalNode returns its own node struct,
	// which every SetTags rewrites (UpdateNode) without a lock a reader
	// could take.
	addr string
	// keyring is memberlist's, which serf's key queries (the admin API)
	// and a reload's key list change; nil when the member started without
	// a key: memberlist cannot turn encryption on later.
	keyring *memberlist.Keyring

	mu sync.Mutex
	// configured is the key list of the last config that changed it (or
	// started the member): a reload changes the keyring only when its
	// list differs from this one, so that an unrelated reload does not
	// undo keys installed through the admin API.
	configured [][]byte
	owners     []*settings       // oldest first; the last one drives
	published  map[string]string // tags other modules publish (Publish)
	joined     bool
	joinErr    string
	// conflict is set once serf shut this member down because another
	// member claims its name (see lost).
	conflict string

	// conflictWith is the address of a member that claims this node's
	// name, as serf last logged it, and resolving when serf started its
	// vote on the name (nanoseconds on the monotonic clock; 0: no vote
	// running). Not under mu: serf logs while it holds its own locks.
	conflictWith atomic.Pointer[string]
	resolving    atomic.Int64

	// lease orders the admin API's key operations cluster-wide
	// (keylock.go); events waits for eventLoop, which ends when serf
	// shuts down.
	lease  keyLease
	events sync.WaitGroup
	// decrypt counts the gossip this member could not decrypt, by remote
	// address (decrypt.go).
	decrypt decryptFailures
	// refused is what the selectors over this member refused lately
	// (the admin view's refused).
	refused refusals

	pubMu sync.Mutex    // serializes setTags
	kick  chan struct{} // wakes publishLoop; capacity 1
	stop  chan struct{}
	done  sync.WaitGroup
}

// newMember creates the serf member for s and starts its loops. It binds
// the gossip port.
func newMember(key string, s *settings, bindHost string, bindPort int) (*member, error) {
	m := &member{
		key:        key,
		name:       s.name,
		logger:     s.logger.With(zap.String("node", s.name)),
		owners:     []*settings{s},
		configured: s.keys,
		published:  make(map[string]string),
		kick:       make(chan struct{}, 1),
		stop:       make(chan struct{}),
	}
	conf := serfnet.Config(m.name, bindHost, bindPort)
	conf.Tags = m.tagsFor(s)
	// serf delivers the key lease queries (and member events) here;
	// eventLoop drains it until serf shuts down.
	events := make(chan serf.Event, keyEventBuffer)
	conf.EventCh = events
	stdlog := log.New(&serfLog{logger: m.logger.Named("serf"), conflict: m.sawConflict, conflictOver: m.conflictOver, decryptFailed: m.decryptFailed}, "", 0)
	conf.LogOutput = nil
	conf.Logger = stdlog
	ml := conf.MemberlistConfig
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
	if len(s.keys) > 0 {
		kr, err := memberlist.NewKeyring(s.keys[1:], s.keys[0])
		if err != nil {
			return nil, fmt.Errorf("encrypt_key: %v", err)
		}
		ml.Keyring = kr
		m.keyring = kr
	}
	// The member's own transport, which carries direct messages besides
	// serf's gossip (internal/serfnet).
	dt, err := serfnet.Listen(conf, m.logger)
	if err != nil {
		return nil, fmt.Errorf("starting serf on %s: %v", key, err)
	}
	sf, err := serf.Create(conf)
	if err != nil {
		// Shut down by memberlist only once it runs.
		_ = dt.Shutdown()
		return nil, fmt.Errorf("starting serf on %s: %v", key, err)
	}
	m.serf = sf
	m.direct = dt
	// No SetTags runs yet (publishLoop starts below), so the node struct
	// is read before anything writes it.
	if a := sf.Memberlist().LocalNode(); a != nil {
		m.addr = net.JoinHostPort(a.Addr.String(), fmt.Sprint(a.Port))
	}
	go dt.Deliver(sf) // ends when serf shuts the transport down
	m.events.Add(1)
	go m.eventLoop(events, sf.ShutdownCh())
	m.done.Add(3)
	go m.watchShutdown()
	go m.joinLoop()
	go m.publishLoop()
	return m, nil
}

// Destruct leaves the cluster gracefully and stops serf: the last config
// using the member has stopped. Leave first: Shutdown alone looks like a
// crash to the other members.
func (m *member) Destruct() error {
	close(m.stop)
	m.done.Wait()
	if err := m.serf.Leave(); err != nil {
		m.logger.Warn("leaving the cluster", zap.Error(err))
	}
	err := m.serf.Shutdown()
	m.events.Wait()
	m.logger.Info("left the cluster")
	return err
}

// attach makes s the settings that drive the member (a newer config).
// The name and advertise address are the member's for its life, and so
// is whether gossip is encrypted; the keys change when s configures
// another list than the last config that changed them: attach stages the
// change (stageKeys), which detach commits when the previous config stops
// or undoes when s's config stops first (a failed reload).
func (m *member) attach(s *settings) {
	m.mu.Lock()
	if old := m.owners[len(m.owners)-1]; old.name != s.name || old.advertise != s.advertise {
		s.logger.Warn("node_name and advertise cannot change while the cluster member runs; they keep their previous values until Caddy restarts",
			zap.String("node_name", old.name))
		s.name, s.advertise = old.name, old.advertise
	}
	var change *keyChange
	switch {
	case (m.keyring != nil) != (len(s.keys) > 0):
		state := "in clear text"
		if m.keyring != nil {
			state = "encrypted, with the keys it has"
		}
		s.logger.Warn("encrypt_key cannot turn gossip encryption on or off while the cluster member runs (memberlist has a keyring only when the member starts with a key); gossip stays "+state+" until Caddy restarts",
			zap.String("node_name", m.name))
	case !sameKeys(m.configured, s.keys):
		c := stageKeys(m.keyring, m.configured, s.keys)
		change = &c
		s.change, s.prevConfigured = change, m.configured
		m.configured = s.keys
	}
	m.owners = append(m.owners, s)
	m.mu.Unlock()
	if change != nil {
		change.log(s.logger.With(zap.String("node", m.name)), "gossip keyring changed by the config's key list (on this node only)")
	}
	m.wake()
}

// detach removes the settings of a config that stopped. When they were
// the driving ones and an older config still runs, the newest config
// failed to start and Caddy went back to the older one, which it never
// stopped: detach undoes the primary the failed config set (if it still
// is the primary) and removes no key, since other members may use any
// key this node has by now. When the stopped config is an older one and
// the driving config is left alone, the reload succeeded: the keys its
// list dropped are removed.
func (m *member) detach(owner *App) {
	m.mu.Lock()
	var gone *settings
	if i := slices.IndexFunc(m.owners, func(s *settings) bool { return s.owner == owner }); i >= 0 {
		gone = m.owners[i]
	}
	driving := gone != nil && m.owners[len(m.owners)-1] == gone
	m.owners = slices.DeleteFunc(m.owners, func(s *settings) bool { return s.owner == owner })
	var logger *zap.Logger
	var undone string
	var undoErr error
	var committed *keyChange
	switch {
	case driving && len(m.owners) > 0 && gone.change != nil:
		// A failed reload.
		logger = m.owners[len(m.owners)-1].logger
		undone, undoErr = gone.change.undo(m.keyring)
		m.configured = gone.prevConfigured
		gone.change = nil
	case !driving && len(m.owners) == 1 && m.owners[0].change != nil && len(m.owners[0].change.remove) > 0:
		// A reload that succeeded: its previous config stopped.
		d := m.owners[0]
		logger = d.logger
		d.change.commit(m.keyring)
		c := *d.change
		committed = &c
	}
	m.mu.Unlock()
	switch {
	case committed != nil:
		committed.log(logger.With(zap.String("node", m.name)), "gossip keys the config's list dropped removed, the previous config having stopped (on this node only)")
	case undoErr != nil:
		logger.Error("a failed reload's gossip keys", zap.String("node", m.name), zap.Error(undoErr))
	case logger != nil:
		logger.Info("the newer config failed to start: its primary gossip key change is undone, and every key stays (other members may use any of them)",
			zap.String("node", m.name), zap.String("primary_restored", undone), zap.Strings("keys", keyFingerprints(m.keyring)))
	}
	m.wake()
}

// keyFingerprints lists the fingerprints of kr's keys, primary first.
func keyFingerprints(kr *memberlist.Keyring) []string {
	var out []string
	for _, k := range kr.GetKeys() {
		out = append(out, keyID(k))
	}
	return out
}

// driver returns the driving settings, or nil.
func (m *member) driver() *settings {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.owners) == 0 {
		return nil
	}
	return m.owners[len(m.owners)-1]
}

// tagsFor returns the member tags for s with the published ones; m.mu is
// held or m is not shared yet.
func (m *member) tagsFor(s *settings) map[string]string {
	tags := maps.Clone(s.tags)
	if tags == nil {
		tags = make(map[string]string, len(m.published))
	}
	maps.Copy(tags, m.published)
	return tags
}

// wake makes publishLoop publish the current tags.
func (m *member) wake() {
	select {
	case m.kick <- struct{}{}:
	default: // already due
	}
}

// publishLoop publishes the tags when a config is attached or detached
// (its configured tags change) or a module publishes a tag.
func (m *member) publishLoop() {
	defer m.done.Done()
	retry := time.NewTimer(time.Hour)
	defer retry.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-m.kick:
		case <-retry.C:
		}
		if err := m.setTags(); errors.Is(err, errResolving) {
			retry.Reset(time.Second)
		}
	}
}

// errResolving is setTags's answer while serf votes on the node's name.
var errResolving = errors.New("not publishing while serf resolves a name conflict")

// setTags sets the member's tags to the driving config's and the
// published ones, and waits for serf's broadcast of them (up to
// broadcastTimeout); publishLoop calls it, so that no module waits on the
// gossip.
func (m *member) setTags() error {
	m.pubMu.Lock()
	defer m.pubMu.Unlock()
	if m.resolvingConflict(time.Now()) {
		// serf reads this member's node unlocked while it resolves a
		// name conflict, and SetTags writes it: publish after.
		return errResolving
	}
	m.mu.Lock()
	var tags map[string]string
	if len(m.owners) > 0 {
		tags = m.tagsFor(m.owners[len(m.owners)-1])
	}
	conflict := m.conflict
	m.mu.Unlock()
	if tags == nil || conflict != "" || m.serf.State() != serf.SerfAlive {
		return nil
	}
	err := m.serf.SetTags(tags)
	if err != nil {
		if c := m.logger.Check(zap.DebugLevel, "publishing tags"); c != nil {
			c.Write(zap.Error(err))
		}
	}
	return err
}

// publish sets (or, with value "", removes) a tag other modules publish,
// and has publishLoop publish the tags.
func (m *member) publish(key, value string) {
	m.mu.Lock()
	if value == "" {
		delete(m.published, key)
	} else {
		m.published[key] = value
	}
	m.mu.Unlock()
	m.wake()
}

// watchShutdown notices serf shutting the member down on its own.
func (m *member) watchShutdown() {
	defer m.done.Done()
	select {
	case <-m.stop:
	case <-m.serf.ShutdownCh():
		select {
		case <-m.stop: // Destruct's own shutdown cannot come first: stop closes before
		default:
			m.lost()
		}
	}
}

// sawConflict records that serf logged another member claiming this
// node's name, at addr: serf starts its vote on the name.
func (m *member) sawConflict(addr string) {
	m.conflictWith.Store(&addr)
	m.resolving.Store(max(monoclock.Now(), 1))
}

// conflictOver records that serf's vote on the name ended with this
// member keeping it (or could not run).
func (m *member) conflictOver() { m.resolving.Store(0) }

// maxConflictVote bounds how long the member waits for serf's vote on a
// name (serf's query timeout is a few seconds) before it publishes again,
// should it miss the vote's end.
const maxConflictVote = 30 * time.Second

// resolvingConflict reports whether serf is voting on this node's name
// at now.
func (m *member) resolvingConflict(now time.Time) bool {
	since := m.resolving.Load()
	return since != 0 && monoclock.At(now)-since < int64(maxConflictVote)
}

// lost handles serf shutting this member down on its own, which it does
// when it loses the vote on a name conflict (another member has the same
// node_name). Caddy keeps serving: failing the process would turn a
// naming mistake into an outage, and the vote happens seconds after
// Start, so Start cannot wait for it. But the node no longer gossips or
// sees the cluster, and says so: an error in the log, the admin view's
// name_conflict and the metric caddy_lbx_cluster_name_conflict.
func (m *member) lost() {
	msg := "this node's serf member shut down on its own"
	if with := m.conflictWith.Load(); with != nil {
		msg = fmt.Sprintf("node_name %q is also used by the member at %s, which kept it in serf's name conflict vote; this node's serf member shut down",
			m.name, *with)
	}
	msg += ": the node no longer gossips or sees the cluster (Caddy keeps serving); give every node a unique node_name and restart Caddy"
	m.mu.Lock()
	m.conflict = msg
	m.mu.Unlock()
	m.logger.Error("cluster member stopped: name conflict", zap.String("error", msg))
}

// joinLoop joins the configured addresses, and joins again with backoff
// while this node sees no other alive member (a node that starts before
// its peers, or after a partition).
func (m *member) joinLoop() {
	defer m.done.Done()
	backoff := time.Second
	for {
		s := m.driver()
		if s != nil && len(s.join) > 0 && m.aliveOthers() == 0 && m.serf.State() == serf.SerfAlive {
			_, err := m.serf.Join(s.join, true)
			if err != nil {
				// serf returns a multierror spread over lines.
				err = fmt.Errorf("joining %s: %s (a peer with another encrypt_key, or none, cannot be joined either; %s)",
					strings.Join(s.join, ", "), strings.Join(strings.Fields(err.Error()), " "), describeKeys(m.keyring))
			}
			m.mu.Lock()
			m.joined = err == nil
			m.joinErr = ""
			if err != nil {
				m.joinErr = err.Error()
			}
			m.mu.Unlock()
			if err != nil {
				m.logger.Warn("cannot join the cluster", zap.Error(err), zap.Stringer("retry_in", backoff))
				backoff = min(2*backoff, 30*time.Second)
			} else {
				m.logger.Info("joined the cluster", zap.Strings("join", s.join), zap.Int("members", m.serf.NumNodes()))
				backoff = time.Second
			}
		}
		select {
		case <-m.stop:
			return
		case <-time.After(backoff):
		}
	}
}

// aliveOthers counts the alive members other than this node.
func (m *member) aliveOthers() int {
	c := 0
	for _, sm := range m.serf.Members() {
		if sm.Name != m.name && sm.Status == serf.StatusAlive {
			c++
		}
	}
	return c
}

// running reports whether serf still runs the member.
func (m *member) running() bool {
	return m != nil && m.serf != nil && m.serf.State() != serf.SerfShutdown
}

// list returns the members serf knows, sorted by name.
func (m *member) list() []Member {
	ms := m.serf.Members()
	out := make([]Member, 0, len(ms))
	for _, sm := range ms {
		out = append(out, Member{
			Name:   sm.Name,
			Addr:   sm.Addr,
			Port:   sm.Port,
			Status: statusOf(sm.Status),
			Tags:   sm.Tags,
			Self:   sm.Name == m.name,
		})
	}
	slices.SortFunc(out, func(x, y Member) int { return strings.Compare(x.Name, y.Name) })
	return out
}

// status returns the member's join and conflict state. A node that
// another member joined is in the cluster although its own last join
// failed (it started before its peers): it reads as joined, and that
// join's error, stale now, is not shown.
func (m *member) status() Status {
	joinedBy := m.running() && m.aliveOthers() > 0
	m.mu.Lock()
	defer m.mu.Unlock()
	st := Status{Name: m.name, Addr: m.addr, Joined: m.joined || joinedBy, JoinError: m.joinErr, Conflict: m.conflict, Encrypted: m.keyring != nil}
	if joinedBy {
		st.JoinError = ""
	}
	return st
}
