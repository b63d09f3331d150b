// Package gossipavg computes the cluster average of every node's input
// vector by gossip, with O(1) messages per node per round whatever the
// number of nodes, and tells every node which member has the lowest load.
// It is the transport-independent core: a deterministic state machine
// (no goroutines, no network, no clock of its own: every call takes the
// time, and randomness comes from the caller's *rand.Rand), to be driven
// by one goroutine, or under the caller's lock, over point-to-point
// datagrams.
//
// # Algorithm
//
// It is flow updating, after Jesus, Baquero and Almeida, "Fault-tolerant
// aggregation by flow updating" (2009), with pairwise random exchanges.
// Node i has an input v_i (Config.Dim numbers) and, for every peer j it
// has exchanged with, a flow F_ij: what i has handed to j so far. Its
// estimate is
//
//	e_i = v_i − Σ_j F_ij.
//
// As long as F_ij = −F_ji for every pair, Σ e_i = Σ v_i: the estimates
// carry exactly the inputs' mass, so their average is the true average,
// even while inputs change (a change of v_i changes e_i by as much, at
// once, and the exchanges spread it).
//
// An exchange: i sends j a Request with F_ij, e_i and the pair's version.
// j adopts F_ji = −F_ij unless its own version of the pair is newer, sets
// its flow so that its estimate becomes a = (e_i' + e_j)/2, where e_i' is
// what i's estimate will be once i adopts j's flow, bumps the version and
// answers with a Reply carrying F_ji and the version. i adopts F_ij =
// −F_ji when the reply's version is newer than its own. Both then estimate
// a. A version is a counter and which of the two names updated it last,
// so two exchanges that cross (each end answering the other's request)
// end with both ends on the same one. Duplicate and reordered requests
// (each carries a sequence number; a pair keeps the highest applied) and
// stale replies (an older version) are ignored.
//
// # Why flow updating
//
// Push-sum and plain pairwise averaging move mass: a lost message loses
// it for good, and an input that changes after the start is not tracked.
// Flow updating keeps, per pair, only the net flow, idempotently: a lost
// request changes nothing, a lost reply leaves the pair inconsistent (its
// two flows disagree, which is a mass error of that exchange's transfer)
// only until the pair exchanges again, which the requester does first
// (retries, Config.MaxRetries). Inputs may change at any time. And a
// departed node's mass is exactly the flows its survivors hold with it:
// dropping those pairs (Node.Forget when membership says it left, or
// after Config.Freshness of silence) removes it and nothing else, so the
// average becomes the survivors' average. A restarted node has a new
// incarnation (a random number that every message carries); a peer that
// sees it drops the old pair first.
//
// # Peer choice
//
// Node.Tick sends at most one request, and none while one awaits its
// reply (the responder averages with the estimate the request carried;
// a second exchange completing meanwhile would hand the same surplus out
// twice). First a retry to a peer whose reply is overdue; then a refresh
// of the pair heard from least recently once that is Freshness/2 ago,
// so that no live pair expires; then, while the node holds fewer than
// Config.Peers pairs, an exchange with a uniformly random member; else an
// exchange with the peer heard from least recently. So every node keeps
// a few pairs, which random choice makes a random graph, and refreshes
// them in turn: a pair must exchange at least once per Freshness to be
// kept, and dropping a live pair unwinds its flow, a jolt to both ends'
// estimates, so a node keeps no more pairs than it can refresh (with N
// members, a pair between random members would otherwise meet about every
// N/2 rounds). Memory is O(Peers) per node, messages O(1) per tick.
//
// # The lowest member
//
// Every message also carries up to Config.Entries entries (name, load,
// origin sequence, age): the sender's own, then the first others it
// keeps. A receiver merges them by name (a higher origin sequence wins,
// and for the same sequence the younger copy), ages them by its own
// clock, keeps Entries of them and drops those older than Freshness.
// Ages travel, not timestamps, so clock skew does not matter; each hop
// adds RetryTimeout/2 (a bound on one-way delay) so that an entry never
// looks younger than it is, and an entry its origin no longer sends is
// gone everywhere within Freshness.
//
// Which entries a node keeps and sends must stay right while loads
// change, as after a mass join: the joiners start at load 0, and their
// loads rise as they are filled. A member's older entry is then lower
// than its newer one; ranked by load alone, the older copies would keep
// the newer one out of the lowest everywhere, the newer one would be
// forgotten and the older copies taken in again as new, and when they all
// expired, a Freshness later, most nodes would know no low member but
// themselves. Two rules decide which Entries entries a node keeps and
// sends:
//
//   - A newer entry that replaces a lower one keeps the older one's place
//     (ranks by its load) until every copy of the older one has expired,
//     Freshness after the newer one's origin: it goes wherever the older
//     one went and replaces it there, and a node that keeps it refuses
//     the older copies.
//   - Current entries, at most Freshness/2 old plus the hop aging of a
//     trip across the members (log2 of their number hops, see
//     Config.Freshness), come first, lowest first, then the older ones.
//     A member's entry that ranks among the lowest reaches every node
//     within that age while the member still sends it, so an older one
//     has likely been replaced by one that has not come this way; it
//     still counts when a node knows no current entry.
//
// Memory stays O(Entries) per node, and the wire format is unchanged.
// Node.Lows lists the entries a node keeps, current ones first, each
// group by its own load (a held place only decides what is kept and
// sent), with the node's own entry before the first higher one;
// Node.Lowest is the first of them.
package gossipavg
