package lbxtest

import (
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/serf/serf"
)

// SerfMember starts a plain serf member on 127.0.0.1 (a port chosen by the
// kernel) with tags, joined to join when given. It leaves and shuts down at
// the end of the test unless the test did.
func SerfMember(t testing.TB, name string, tags map[string]string, join string) *serf.Serf {
	t.Helper()
	s, err := StartSerfMember(t, name, tags, nil, join)
	if err != nil {
		t.Fatalf("serf member %s: %v", name, err)
	}
	return s
}

// StartSerfMember is SerfMember with the gossip key key (none when nil),
// returning serf's error when it refuses to start the member (tags over
// its limit, a bad key) instead of failing the test: hostile-member tests
// check those refusals.
func StartSerfMember(t testing.TB, name string, tags map[string]string, key []byte, join string) (*serf.Serf, error) {
	t.Helper()
	conf := serf.DefaultConfig()
	conf.Init()
	conf.NodeName = name
	conf.Tags = tags
	conf.LogOutput = io.Discard
	conf.BroadcastTimeout = time.Second
	conf.MemberlistConfig.BindAddr = "127.0.0.1"
	conf.MemberlistConfig.BindPort = 0
	conf.MemberlistConfig.LogOutput = io.Discard
	conf.MemberlistConfig.SecretKey = key
	// serf's LAN default is 30 s: a member whose join broadcast a busy
	// node missed (CI's two test binaries on two cores) learns of it only
	// at the next full state exchange, so tests' members exchange often.
	conf.MemberlistConfig.PushPullInterval = 2 * time.Second
	s, err := serf.Create(conf)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		if s.State() != serf.SerfShutdown {
			s.Leave()
			s.Shutdown()
		}
	})
	if join != "" {
		if _, err := s.Join([]string{join}, true); err != nil {
			t.Fatalf("%s joining %s: %v", name, join, err)
		}
	}
	return s, nil
}

// SerfAddr is a member's gossip address.
func SerfAddr(s *serf.Serf) string {
	m := s.LocalMember()
	return net.JoinHostPort(m.Addr.String(), strconv.Itoa(int(m.Port)))
}
