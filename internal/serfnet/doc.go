// Package serfnet is how an lbx cluster member runs serf: its settings
// (Config), and the transport under memberlist that carries direct
// messages between members on the gossip socket besides serf's own
// packets (Transport). It knows nothing of Caddy; the cluster app owns
// the member, and the gossip benchmark builds its members from the same
// pieces.
package serfnet
