// Package rebalance joins the Caddy nodes of a fleet into a serf cluster,
// gossips each node's load, and sheds a node's excess long-lived
// connections when it holds far more than the cluster average, so that
// clients reconnect through the outer load balancer and spread over the
// fleet (Piko's rebalancing, with hysteresis and without ghost nodes).
//
// The pieces, from the inside out:
//   - Decide (decide.go): the pure shedding decision, and Window, the
//     smoother;
//   - the connection tracker (conns.go): connections of every Caddy HTTP
//     server by state, graceful shedding (idle first, active ones at a
//     response boundary, hijacked streams last), and the per-interval
//     sweep (shed streams that never end count again, or are closed at
//     boundary_timeout);
//   - the rebalance_close handler (handler.go), and the WebSocket frame
//     follower that closes a shed WebSocket with a close frame
//     (wsclose.go);
//   - the listener wrapper `caddy.listeners.rebalance` (listener.go):
//     counts the bytes of every connection it accepts, for the
//     throughput metric; it goes before `tls` in listener_wrappers;
//   - the node (node.go): the serf member, shared across config reloads
//     in a caddy.UsagePool keyed by bind address, and the decision loop;
//   - the Caddy app `rebalance` (app.go) and its Caddyfile global option
//     (caddyfile.go);
//   - the admin endpoint GET /rebalance/cluster (admin.go);
//   - discovery and balancing from the cluster: the dynamic upstream
//     source `serf` (upstreams.go) and the selection policy
//     `cluster_load`, two random choices by gossiped load (policy.go).
package rebalance
