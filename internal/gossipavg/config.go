package gossipavg

import (
	"fmt"
	"time"

	"github.com/caddy-lbx/lbx/internal/bounds"
)

// Limits of the configuration and of the wire format.
const (
	// MaxDim is the largest input dimension.
	MaxDim = 8
	// MaxEntries is the most lowest-load entries one message carries.
	MaxEntries = 8
	// MaxNameLen is the longest member name, in bytes.
	MaxNameLen = 128
	// MaxLoad is the largest input value and entry load (the same bound
	// as the rebalance app's load reports): far above any real load, and
	// small enough that sums over any cluster stay finite.
	MaxLoad = 1e15
	// MaxFlow bounds the magnitude of the flows and estimates a message
	// may carry: MaxLoad times a thousand members.
	MaxFlow = 1e18
	// MaxAgeMillis is the largest entry age a message may carry (24 h).
	MaxAgeMillis = 24 * 60 * 60 * 1000
	// MaxMessageSize is the largest encoded message, in bytes; it fits one
	// datagram with room for the transport's own framing.
	MaxMessageSize = 1200
	// MaxFreshness is the longest Config.Freshness (and RetryTimeout).
	MaxFreshness = time.Hour
)

// Bounds of the durations and retries in Config.
const (
	minFreshness    = 10 * time.Millisecond
	minRetryTimeout = time.Millisecond
	maxRetries      = 10
	maxPeers        = 64
)

// Config is what a Node is made of. Every field must be set; Validate
// says which one is wrong.
type Config struct {
	// Name is this member's name (its serf node name): 1 to MaxNameLen
	// bytes, unique in the cluster.
	Name string
	// Dim is the number of values in an input vector, 1 to MaxDim. The
	// first value is the load (the lowest-load entries carry it).
	Dim int
	// Entries is how many lowest-load entries a message carries at most,
	// this node's own included, 1 to MaxEntries; it is also how many other
	// members' entries a node keeps. 4 is plenty to know the lowest.
	Entries int
	// Peers is how many pairs a node opens by itself with random members,
	// 1 to 64; from then on it exchanges with the peers it has, in turn
	// (others may open more pairs with it: a node holds about 2 × Peers).
	// Every pair must exchange at least once per Freshness/2, or it is
	// refreshed first, and after Freshness it expires and its flow is
	// unwound (a jolt to both ends' estimates). A node takes part in
	// about two exchanges per tick (its own and one it answers), so keep
	// Peers at most half the ticks in Freshness/2: with a tick every
	// 250ms and Freshness 5s, up to 5. 4 mixes well.
	Peers int
	// Freshness is how long a peer may stay silent before its pair state
	// is dropped (and with it its share of the mass), and how old a
	// lowest-load entry may be, from 10ms to 1h. A pair that has not
	// exchanged for Freshness/2 is refreshed. It must exceed the time an
	// entry takes to spread (about log2(N) hops of RetryTimeout/2 each, see
	// RetryTimeout) by a good margin.
	Freshness time.Duration
	// RetryTimeout is how long a request waits for its reply before the
	// node retries it; it should exceed the round trip, and half of it is
	// taken as the longest a message takes one way (every hop ages a
	// lowest-load entry by that much). At least 1ms, and
	// RetryTimeout × (MaxRetries + 1) must be below Freshness/2, so that a
	// refresh can be retried before the pair expires.
	RetryTimeout time.Duration
	// MaxRetries is how many times an unanswered request is sent again
	// (each a new request with the current state) before the node gives
	// up and leaves that peer alone for Freshness/8 unless it hears from
	// it, 0 to 10.
	MaxRetries int
}

// Validate checks every field against its bounds.
func (c Config) Validate() error {
	if c.Name == "" || len(c.Name) > MaxNameLen {
		return fmt.Errorf("gossipavg: Name %q is %d bytes, want 1 to %d", c.Name, len(c.Name), MaxNameLen)
	}
	for _, err := range []error{
		bounds.Int("Dim", c.Dim, 1, MaxDim),
		bounds.Int("Entries", c.Entries, 1, MaxEntries),
		bounds.Int("Peers", c.Peers, 1, maxPeers),
		bounds.Duration("Freshness", c.Freshness, minFreshness, MaxFreshness),
		bounds.Duration("RetryTimeout", c.RetryTimeout, minRetryTimeout, MaxFreshness),
		bounds.Int("MaxRetries", c.MaxRetries, 0, maxRetries),
	} {
		if err != nil {
			return fmt.Errorf("gossipavg: %w", err)
		}
	}
	if c.RetryTimeout*time.Duration(c.MaxRetries+1) >= c.Freshness/2 {
		return fmt.Errorf("gossipavg: RetryTimeout %v × (MaxRetries %d + 1) must be below Freshness/2 (%v)",
			c.RetryTimeout, c.MaxRetries, c.Freshness/2)
	}
	return nil
}

// hopAge is how much every hop ages a lowest-load entry: a bound on the
// one-way delay, which ages that travel cannot see.
func (c Config) hopAge() time.Duration { return c.RetryTimeout / 2 }
