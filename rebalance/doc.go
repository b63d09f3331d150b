// Package rebalance gossips each Caddy node's load through the cluster
// app's serf member, and sheds a node's excess long-lived connections
// when it holds far more than the cluster average, so that clients
// reconnect through the outer load balancer and spread over the fleet
// (Piko's rebalancing, with hysteresis and without ghost nodes).
//
// The pieces, from the inside out:
//   - the decision (internal/shed): when and how much to shed, the
//     smoothing window, the load tag's format and the rule of the gossip
//     average, all pure;
//   - the process's connections (process.go): one value, shared across
//     config reloads in a caddy.UsagePool, holding the connection tracker
//     and the byte counters of internal/conntrack, which do the tracking,
//     the graceful shedding and the byte counting;
//   - the rebalance_close handler (handler.go) and the listener wrapper
//     `caddy.listeners.rebalance` (listener.go): thin Caddy surfaces over
//     conntrack's response writer and counting listener; the wrapper goes
//     before `tls` in listener_wrappers;
//   - the node (node.go): the shedding state, shared across config
//     reloads in a caddy.UsagePool keyed by the cluster member, and the
//     decision loop;
//   - the Caddy app `rebalance` (app.go) and its Caddyfile global option
//     (caddyfile.go);
//   - the admin endpoint GET /lbx/rebalance (admin.go), the metrics
//     (metrics.go) and the rebalance_shed event (events.go);
//   - balancing by the gossiped loads: the selection policy
//     `cluster_load`, two random choices by load (policy.go, members.go).
package rebalance
