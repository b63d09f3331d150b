package gossipavg

import (
	"time"
)

// Lowest returns the lowest-load entry this node knows at now, its own
// included (a tie goes to the smaller name), with its age. Entries older
// than Freshness are gone.
func (n *Node) Lowest(now time.Time) Entry {
	n.expireEntries(now)
	own := Entry{Name: n.cfg.Name, Load: n.input[0], Seq: n.selfSeq}
	if len(n.low) == 0 || !lowBefore(n.low[0].load, n.low[0].name, own.Load, own.Name) {
		return own
	}
	l := &n.low[0]
	return Entry{Name: l.name, Load: l.load, Seq: l.seq, AgeMillis: ageMillis(now.Sub(l.origin))}
}

// lowBefore orders entries by load, then name.
func lowBefore(load float64, name string, load2 float64, name2 string) bool {
	return load < load2 || load == load2 && name < name2
}

// ageMillis returns d in milliseconds, rounded up (an age must not look
// younger than it is), within [0, MaxAgeMillis].
func ageMillis(d time.Duration) uint32 {
	if d <= 0 {
		return 0
	}
	ms := (d + time.Millisecond - 1) / time.Millisecond
	return uint32(min(ms, MaxAgeMillis))
}

// merge takes in m's entries: by name, a higher origin sequence wins, and
// for the same sequence the younger copy; each is aged by a hop (see
// Config.RetryTimeout); the Entries lowest are kept.
func (n *Node) merge(now time.Time, m *Message) {
	for i := range m.NumEntries {
		e := &m.Entries[i]
		if e.Name == n.cfg.Name {
			continue
		}
		origin := now.Add(-time.Duration(e.AgeMillis)*time.Millisecond - n.cfg.hopAge())
		if now.Sub(origin) > n.cfg.Freshness {
			continue
		}
		j := n.findEntry(e.Name)
		switch {
		case j < 0:
			n.low = append(n.low, lowEntry{name: e.Name, load: e.Load, seq: e.Seq, origin: origin})
			j = len(n.low) - 1
		case e.Seq > n.low[j].seq || e.Seq == n.low[j].seq && origin.After(n.low[j].origin):
			n.low[j] = lowEntry{name: e.Name, load: e.Load, seq: e.Seq, origin: origin}
		default:
			continue
		}
		// Move entry j to its place (the others are in order), then keep
		// the Entries lowest.
		for ; j > 0 && lowBefore(n.low[j].load, n.low[j].name, n.low[j-1].load, n.low[j-1].name); j-- {
			n.low[j], n.low[j-1] = n.low[j-1], n.low[j]
		}
		for ; j+1 < len(n.low) && lowBefore(n.low[j+1].load, n.low[j+1].name, n.low[j].load, n.low[j].name); j++ {
			n.low[j], n.low[j+1] = n.low[j+1], n.low[j]
		}
		if len(n.low) > n.cfg.Entries {
			n.low = n.low[:n.cfg.Entries]
		}
	}
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
// cause), then adds this node's own entry and the lowest others it knows,
// as many as Entries and MaxMessageSize allow.
func (n *Node) fill(now time.Time, m *Message) bool {
	for k := range m.Dim {
		if !checkFlow(m.Flow[k]) || m.Kind == Request && !checkFlow(m.Estimate[k]) {
			return false
		}
	}
	size := m.headerSize()
	m.Entries[0] = Entry{Name: n.cfg.Name, Load: n.input[0], Seq: n.selfSeq}
	size += entrySize(&m.Entries[0])
	m.NumEntries = 1
	for i := range n.low {
		if m.NumEntries == n.cfg.Entries {
			break
		}
		l := &n.low[i]
		e := Entry{Name: l.name, Load: l.load, Seq: l.seq, AgeMillis: ageMillis(now.Sub(l.origin))}
		if size += entrySize(&e); size > MaxMessageSize {
			break
		}
		m.Entries[m.NumEntries] = e
		m.NumEntries++
	}
	return true
}
