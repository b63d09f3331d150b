// Package shed is the rebalance app's shedding decision, free of Caddy,
// serf and clocks: given a node's own load, the members' load reports and
// the previous decision's state, Decide says how many connections to shed
// now. It also holds what the decision is made of and what the app and
// the fleet simulation (integration/fleetsim) must compute alike: the
// smoothing window (Window), the load tag's format and publication rule
// (loadtag.go), and the rule by which a gossip average may stand in for
// the members' tags (average.go).
//
// Everything here is pure: all state is passed in and returned, so the
// app's node loop and the simulation run the same decision.
package shed
