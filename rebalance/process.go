package rebalance

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-lbx/lbx/internal/conntrack"
)

// processConns are this process's connections, as one cluster node: the
// tracker of every HTTP server's connections the rebalance app is
// registered with, the byte counters of every rebalance listener wrapper,
// and the servers those wrappers count. One value serves every config
// that uses it (the app, the listener wrappers), so a connection of an
// old config still counts as this node's until it closes.
type processConns struct {
	tracker  *conntrack.Tracker
	counters *conntrack.ByteCounters
	servers  serverRegistry
}

// newProcessConns returns connections and counters from zero.
func newProcessConns() *processConns {
	return &processConns{
		tracker:  conntrack.NewTracker(),
		counters: new(conntrack.ByteCounters),
		servers:  serverRegistry{m: make(map[*caddyhttp.Server]*ListenerWrapper)},
	}
}

// Destruct lets the connections go once no config uses them: there is
// nothing to release, the servers close their own connections.
func (*processConns) Destruct() error { return nil }

// processPool holds the one processConns of the process, under
// processKey: a config reload provisions the new config (which finds it
// here) before it cleans up the old one, so the tracker, the byte totals
// and the registry of counted servers survive reloads.
var processPool = caddy.NewUsagePool()

// processKey is the processConns' key in processPool.
const processKey = "connections"

// acquireConns returns the process's connections for a config module
// that uses them (in Provision); the module releases them with
// releaseConns in Cleanup.
func acquireConns() *processConns {
	v, _, _ := processPool.LoadOrNew(processKey, func() (caddy.Destructor, error) {
		return newProcessConns(), nil
	})
	return v.(*processConns)
}

// releaseConns lets go of what acquireConns returned.
func releaseConns() {
	_, _ = processPool.Delete(processKey)
}

// loadedConns returns the process's connections while a config uses them,
// or nil: for the admin endpoint, which no config provisions.
func loadedConns() *processConns {
	var found *processConns
	processPool.Range(func(_, v any) bool {
		found, _ = v.(*processConns)
		return false
	})
	return found
}

// connStats are the process's connection figures, read together for a
// metrics scrape or the admin view.
type connStats struct {
	conns   conntrack.Counts
	bytes   conntrack.ByteTotals
	ws      conntrack.WebSocketCloses
	goAways uint64
	// idleCloses counts shed connections closed after idle_close_after.
	idleCloses uint64
	// counting says whether a server of a loaded config has the rebalance
	// listener wrapper (without one, bytes stay 0).
	counting bool
}

// stats reads p's figures. A nil p (no config uses the connections) reads
// zeros.
func (p *processConns) stats() connStats {
	if p == nil {
		return connStats{}
	}
	return connStats{
		conns:      p.tracker.Counts(),
		bytes:      p.counters.Totals(),
		ws:         p.tracker.WebSocketCloses(),
		goAways:    p.tracker.GoAwayTotal(),
		idleCloses: p.tracker.IdleCloseTotal(),
		counting:   p.servers.any(),
	}
}

// Interface guards
var _ caddy.Destructor = (*processConns)(nil)
