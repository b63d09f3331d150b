// Package drain holds the operator's drains and reweights of upstream
// addresses: a process-wide store that outlives config reloads, merged
// between cluster members by version, and the signed wire form its
// entries travel in. It knows nothing of Caddy or serf; the selection
// policies read it, the admin routes write it, the cluster app carries it.
package drain

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Bounds of the store and of what it accepts.
const (
	// MaxEntries is the most addresses the store holds, undrained ones
	// included.
	MaxEntries = 4096
	// MaxAddr is the longest upstream address, in bytes.
	MaxAddr = 256
	// MaxOrigin is the longest origin (a cluster node name), in bytes.
	MaxOrigin = 128
	// MaxAhead is how far a peer's version may be ahead of this node's
	// clock: versions follow the wall clock in milliseconds, so one far
	// beyond it is forged or from a badly wrong clock, and taking it would
	// pin the address to that entry for good.
	MaxAhead = 24 * time.Hour
)

// now is the package's clock.
var now = time.Now

// Entry is the operator's word on one upstream address: drained or not,
// and the percent of its configured weight it keeps. An undrain is an
// entry too (Drained false, WeightPercent 100), kept so that an older
// drain arriving late cannot bring the drain back.
type Entry struct {
	Addr          string
	Drained       bool
	WeightPercent uint8 // 1 to 100; 100 leaves the weight as configured
	// Version orders the changes of an address across the fleet: a
	// Lamport counter, ties broken by Origin. A local change takes the
	// larger of the highest version seen plus one and the wall clock in
	// milliseconds, so that a node restarted with an empty store still
	// outranks the changes it made before.
	Version uint64
	// Origin is the node whose admin endpoint made the change ("" for a
	// node outside a cluster).
	Origin string
	// At is when this node took the entry (its own clock); Remote says it
	// came from another member. Neither travels.
	At     time.Time
	Remote bool
}

// Active reports whether the entry changes selection: a drain or a lowered
// weight.
func (e Entry) Active() bool { return e.Drained || e.WeightPercent < 100 }

// newer reports whether e supersedes x.
func (e Entry) newer(x Entry) bool {
	if e.Version != x.Version {
		return e.Version > x.Version
	}
	return e.Origin > x.Origin
}

// State is what selection needs of an active entry.
type State struct {
	Drained       bool
	WeightPercent uint8
}

// CheckAddr checks an upstream address: host:port, at most MaxAddr bytes,
// a host, and a port from 1 to 65535.
func CheckAddr(addr string) error {
	if len(addr) > MaxAddr {
		return fmt.Errorf("upstream %.32q… is %d bytes; at most %d", addr, len(addr), MaxAddr)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("upstream %q: want a dial address host:port, e.g. 10.0.0.1:8080: %v", addr, err)
	}
	if host == "" {
		return fmt.Errorf("upstream %q: no host", addr)
	}
	if strings.ContainsAny(host, " \t\r\n/") {
		return fmt.Errorf("upstream %q: host %q is not a host name or IP", addr, host)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 || strconv.Itoa(p) != port {
		return fmt.Errorf("upstream %q: port %q: want 1 to 65535", addr, port)
	}
	return nil
}

// CheckPercent checks a weight percent.
func CheckPercent(p int) error {
	if p < 1 || p > 100 {
		return fmt.Errorf("percent %d: want 1 to 100 (a reweight only lowers the configured weight)", p)
	}
	return nil
}

// check checks every field of e.
func (e Entry) check() error {
	if err := CheckAddr(e.Addr); err != nil {
		return err
	}
	if err := CheckPercent(int(e.WeightPercent)); err != nil {
		return err
	}
	if e.Drained && e.WeightPercent != 100 {
		return fmt.Errorf("upstream %q: a drained entry keeps weight 100, not %d", e.Addr, e.WeightPercent)
	}
	if len(e.Origin) > MaxOrigin {
		return fmt.Errorf("origin is %d bytes; at most %d", len(e.Origin), MaxOrigin)
	}
	if e.Version == 0 {
		return errors.New("version 0")
	}
	return nil
}

// ErrFull is returned when the store holds MaxEntries addresses, none of
// them an undrain that could make room.
var ErrFull = fmt.Errorf("the drain store holds %d addresses, all drained or reweighted; undrain some first", MaxEntries)

// Store is the drains and reweights this process knows, by address. It
// is safe for concurrent use; Lookup, for selection, takes no lock and
// does not allocate.
type Store struct {
	mu      sync.Mutex
	entries map[string]Entry
	clock   uint64 // the highest version seen
	hooks   map[int]func(Change)
	nextID  int

	// active is the entries that change selection, rebuilt on each change:
	// readers load it without a lock.
	active atomic.Pointer[map[string]State]
	epoch  atomic.Uint64 // counts changes of active

	propagators atomic.Int32  // attached carriers (see Attach)
	dropped     atomic.Uint64 // entries from peers refused (see CountDropped)
	node        atomic.Pointer[string]
}

// New returns an empty store.
func New() *Store {
	s := &Store{entries: make(map[string]Entry), hooks: make(map[int]func(Change))}
	empty := map[string]State{}
	s.active.Store(&empty)
	return s
}

// shared is the process's store: drains outlive every config, until the
// operator undoes them, so no config owns it.
var shared = New()

// Shared returns the process's store.
func Shared() *Store { return shared }

// Lookup returns the active state of addr, if it is drained or
// reweighted.
func (s *Store) Lookup(addr string) (State, bool) {
	m := *s.active.Load()
	if len(m) == 0 {
		return State{}, false
	}
	st, ok := m[addr]
	return st, ok
}

// Epoch counts the changes of what Lookup answers; 0 until the first. A
// reader may cache per address what it derived while the epoch holds.
func (s *Store) Epoch() uint64 { return s.epoch.Load() }

// Any reports whether some address is drained or reweighted.
func (s *Store) Any() bool { return len(*s.active.Load()) > 0 }

// Set records the local operator's change of addr: drained, or not with
// the weight percent; its origin is this node (see Origin). The entry's
// version is above every version this store has seen, so it wins
// everywhere that has seen no more.
func (s *Store) Set(addr string, drained bool, percent int) (Entry, error) {
	if err := CheckAddr(addr); err != nil {
		return Entry{}, err
	}
	if err := CheckPercent(percent); err != nil {
		return Entry{}, err
	}
	if drained {
		percent = 100
	}
	s.mu.Lock()
	at := now()
	version := max(s.clock+1, uint64(max(at.UnixMilli(), 0)))
	e := Entry{Addr: addr, Drained: drained, WeightPercent: uint8(percent), Version: version, Origin: s.Origin(), At: at}
	was := s.entries[addr]
	if err := s.putLocked(e); err != nil {
		s.mu.Unlock()
		return Entry{}, err
	}
	hooks := s.hooksLocked()
	s.mu.Unlock()
	for _, h := range hooks {
		h(Change{Entry: e, Was: was, Local: true})
	}
	return e, nil
}

// Merge takes an entry from another member: it replaces what the store
// holds for the address only when newer. It reports whether it did, and
// an error for an entry out of bounds.
func (s *Store) Merge(e Entry) (bool, error) {
	if err := e.check(); err != nil {
		return false, err
	}
	e.At, e.Remote = now(), true
	if limit := uint64(max(e.At.Add(MaxAhead).UnixMilli(), 0)); e.Version > limit {
		return false, fmt.Errorf("upstream %q: version %d is more than %v ahead of this node's clock", e.Addr, e.Version, MaxAhead)
	}
	s.mu.Lock()
	was, ok := s.entries[e.Addr]
	if ok && !e.newer(was) {
		s.clock = max(s.clock, e.Version)
		s.mu.Unlock()
		return false, nil
	}
	if err := s.putLocked(e); err != nil {
		s.mu.Unlock()
		return false, err
	}
	hooks := s.hooksLocked()
	s.mu.Unlock()
	for _, h := range hooks {
		h(Change{Entry: e, Was: was})
	}
	return true, nil
}

// putLocked stores e, making room by forgetting the oldest undrain when
// the store is full, and publishes the active set.
func (s *Store) putLocked(e Entry) error {
	if _, ok := s.entries[e.Addr]; !ok && len(s.entries) >= MaxEntries {
		oldest := ""
		var at time.Time
		for a, x := range s.entries {
			if !x.Active() && (oldest == "" || x.At.Before(at)) {
				oldest, at = a, x.At
			}
		}
		if oldest == "" {
			return ErrFull
		}
		delete(s.entries, oldest)
	}
	s.entries[e.Addr] = e
	s.clock = max(s.clock, e.Version)
	active := make(map[string]State)
	for a, x := range s.entries {
		if x.Active() {
			active[a] = State{Drained: x.Drained, WeightPercent: x.WeightPercent}
		}
	}
	s.active.Store(&active)
	s.epoch.Add(1)
	return nil
}

func (s *Store) hooksLocked() []func(Change) {
	hooks := make([]func(Change), 0, len(s.hooks))
	for _, h := range s.hooks {
		hooks = append(hooks, h)
	}
	return hooks
}

// Get returns the entry of addr.
func (s *Store) Get(addr string) (Entry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[addr]
	return e, ok
}

// Entries returns every entry, undrains included, sorted by address.
func (s *Store) Entries() []Entry {
	s.mu.Lock()
	all := make([]Entry, 0, len(s.entries))
	for _, e := range s.entries {
		all = append(all, e)
	}
	s.mu.Unlock()
	slices.SortFunc(all, func(a, b Entry) int { return strings.Compare(a.Addr, b.Addr) })
	return all
}

// Change is a change the store took, for its subscribers.
type Change struct {
	Entry
	// Was is what the store held for the address before; the zero Entry
	// when nothing.
	Was Entry
	// Local is true for the operator's change on this node (Set), false
	// for a peer's (Merge).
	Local bool
}

// Subscribe calls fn after each change the store takes. fn runs on the
// changing goroutine, after the store's lock is released, and must not
// block. cancel removes it and may be called more than once.
func (s *Store) Subscribe(fn func(Change)) (cancel func()) {
	s.mu.Lock()
	id := s.nextID
	s.nextID++
	s.hooks[id] = fn
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		delete(s.hooks, id)
		s.mu.Unlock()
	}
}

// Attach records that a carrier (the cluster app with an ops key) sends
// this store's changes to the other members, from the node named node;
// detach undoes it. Several may be attached across a reload.
func (s *Store) Attach(node string) (detach func()) {
	s.node.Store(&node)
	s.propagators.Add(1)
	var once sync.Once
	return func() { once.Do(func() { s.propagators.Add(-1) }) }
}

// Propagated reports whether a carrier is attached.
func (s *Store) Propagated() bool { return s.propagators.Load() > 0 }

// Origin is the node name a local change carries: the last attached
// carrier's, "" before any.
func (s *Store) Origin() string {
	if n := s.node.Load(); n != nil {
		return *n
	}
	return ""
}

// CountDropped counts n entries from peers that were refused: a bad
// signature, out of bounds, or no room.
func (s *Store) CountDropped(n int) { s.dropped.Add(uint64(n)) }

// Dropped returns how many entries from peers were refused.
func (s *Store) Dropped() uint64 { return s.dropped.Load() }
