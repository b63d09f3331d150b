package gossipavg

import (
	"math/bits"
	"time"
)

// Lowest returns the first entry of Lows, without allocating: the member
// this node takes for the one with the lowest load at now, possibly
// itself, with its entry's age.
func (n *Node) Lowest(now time.Time) Entry {
	r := n.rankAt(now)
	own := n.ownEntry(now)
	best := -1
	for i := range n.low {
		if best < 0 || r.reportBefore(&n.low[i], &n.low[best]) {
			best = i
		}
	}
	if best < 0 || ownBefore(&own, &n.low[best]) {
		return own.entry(now)
	}
	return n.low[best].entry(now)
}

// Lows appends to dst the lowest-load entries this node knows at now,
// its own included, each with its age, and returns the extended slice: a
// caller that leaves a member out (one the lift rule ignores, say) takes
// the next. The current entries come first, then the others, each group
// lowest load first (a tie goes to the smaller name); this node's own
// entry comes before the first one with a higher load. Lowest is the
// first of them.
//
// An entry is current while it is at most Freshness/2 old, plus the hop
// aging of a trip across the members (see the package doc). A member's
// entry that ranks among the lowest reaches every node within that age
// while the member still sends it; an older one has likely been replaced
// by one that has not come this way yet (while loads rise, the older
// entry is the lower, so it spreads and the newer one does not). Older
// entries still count, after the current ones: a node that knows no
// current entry still names the lowest member it knows.
func (n *Node) Lows(now time.Time, dst []Entry) []Entry {
	r := n.rankAt(now)
	own := n.ownEntry(now)
	// The indices of n.low in report order; n.low holds at most Entries.
	var order [MaxEntries]int
	k := 0
	for i := range n.low {
		j := k
		for ; j > 0 && r.reportBefore(&n.low[i], &n.low[order[j-1]]); j-- {
			order[j] = order[j-1]
		}
		order[j] = i
		k++
	}
	ownDone := false
	for _, i := range order[:k] {
		if !ownDone && ownBefore(&own, &n.low[i]) {
			dst = append(dst, own.entry(now))
			ownDone = true
		}
		dst = append(dst, n.low[i].entry(now))
	}
	if !ownDone {
		dst = append(dst, own.entry(now))
	}
	return dst
}

// ownEntry returns this node's own entry, of age 0.
func (n *Node) ownEntry(now time.Time) lowEntry {
	return lowEntry{name: n.cfg.Name, load: n.input[0], seq: n.selfSeq, origin: now}
}

// entry returns l as a message carries it at now.
func (l *lowEntry) entry(now time.Time) Entry {
	return Entry{Name: l.name, Load: l.load, Seq: l.seq, AgeMillis: ageMillis(now.Sub(l.origin))}
}

// lowBefore orders entries by load, then name.
func lowBefore(load float64, name string, load2 float64, name2 string) bool {
	return load < load2 || load == load2 && name < name2
}

// ownBefore reports whether this node's own entry comes before l in Lows:
// when its load is lower.
func ownBefore(own, l *lowEntry) bool { return lowBefore(own.load, own.name, l.load, l.name) }

// ageMillis returns d in milliseconds, rounded up (an age must not look
// younger than it is), within [0, MaxAgeMillis].
func ageMillis(d time.Duration) uint32 {
	if d <= 0 {
		return 0
	}
	ms := (d + time.Millisecond - 1) / time.Millisecond
	return uint32(min(ms, MaxAgeMillis))
}

// currentAge is how old a current entry may be (see Lows): Freshness/2,
// plus the hop aging of a trip across the members (log2 of their number
// hops of RetryTimeout/2), at most Freshness. Freshness must exceed the
// time an entry takes to spread by a good margin (Config.Freshness), and
// half of it leaves one; the hop aging is added because with a long
// RetryTimeout it alone can take a far node's copies past Freshness/2.
func (n *Node) currentAge() time.Duration {
	hops := time.Duration(bits.Len(uint(max(n.members, 1) - 1)))
	return min(n.cfg.Freshness/2+hops*n.cfg.hopAge(), n.cfg.Freshness)
}

// ranking orders entries at one instant.
type ranking struct {
	now        time.Time
	currentAge time.Duration // Node.currentAge
}

// rankAt drops the entries older than Freshness, puts the others in the
// order they are kept and sent at now, and returns that ranking.
func (n *Node) rankAt(now time.Time) ranking {
	n.expireEntries(now)
	r := ranking{now: now, currentAge: n.currentAge()}
	r.sort(n.low)
	return r
}

// current reports whether l is current (see Lows).
func (r *ranking) current(l *lowEntry) bool { return r.now.Sub(l.origin) <= r.currentAge }

// rankLoad is the load l ranks by among the entries a node keeps and
// sends: its own, or the lower one of the older entry it replaced while
// copies of that one may still be about (see merge).
func (r *ranking) rankLoad(l *lowEntry) float64 {
	if r.now.Before(l.heldUntil) {
		return l.held
	}
	return l.load
}

// keepBefore orders the entries a node keeps and sends: the current ones
// first, each group by rank load, then name.
func (r *ranking) keepBefore(a, b *lowEntry) bool {
	if ca, cb := r.current(a), r.current(b); ca != cb {
		return ca
	}
	return lowBefore(r.rankLoad(a), a.name, r.rankLoad(b), b.name)
}

// reportBefore orders the entries Lows returns: the current ones first,
// each group by load, then name.
func (r *ranking) reportBefore(a, b *lowEntry) bool {
	if ca, cb := r.current(a), r.current(b); ca != cb {
		return ca
	}
	return lowBefore(a.load, a.name, b.load, b.name)
}

// sort puts low (at most Entries + 1 entries, nearly in order) in
// keepBefore order.
func (r *ranking) sort(low []lowEntry) {
	for i := 1; i < len(low); i++ {
		for j := i; j > 0 && r.keepBefore(&low[j], &low[j-1]); j-- {
			low[j], low[j-1] = low[j-1], low[j]
		}
	}
}

// merge takes in m's entries: by name, a higher origin sequence wins, and
// for the same sequence the younger copy; each is aged by a hop (see
// Config.RetryTimeout); the Entries first in keepBefore order are kept.
// A newer entry that replaces a lower one holds its place (see the
// package doc) until Freshness after the newer one's origin: the older
// copies all left the member before it, so they have expired by then.
func (n *Node) merge(now time.Time, m *Message) {
	r := n.rankAt(now)
	for i := range m.NumEntries {
		e := &m.Entries[i]
		if e.Name == n.cfg.Name {
			continue
		}
		origin := now.Add(-time.Duration(e.AgeMillis)*time.Millisecond - n.cfg.hopAge())
		if now.Sub(origin) > n.cfg.Freshness {
			continue
		}
		next := lowEntry{name: e.Name, load: e.Load, seq: e.Seq, origin: origin}
		j := n.findEntry(e.Name)
		switch {
		case j < 0:
			n.low = append(n.low, next)
		case e.Seq > n.low[j].seq:
			n.low[j] = r.replace(&n.low[j], next, n.cfg.Freshness)
		case e.Seq == n.low[j].seq && origin.After(n.low[j].origin):
			n.low[j].origin = origin
		default:
			continue
		}
		r.sort(n.low)
		if len(n.low) > n.cfg.Entries {
			clear(n.low[n.cfg.Entries:])
			n.low = n.low[:n.cfg.Entries]
		}
	}
}

// replace returns next, a newer entry of l's member, holding l's place
// when l ranks by a lower load (see merge).
func (r *ranking) replace(l *lowEntry, next lowEntry, freshness time.Duration) lowEntry {
	place, until := l.load, next.origin.Add(freshness)
	if r.now.Before(l.heldUntil) {
		place, until = l.held, l.heldUntil
	}
	if place < next.load {
		next.held, next.heldUntil = place, until
	}
	return next
}

// findEntry returns the index of name's entry in n.low, or -1.
func (n *Node) findEntry(name string) int {
	for i := range n.low {
		if n.low[i].name == name {
			return i
		}
	}
	return -1
}

// expireEntries drops the entries older than Freshness.
func (n *Node) expireEntries(now time.Time) {
	k := 0
	for _, l := range n.low {
		if now.Sub(l.origin) <= n.cfg.Freshness {
			n.low[k] = l
			k++
		}
	}
	clear(n.low[k:])
	n.low = n.low[:k]
}

// fill completes an outgoing message: it checks the flow and estimate
// values (false when one is out of bounds, which only a hostile peer can
// cause), then adds this node's own entry and the first others it keeps,
// as many as Entries and MaxMessageSize allow.
func (n *Node) fill(now time.Time, m *Message) bool {
	for k := range m.Dim {
		if !checkFlow(m.Flow[k]) || m.Kind == Request && !checkFlow(m.Estimate[k]) {
			return false
		}
	}
	n.rankAt(now)
	size := m.headerSize()
	m.Entries[0] = Entry{Name: n.cfg.Name, Load: n.input[0], Seq: n.selfSeq}
	size += entrySize(&m.Entries[0])
	m.NumEntries = 1
	for i := range n.low {
		if m.NumEntries == n.cfg.Entries {
			break
		}
		e := n.low[i].entry(now)
		if size += entrySize(&e); size > MaxMessageSize {
			break
		}
		m.Entries[m.NumEntries] = e
		m.NumEntries++
	}
	return true
}
