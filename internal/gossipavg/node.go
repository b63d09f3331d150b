package gossipavg

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// pair is what a node keeps about one peer: the flow between them and
// the exchange in progress, if any.
type pair struct {
	name string
	// inc is the peer's incarnation; 0 until the node hears from it.
	inc uint64
	// retired is the peer's previous incarnation: late messages from it
	// are ignored.
	retired uint64
	// flow is F_ij, what this node has handed to the peer; stamp its
	// version (see bump).
	flow  [MaxDim]float64
	stamp uint64
	// lastReq is the highest request sequence number applied from the
	// peer (this incarnation): older and duplicate requests are ignored.
	lastReq uint64
	// created is when the pair was made; heard when the peer was last
	// heard from (zero: never).
	created, heard time.Time
	// pending is the sequence number of this node's unanswered request to
	// the peer (0: none), sentAt when it went and tries how many times
	// the request has been sent.
	pending uint64
	sentAt  time.Time
	tries   int
	// backoff: the node gave up waiting for the peer's replies, and
	// leaves the pair alone until then unless it hears from the peer.
	backoff time.Time
}

// lowEntry is another member's lowest-load entry as this node keeps it:
// origin is when the entry was current, by this node's clock.
type lowEntry struct {
	name   string
	load   float64
	seq    uint64
	origin time.Time
	// held is the load of an older entry of the member, lower than this
	// one's, that this one replaced (or that the one it replaced held),
	// and heldUntil when every copy of that older entry will have
	// expired: until then this entry ranks by held (see merge).
	held      float64
	heldUntil time.Time
}

// bucketCount is how many buckets count the exchanges of the last
// Freshness.
const bucketCount = 16

// bucket counts the exchanges completed in one Freshness/bucketCount.
type bucket struct {
	id int64
	n  int
}

// Node is one member's state. Its methods are not safe for concurrent use:
// call them from one goroutine, or under a lock.
type Node struct {
	cfg   Config
	inc   uint64
	input [MaxDim]float64
	// pairs in a slice, not iterated from the map, so that the node is
	// deterministic; index maps a peer's name to its place.
	pairs []*pair
	index map[string]int
	free  []*pair
	// nextExpiry is a time before which no pair expires.
	nextExpiry time.Time
	// seq is the last request sequence number sent; selfSeq the origin
	// sequence of this node's own entry.
	seq, selfSeq uint64
	// low holds other members' entries, at most cfg.Entries, in the
	// order they are kept and sent (keepBefore) as of the last rankAt.
	low []lowEntry
	// members is how many members the last Tick listed, this node
	// included: how far an entry may travel (see currentAge).
	members int
	// start is when the node was made (the origin of the buckets).
	start        time.Time
	lastExchange time.Time
	buckets      [bucketCount]bucket
	// bounded: SetBounds set lo and hi, the range this node's estimate
	// must stay within (see SetBounds).
	bounded bool
	lo, hi  [MaxDim]float64
}

// ErrOutOfBounds is the error Receive wraps when it refuses a message
// whose estimate, or whose effect on this node's estimate, is outside
// the bounds SetBounds set.
var ErrOutOfBounds = errors.New("gossipavg: outside the bounds")

// New returns a node with input zero, after checking cfg. It draws the
// node's incarnation from rng, which must therefore differ from one start
// to the next (seed it from crypto/rand); its origin sequence starts from
// now (in microseconds), so a restarted node's entries are newer than its
// old ones as long as the clock did not go back.
func New(cfg Config, now time.Time, rng *rand.Rand) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	n := &Node{
		cfg:   cfg,
		index: make(map[string]int),
		low:   make([]lowEntry, 0, cfg.Entries+1),
		start: now,
	}
	for n.inc == 0 {
		n.inc = rng.Uint64()
	}
	if us := now.UnixMicro(); us > 0 {
		n.selfSeq = uint64(us)
	}
	return n, nil
}

// SetInput sets this node's input vector: Dim values, each from 0 to
// MaxLoad. The estimate moves by the change at once (the mass changes
// exactly), and the exchanges spread it. The first value is the load of
// this node's lowest-load entry; changing it makes a new entry (a higher
// origin sequence).
func (n *Node) SetInput(v []float64) error {
	if len(v) != n.cfg.Dim {
		return fmt.Errorf("gossipavg: input of %d values, want %d", len(v), n.cfg.Dim)
	}
	for k, x := range v {
		if !validLoad(x) {
			return fmt.Errorf("gossipavg: input value %d is %v, want a number from 0 to %g", k, x, MaxLoad)
		}
	}
	if v[0] != n.input[0] {
		n.selfSeq++
	}
	copy(n.input[:], v)
	return nil
}

// SetBounds sets the range, value by value, that this node's estimate
// must stay within: lo and hi hold Dim values, each lo at most its hi and
// within ±MaxFlow. Nil for both removes the bounds (the default).
//
// A peer's message is refused (Receive returns an error that wraps
// ErrOutOfBounds, and nothing of the message is applied) when it is a
// request whose estimate is outside the bounds, or when applying it would
// leave this node's estimate outside the bounds and farther from them
// than before: an estimate already outside (the bounds moved, or a pair
// expired and took its flow with it) may still come closer. Flow
// updating keeps every honest estimate within the range of the inputs,
// so bounds that contain the inputs refuse only what no honest peer
// sends; a peer that lies about its estimate or flows can then move this
// node's estimate only within the bounds.
func (n *Node) SetBounds(lo, hi []float64) error {
	if lo == nil && hi == nil {
		n.bounded = false
		return nil
	}
	if len(lo) != n.cfg.Dim || len(hi) != n.cfg.Dim {
		return fmt.Errorf("gossipavg: bounds of %d and %d values, want %d", len(lo), len(hi), n.cfg.Dim)
	}
	for k := range n.cfg.Dim {
		if !checkFlow(lo[k]) || !checkFlow(hi[k]) || lo[k] > hi[k] {
			return fmt.Errorf("gossipavg: bounds %v to %v for value %d, want lo ≤ hi within ±%g", lo[k], hi[k], k, MaxFlow)
		}
	}
	copy(n.lo[:], lo)
	copy(n.hi[:], hi)
	n.bounded = true
	return nil
}

// outside returns how far x is outside the bounds of value k; 0 within
// them, or without bounds.
func (n *Node) outside(k int, x float64) float64 {
	if !n.bounded {
		return 0
	}
	return max(n.lo[k]-x, x-n.hi[k], 0)
}

// worse reports whether moving this node's estimate from est to next
// takes some value outside its bounds and farther from them.
func (n *Node) worse(est, next *[MaxDim]float64) bool {
	for k := range n.cfg.Dim {
		if d := n.outside(k, next[k]); d > 0 && d > n.outside(k, est[k]) {
			return true
		}
	}
	return false
}

// Forget drops everything about peer: its pair, and so the flows this
// node exchanged with it (which removes exactly the peer's mass once
// every survivor forgets it), and its lowest-load entry. Call it when
// membership says the peer left or failed. A message from peer that
// arrives later starts a new pair.
func (n *Node) Forget(peer string) {
	if i, ok := n.index[peer]; ok {
		n.remove(n.pairs[i])
	}
	for i := range n.low {
		if n.low[i].name == peer {
			n.low = append(n.low[:i], n.low[i+1:]...)
			break
		}
	}
}

// Tick returns the request this node sends now, if any:
//   - a retry to the peer whose reply is overdue (after RetryTimeout; after
//     MaxRetries retries the node gives up, and leaves that peer alone for
//     Freshness/8 unless it hears from it);
//   - else nothing while a request awaits its reply;
//   - else a refresh of the pair heard from least recently, if that was
//     Freshness/2 ago or more (a live pair must not expire);
//   - else, while the node holds fewer than Peers pairs, an exchange with
//     a member drawn uniformly from peers (the alive members, this node
//     excluded, whose number also tells how far an entry travels, see
//     Lows; drawing an invalid name, or this node's, sends nothing);
//   - else an exchange with the peer heard from least recently.
//
// Call it several times per decision interval.
//
// One request at a time: the responder averages with the estimate the
// request carried, so whatever changes this node's estimate while a
// request is out (another of its requests completing) is not seen by the
// responder, and this node's surplus would be handed out twice, which
// slows convergence. The node still answers requests meanwhile.
func (n *Node) Tick(now time.Time, peers []string, rng *rand.Rand) (Message, bool) {
	n.members = len(peers) + 1
	n.expire(now)
	p, waiting := n.overdue(now)
	switch {
	case p != nil:
		return n.request(now, p)
	case waiting:
		return Message{}, false
	}
	p = n.stalest(now)
	if (p == nil || now.Sub(p.heard) < n.cfg.Freshness/2) && n.active(now) < n.cfg.Peers && len(peers) > 0 {
		name := peers[rng.IntN(len(peers))]
		if name == n.cfg.Name || !validName(name) {
			return Message{}, false
		}
		if p = n.lookup(name); p == nil {
			p = n.add(name, now)
		}
	}
	if p == nil {
		return Message{}, false
	}
	p.tries = 0
	return n.request(now, p)
}

// overdue returns the pair whose request has waited longest past
// RetryTimeout and may be retried, giving up on those retried MaxRetries
// times; nil if none. waiting reports a request still within its
// RetryTimeout.
func (n *Node) overdue(now time.Time) (due *pair, waiting bool) {
	for {
		due, waiting = nil, false
		for _, p := range n.pairs {
			switch {
			case p.pending == 0:
			case now.Sub(p.sentAt) < n.cfg.RetryTimeout:
				waiting = true
			case due == nil || p.sentAt.Before(due.sentAt):
				due = p
			}
		}
		if due == nil || due.tries <= n.cfg.MaxRetries {
			return due, waiting
		}
		due.pending, due.tries = 0, 0
		if due.heard.IsZero() {
			n.remove(due) // never answered: nothing to keep
		} else {
			due.backoff = now.Add(n.cfg.Freshness / 8)
		}
	}
}

// stalest returns the pair heard from least recently, among those
// neither waiting for a reply nor in backoff; nil if none.
func (n *Node) stalest(now time.Time) *pair {
	var s *pair
	for _, p := range n.pairs {
		if p.heard.IsZero() || p.pending != 0 || now.Before(p.backoff) {
			continue
		}
		if s == nil || p.heard.Before(s.heard) {
			s = p
		}
	}
	return s
}

// active counts the pairs not in backoff.
func (n *Node) active(now time.Time) int {
	k := 0
	for _, p := range n.pairs {
		if !now.Before(p.backoff) {
			k++
		}
	}
	return k
}

// request makes a request to p's peer and records it as pending.
func (n *Node) request(now time.Time, p *pair) (Message, bool) {
	m := Message{
		Kind:            Request,
		From:            n.cfg.Name,
		To:              p.name,
		FromIncarnation: n.inc,
		ToIncarnation:   p.inc,
		Seq:             n.seq + 1,
		Version:         p.stamp,
		Dim:             n.cfg.Dim,
		Flow:            p.flow,
		Estimate:        n.estimate(),
	}
	if !n.fill(now, &m) {
		return Message{}, false // flows out of bounds: only a hostile peer gets there
	}
	n.seq++
	p.pending, p.sentAt = n.seq, now
	p.tries++
	return m, true
}

// Receive applies a message from a peer and returns the reply to send
// back, if any (requests only). It returns an error for a malformed
// message, one not addressed to this node or of another dimension, and
// one the bounds refuse (SetBounds; the error wraps ErrOutOfBounds);
// nothing of a refused message is applied. A duplicate, reordered or
// outdated message is ignored without error.
func (n *Node) Receive(now time.Time, m Message) (Message, bool, error) {
	if err := m.check(); err != nil {
		return Message{}, false, err
	}
	switch {
	case m.To != n.cfg.Name:
		return Message{}, false, fmt.Errorf("gossipavg: message to %q received by %q", m.To, n.cfg.Name)
	case m.From == n.cfg.Name:
		return Message{}, false, fmt.Errorf("gossipavg: message from %q to itself", m.From)
	case m.Dim != n.cfg.Dim:
		return Message{}, false, fmt.Errorf("gossipavg: message from %q of dimension %d, want %d", m.From, m.Dim, n.cfg.Dim)
	}
	n.expire(now)
	if m.Kind == Request {
		return n.answer(now, &m)
	}
	return Message{}, false, n.adopt(now, &m)
}

// heardFrom returns the pair with m's sender after checking its
// incarnation (a new one drops the old pair state first), creating it if
// needed; nil for a late message from the sender's previous incarnation.
func (n *Node) heardFrom(now time.Time, m *Message, create bool) *pair {
	p := n.lookup(m.From)
	switch {
	case p == nil && !create:
		return nil
	case p == nil:
		p = n.add(m.From, now)
	case p.inc == m.FromIncarnation, p.inc == 0:
	case m.FromIncarnation == p.retired:
		return nil
	default:
		// A restart: the old incarnation's flows go, and its mass with
		// them. A request of ours in flight stays pending: the new
		// incarnation may answer it.
		p.retired = p.inc
		p.flow, p.stamp, p.lastReq = [MaxDim]float64{}, 0, 0
	}
	p.inc = m.FromIncarnation
	return p
}

// answer handles a request: adopt the requester's flow unless this
// node's version of the pair is newer, move to the average of the two
// estimates, and reply with the new flow.
func (n *Node) answer(now time.Time, m *Message) (Message, bool, error) {
	for k := range n.cfg.Dim {
		if n.outside(k, m.Estimate[k]) > 0 {
			return Message{}, false, fmt.Errorf("%w: request from %q with estimate %v for value %d (bounds %v to %v); refused", ErrOutOfBounds, m.From, m.Estimate[k], k, n.lo[k], n.hi[k])
		}
	}
	undo := n.saveFor(m.From)
	p := n.heardFrom(now, m, true)
	if p == nil || m.Seq <= p.lastReq {
		n.merge(now, m)
		return Message{}, false, nil
	}

	flow, stamp := p.flow, p.stamp
	// The request's flow is about this incarnation of the pair unless it
	// names another incarnation of this node (a restart of ours: the
	// requester drops that flow when it sees ours).
	if (m.ToIncarnation == 0 || m.ToIncarnation == n.inc) && m.Version >= stamp {
		for k := range n.cfg.Dim {
			flow[k] = -m.Flow[k]
		}
		stamp = m.Version
	}
	est := n.estimate()
	mine := est
	for k := range n.cfg.Dim {
		mine[k] += p.flow[k] - flow[k]
		// The requester's estimate once it takes this node's flow (and
		// drops its own): e_i + F_ij + F_ji.
		theirs := m.Estimate[k] + m.Flow[k] + flow[k]
		a := (theirs + mine[k]) / 2
		flow[k] += mine[k] - a
		if !checkFlow(flow[k]) {
			return Message{}, false, fmt.Errorf("gossipavg: exchange with %q would take a flow to %v; refused", m.From, flow[k])
		}
	}
	next := est
	for k := range n.cfg.Dim {
		next[k] += p.flow[k] - flow[k]
	}
	if n.worse(&est, &next) {
		undo()
		return Message{}, false, fmt.Errorf("%w: exchange with %q would take this node's estimate to %v; refused", ErrOutOfBounds, m.From, next[:n.cfg.Dim])
	}
	n.merge(now, m)
	p.lastReq, p.heard, p.backoff = m.Seq, now, time.Time{}
	p.flow, p.stamp = flow, bump(stamp, n.cfg.Name, m.From)
	n.completed(now)

	r := Message{
		Kind:            Reply,
		From:            n.cfg.Name,
		To:              m.From,
		FromIncarnation: n.inc,
		ToIncarnation:   m.FromIncarnation,
		Seq:             m.Seq,
		Version:         p.stamp,
		Dim:             n.cfg.Dim,
		Flow:            p.flow,
	}
	n.fill(now, &r) // a reply's flow was just checked
	return r, true, nil
}

// adopt handles a reply: take the replier's flow when its version is
// newer than this node's, unless that would take this node's estimate
// out of its bounds (an error that wraps ErrOutOfBounds).
func (n *Node) adopt(now time.Time, m *Message) error {
	if m.ToIncarnation != n.inc {
		n.merge(now, m)
		return nil // a reply to this node's previous incarnation
	}
	undo := n.saveFor(m.From)
	p := n.heardFrom(now, m, false)
	if p == nil {
		n.merge(now, m)
		return nil // forgotten, or a previous incarnation's
	}
	if m.Version > p.stamp && n.bounded {
		est := n.estimate()
		next := est
		for k := range n.cfg.Dim {
			next[k] += p.flow[k] + m.Flow[k]
		}
		if n.worse(&est, &next) {
			undo()
			return fmt.Errorf("%w: reply from %q would take this node's estimate to %v; refused", ErrOutOfBounds, m.From, next[:n.cfg.Dim])
		}
	}
	n.merge(now, m)
	if m.Version > p.stamp {
		for k := range n.cfg.Dim {
			p.flow[k] = -m.Flow[k]
		}
		p.stamp = m.Version
	}
	p.heard, p.backoff = now, time.Time{}
	if p.pending != 0 && m.Seq == p.pending {
		p.pending, p.tries = 0, 0
		n.completed(now)
	}
	return nil
}

// saveFor returns a function that puts the pair with peer back as it is
// now (removing it if there is none now): a refused message leaves no
// trace, not even the reset of a new incarnation (heardFrom).
func (n *Node) saveFor(peer string) (undo func()) {
	p := n.lookup(peer)
	if p == nil {
		return func() {
			if q := n.lookup(peer); q != nil {
				n.remove(q)
			}
		}
	}
	saved := *p
	return func() { *p = saved }
}

// bump returns the version after updater changed a pair's flow: the
// counter (all bits but the lowest) plus one, and the lowest bit set when
// the updater's name is the greater of the pair's two. Both ends order
// versions alike, so two updates that cross are settled the same way.
func bump(v uint64, updater, other string) uint64 {
	v = (v>>1 + 1) << 1
	if updater > other {
		v |= 1
	}
	return v
}

// estimate returns e_i = v_i − Σ_j F_ij.
func (n *Node) estimate() [MaxDim]float64 {
	e := n.input
	for _, p := range n.pairs {
		for k := range n.cfg.Dim {
			e[k] -= p.flow[k]
		}
	}
	return e
}

// lookup returns the pair with peer, or nil.
func (n *Node) lookup(peer string) *pair {
	if i, ok := n.index[peer]; ok {
		return n.pairs[i]
	}
	return nil
}

// add makes an empty pair with peer.
func (n *Node) add(peer string, now time.Time) *pair {
	var p *pair
	if k := len(n.free); k > 0 {
		p, n.free = n.free[k-1], n.free[:k-1]
	} else {
		p = new(pair)
	}
	p.name, p.created = peer, now
	n.index[peer] = len(n.pairs)
	n.pairs = append(n.pairs, p)
	if d := now.Add(n.cfg.Freshness); n.nextExpiry.IsZero() || d.Before(n.nextExpiry) {
		n.nextExpiry = d
	}
	return p
}

// remove drops p, and with it its flow.
func (n *Node) remove(p *pair) {
	i, last := n.index[p.name], len(n.pairs)-1
	n.pairs[i] = n.pairs[last]
	n.index[n.pairs[i].name] = i
	n.pairs[last] = nil
	n.pairs = n.pairs[:last]
	delete(n.index, p.name)
	*p = pair{}
	n.free = append(n.free, p)
}

// expire drops the pairs not heard from (or, never heard from, made)
// more than Freshness ago, and the entries older than Freshness.
func (n *Node) expire(now time.Time) {
	n.expireEntries(now)
	if now.Before(n.nextExpiry) {
		return
	}
	n.nextExpiry = time.Time{}
	for i := 0; i < len(n.pairs); {
		p := n.pairs[i]
		last := p.heard
		if last.IsZero() {
			last = p.created
		}
		if now.Sub(last) > n.cfg.Freshness {
			n.remove(p) // moves the last pair to i
			continue
		}
		if d := last.Add(n.cfg.Freshness); n.nextExpiry.IsZero() || d.Before(n.nextExpiry) {
			n.nextExpiry = d
		}
		i++
	}
}

// completed counts an exchange completed at now.
func (n *Node) completed(now time.Time) {
	id := n.bucketID(now)
	b := &n.buckets[id%bucketCount]
	if b.id != id {
		*b = bucket{id: id}
	}
	b.n++
	if now.After(n.lastExchange) {
		n.lastExchange = now
	}
}

// bucketID is the number of the bucket now falls in.
func (n *Node) bucketID(now time.Time) int64 {
	return int64(max(now.Sub(n.start), 0) / (n.cfg.Freshness / bucketCount))
}

// View is what a node knows of the cluster average, and how old and how
// complete that knowledge is.
type View struct {
	// Values is the estimate of the average input; the first Dim values
	// count.
	Values [MaxDim]float64
	// Dim is the input dimension.
	Dim int
	// Peers is the number of peers this node holds pair state with
	// (heard from within Freshness).
	Peers int
	// LastExchange is when this node last completed an exchange, as
	// requester or as responder; zero if never.
	LastExchange time.Time
	// Exchanges is the number of exchanges this node completed in the
	// last Freshness (to within Freshness/16).
	Exchanges int
}

// Estimate returns this node's estimate of the average input at now,
// after dropping the pairs gone silent.
func (n *Node) Estimate(now time.Time) View {
	n.expire(now)
	v := View{Values: n.estimate(), Dim: n.cfg.Dim, LastExchange: n.lastExchange}
	for _, p := range n.pairs {
		if !p.heard.IsZero() {
			v.Peers++
		}
	}
	id := n.bucketID(now)
	for _, b := range n.buckets {
		if b.id <= id && id-b.id < bucketCount {
			v.Exchanges += b.n
		}
	}
	return v
}
