package cluster

// SendDirect sends payload to the alive member named to as one direct
// message of kind: a single UDP datagram on the gossip port, encrypted
// with the gossip key when the cluster has an encrypt_key. Delivery is
// best effort, as for any datagram: there is no acknowledgement or retry.
// The receiver drops a message whose kind it has no handler for (see
// HandleDirect), whose sender it does not know as alive, or that did not
// come from that member's gossip address (see serfnet.Transport).
//
// It returns an error when to is this node or no alive member of that
// name, when the message would exceed serfnet.MaxPacket, or when the write
// fails; it never waits on the network beyond that one write. It returns
// ErrNotRunning, or the name conflict, when the member does not run.
func (a *App) SendDirect(to string, kind byte, payload []byte) error {
	m := a.runningMember()
	if m == nil {
		return a.notRunning()
	}
	return m.direct.Send(m.serf, to, kind, payload)
}

// HandleDirect registers fn to handle the direct messages of kind that
// reach this node, with the sender's node name and the payload, which fn
// may keep. The handlers of a member are called one at a time, from one
// goroutine, so a slow handler delays the others; messages that arrive
// while 1024 are waiting are dropped (and counted). A panic in fn is
// recovered and logged.
//
// Handlers belong to the serf member, which outlives config reloads: the
// module that registers one must call cancel when its config stops.
// Registering a kind again supersedes the earlier handler until cancel
// removes the newer one (as a reload does, registering before the old
// config cancels); cancel removes exactly its own registration and may be
// called more than once.
//
// It returns ErrNotRunning, or the name conflict, when the member does not
// run: before the first config with the app starts (Caddy starts apps in
// no particular order, so register at first use, not in Start), and after
// it stopped. During a reload the new config's app already finds the
// running member.
func (a *App) HandleDirect(kind byte, fn func(from string, payload []byte)) (cancel func(), err error) {
	m := a.runningMember()
	if m == nil {
		return nil, a.notRunning()
	}
	return m.direct.Handle(kind, fn), nil
}
