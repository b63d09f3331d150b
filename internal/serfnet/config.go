package serfnet

import (
	"time"

	"github.com/hashicorp/serf/serf"
)

// MaxNodeName is the longest member name, in bytes: serf's own limit when
// it validates names.
const MaxNodeName = 128

// broadcastTimeout bounds how long serf waits for a tag update's (and the
// leave message's) broadcast when no peer acknowledges.
const broadcastTimeout = 2 * time.Second

// Config returns the serf and memberlist settings an lbx member runs
// with, named name and bound to bindHost:bindPort (memberlist's LAN
// defaults, name conflict resolution, and broadcastTimeout), without
// logging, tags, advertise address or keys. The cluster app starts its
// member from it, and the gossip benchmark its members, so that the
// benchmark measures what the app runs.
func Config(name, bindHost string, bindPort int) *serf.Config {
	conf := serf.DefaultConfig()
	conf.Init()
	conf.NodeName = name
	conf.EnableNameConflictResolution = true
	conf.BroadcastTimeout = broadcastTimeout
	conf.MemberlistConfig.BindAddr = bindHost
	conf.MemberlistConfig.BindPort = bindPort
	return conf
}
