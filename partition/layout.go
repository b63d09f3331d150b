package partition

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// replica is one upstream address. It is shared by every partition the
// address serves (brpc's examples give one server several tags) and
// carried over from one layout to the next, so its health survives a
// naming file reload.
type replica struct {
	dial     string // as configured
	hostport string // as reverse_proxy reports it ({http.reverse_proxy.upstream.hostport})

	// last is the most recent Upstream value reverse_proxy used for this
	// address, published after its sub-request finished. Its Host is
	// Caddy's shared state for the address (requests in flight, passive
	// health failures) and its health check policy is the handler's, so
	// last.Available() is what Caddy itself would decide now.
	last atomic.Pointer[reverseproxy.Upstream]

	// stats is lbx's state of the address (outlier ejection), shared with
	// every handler and selection policy that uses it; nil in layouts
	// built without a table (tests).
	stats *hoststate.Stats
}

// usable reports whether the replica may take a request at now (a
// monoclock reading): Caddy would send it one (a replica not tried
// yet counts as available), and lbx's outlier detection has not ejected
// it.
func (r *replica) usable(now int64) bool {
	if r.stats != nil && r.stats.Ejected(now) {
		return false
	}
	u := r.last.Load()
	return u == nil || u.Available()
}

// ejected reports whether lbx's outlier detection has ejected the replica
// at now.
func (r *replica) ejected(now int64) bool {
	return r.stats != nil && r.stats.Ejected(now)
}

// scheme is one way of partitioning the data: Count partitions, each
// served by some replicas.
type scheme struct {
	count int
	parts [][]*replica // parts[i]: the replicas of partition i
	idx   int          // its place in its layout's schemes
	l     *layout      // the layout it belongs to, for its audit
}

// capacity is the least number of usable replicas over the scheme's
// partitions (brpc: a PartitionChannel's capacity is the minimum of its
// sub-channels'); 0 when any partition has none.
func (s *scheme) capacity(now int64) int {
	c := -1
	for _, reps := range s.parts {
		n := 0
		for _, r := range reps {
			if r.usable(now) {
				n++
				if c >= 0 && n >= c {
					break // this partition cannot lower the minimum
				}
			}
		}
		if c < 0 || n < c {
			c = n
		}
		if c == 0 {
			return 0
		}
	}
	return max(c, 0)
}

// describe explains a scheme's capacity for error messages, e.g.
// "3 partitions: capacity 0 (p2 has no usable replica)".
func (s *scheme) describe(now int64, a *audit) string {
	var empty []string
	omitted := 0
	for i, reps := range s.parts {
		n, ejected := 0, 0
		if a != nil {
			pa := a.schemes[s.idx].parts[i]
			n, ejected = pa.usable, pa.ejected
		} else {
			for _, r := range reps {
				if r.usable(now) {
					n++
				} else if r.ejected(now) {
					ejected++
				}
			}
		}
		if n == 0 && len(empty) == maxDescribed {
			omitted++
			continue
		}
		if n == 0 {
			p := "p" + strconv.Itoa(i)
			if ejected > 0 {
				p += " (" + strconv.Itoa(ejected) + " ejected)"
			}
			empty = append(empty, p)
		}
	}
	if len(empty) == 0 {
		c := 0
		if a != nil {
			c = a.schemes[s.idx].capacity
		} else {
			c = s.capacity(now)
		}
		return fmt.Sprintf("%d partitions: capacity %d", s.count, c)
	}
	if omitted > 0 {
		empty = append(empty, "and "+strconv.Itoa(omitted)+" more")
	}
	return fmt.Sprintf("%d partitions: capacity 0 (no usable replica for %s)", s.count, strings.Join(empty, ", "))
}

// layout is one immutable version of the upstream list, grouped into
// schemes. Requests load the current layout once and use it throughout;
// a new version is swapped in atomically.
type layout struct {
	entries []Entry
	schemes []*scheme // by ascending partition count
	byAddr  map[string]*replica

	// slots counts the replicas of every partition (a replica serving
	// two partitions counts twice). Above exactSlots, requests read the
	// schemes' capacities from audited instead of counting them.
	slots    int
	audited  atomic.Pointer[audit]
	auditing atomic.Bool // a background audit is running
}

// buildLayout groups entries (already free of duplicates) into schemes,
// in time linear in their number. Replica state is taken over from prev,
// when given, for addresses it already had; a new replica takes a
// reference on its address's shared state in hosts, when given (released
// by dropGone once a later layout no longer has the address).
func buildLayout(entries []Entry, prev *layout, hosts *hoststate.Table) (*layout, error) {
	l := &layout{entries: entries, byAddr: make(map[string]*replica, len(entries))}
	byCount := make(map[int]*scheme)
	// Two spellings of one address (entries differ by Dial) share a
	// replica: it is listed once per partition.
	type placed struct {
		r   *replica
		tag Tag
	}
	seen := make(map[placed]bool, len(entries))
	for _, e := range entries {
		hp, err := checkDial(e.Dial)
		if err != nil {
			return nil, err
		}
		r := l.byAddr[hp]
		if r == nil {
			if prev != nil {
				r = prev.byAddr[hp]
			}
			if r == nil {
				r = &replica{dial: e.Dial, hostport: hp}
				if hosts != nil {
					// Keyed by the dial address reverse_proxy is given,
					// as the selection policies' tables are.
					r.stats = hosts.Stats(e.Dial)
				}
			}
			l.byAddr[hp] = r
		}
		s := byCount[e.Tag.Count]
		if s == nil {
			s = &scheme{count: e.Tag.Count, parts: make([][]*replica, e.Tag.Count)}
			byCount[e.Tag.Count] = s
			l.schemes = append(l.schemes, s)
		}
		if p := (placed{r, e.Tag}); !seen[p] {
			seen[p] = true
			s.parts[e.Tag.Index] = append(s.parts[e.Tag.Index], r)
		}
	}
	slices.SortFunc(l.schemes, func(a, b *scheme) int { return a.count - b.count })
	if len(l.schemes) > MaxSchemes {
		counts := make([]string, len(l.schemes))
		for i, s := range l.schemes {
			counts[i] = strconv.Itoa(s.count)
		}
		return nil, fmt.Errorf("%d partition schemes (partition counts %s); at most %d may coexist",
			len(l.schemes), strings.Join(counts, ", "), MaxSchemes)
	}
	for i, s := range l.schemes {
		s.idx, s.l = i, l
		for _, reps := range s.parts {
			l.slots += len(reps)
		}
	}
	if l.slots > exactSlots {
		l.audited.Store(l.takeAudit(monoclock.Now()))
	}
	return l, nil
}

// dropGone releases, in hosts, the addresses of prev's replicas that next
// no longer has, so that a churning list does not hold every address it
// ever had. Replicas next took over from prev keep their state.
// size is the capacity the scheme would have with every replica usable:
// the least number of replicas over its partitions.
func (s *scheme) size() int {
	c := -1
	for _, reps := range s.parts {
		if c < 0 || len(reps) < c {
			c = len(reps)
		}
	}
	return max(c, 0)
}

// capacity returns the sum of the schemes' capacities at now (brpc: a
// DynamicPartitionChannel's capacity is the sum of its schemes'), and of
// their sizes.
func (l *layout) capacity(now int64) (usable, total int) {
	a := l.current(now)
	for _, s := range l.schemes {
		if a != nil {
			usable += a.schemes[s.idx].capacity
		} else {
			usable += s.capacity(now)
		}
		total += s.size()
	}
	return usable, total
}

func dropGone(prev, next *layout, hosts *hoststate.Table) {
	if prev == nil || hosts == nil {
		return
	}
	for hp, r := range prev.byAddr {
		if next.byAddr[hp] != r {
			hosts.Drop(r.dial)
		}
	}
}

// choose picks a scheme with probability proportional to its capacity at
// now, using intn (a uniform draw in [0, n)). It returns nil when every
// scheme has capacity 0.
func (l *layout) choose(intn func(int) int, now int64) *scheme {
	var caps [MaxSchemes]int
	total := 0
	a := l.current(now)
	for i, s := range l.schemes {
		if a != nil {
			caps[i] = a.schemes[i].capacity
		} else {
			caps[i] = s.capacity(now)
		}
		total += caps[i]
	}
	if total == 0 {
		return nil
	}
	x := intn(total)
	for i, s := range l.schemes {
		if x < caps[i] {
			return s
		}
		x -= caps[i]
	}
	return nil // unreachable
}

// describe explains every scheme's capacity at now, for the 503 answer.
func (l *layout) describe(now int64) string {
	if len(l.schemes) == 0 {
		return "no upstreams"
	}
	a := l.current(now)
	parts := make([]string, len(l.schemes))
	for i, s := range l.schemes {
		parts[i] = s.describe(now, a)
	}
	return strings.Join(parts, "; ")
}

// mergeEntries returns a followed by the entries of b not in a.
func mergeEntries(a, b []Entry) []Entry {
	out := slices.Clip(a)
	if len(b) == 0 {
		return out
	}
	seen := make(map[Entry]bool, len(a)+len(b))
	for _, e := range a {
		seen[e] = true
	}
	for _, e := range b {
		if !seen[e] {
			seen[e] = true
			out = append(out, e)
		}
	}
	return out
}
