package shed

import (
	"math"
	"strconv"
	"strings"
	"time"
)

// The metrics a node may balance on, as its load tag names them.
const (
	// MetricConnections is the connections a node holds.
	MetricConnections = "connections"
	// MetricThroughput is the bytes per second through a node's tracked
	// connections.
	MetricThroughput = "throughput"
	// MetricCPU is the CPU percent of one core this Caddy process uses.
	MetricCPU = "cpu"
	// MetricNodeCPU is the metric of `metric cpu` with `cpu node`: the
	// node's CPU, in percent of all its CPUs. Its own name keeps it apart
	// from the process's CPU wherever metrics are told apart (the load
	// tags, the gossip average's message kinds, the policy's loads): the
	// two are never averaged together. It is not an option's value.
	MetricNodeCPU = "node_cpu"
)

// LoadTag is the serf member tag in which a node gossips its load, as
// FormatLoadReport writes it. The sequence grows with every report, so a
// receiver sees a live node's tag change every interval and judges
// freshness with its own clock (clock skew between nodes does not
// matter).
const LoadTag = "lbx_load"

// FormatLoadReport returns a load report as LoadTag carries it:
// "<metric> <smoothed load> <sequence>".
func FormatLoadReport(metric string, load float64, seq uint64) string {
	return metric + " " + strconv.FormatFloat(load, 'g', 6, 64) + " " + strconv.FormatUint(seq, 10)
}

// WithShedInFlight returns load, in metric's unit (connections, bytes per
// second or CPU percent), with inFlight, the connections this node shed
// and whose clients have likely not reconnected yet, counted as if still
// held. Without them the cluster average would be short of the clients in
// flight, and every node shedding toward it would shed too many. The
// caller fades each shed out over `history` (Window.Fading): a client
// reconnects at its next request, some time within that window, and a
// shed connection still open `history` later counts again anyway
// (conntrack's overdue). held is the connections the node holds; other
// metrics than connections are scaled as if the load were spread evenly
// over them (as the shed is sized).
func WithShedInFlight(metric string, load float64, held int, inFlight float64) float64 {
	switch {
	case inFlight <= 0:
		return load
	case metric == MetricConnections:
		return load + inFlight
	case held > 0:
		return load * (float64(held) + inFlight) / float64(held)
	}
	return load
}

// tagChange is the relative change of the smoothed load that publishes
// the load tag before its keep-alive is due.
const tagChange = 0.05

// LoadTagDue reports whether a node publishes its load tag at this step:
// since is the number of steps since its last tag, this one included
// (1: the previous step published; 0: it has published none), published
// the load that tag carried and local its smoothed load now. A tag is due
// the first time, when the load moved by more than 5% since the last
// tag, and at least every freshness/2 (every interval when freshness is
// under two intervals), so that a live member's tag keeps changing within
// freshness wherever gossip takes under freshness/2 to arrive. The tags
// carry each member's load (lb_policy cluster_load, the admin view, and
// the decision when the gossip average is not usable); the decision's
// average travels by gossip averaging, so the tags need not follow every
// step. It is exported for the gossip benchmark.
func LoadTagDue(since int, published, local float64, interval, freshness time.Duration) bool {
	keepAlive := max(1, int(freshness/2/interval))
	return since == 0 || since >= keepAlive || math.Abs(local-published) > tagChange*max(local, published)
}

// ParseLoadTag reads "<metric> <load> <seq>". ok is false, and load NaN
// (which Params.Standing never counts), when the tag does not hold a
// valid load (ValidLoad).
func ParseLoadTag(raw string) (metric string, load float64, ok bool) {
	f := strings.Fields(raw)
	if len(f) != 3 {
		return "", math.NaN(), false
	}
	v, err := strconv.ParseFloat(f[1], 64)
	if err != nil || !ValidLoad(v) {
		return "", math.NaN(), false
	}
	return f[0], v, true
}
