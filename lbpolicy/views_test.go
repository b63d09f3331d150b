package lbpolicy

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// A policy whose pools churn (a partition's replicas from a naming file)
// holds references on what its kept views have, not on every address it
// ever saw.
func TestViewsPruneChurnedAddresses(t *testing.T) {
	s := &EWMASelection{table: hoststate.NewTable(hoststate.Config{})}
	t.Cleanup(s.table.Release)
	s.views.pruner = &pruner{table: s.table, static: map[string]bool{"static:80": true}}
	s.table.Stats("static:80")
	const pools = 3 * maxViews
	for i := range pools {
		pool := reverseproxy.UpstreamPool{
			{Dial: fmt.Sprintf("%s-%d-a:80", t.Name(), i)}, {Dial: fmt.Sprintf("%s-%d-b:80", t.Name(), i)},
		}
		s.viewFor(pool)
	}
	if n := s.table.Len(); n != 2*pools+1 {
		t.Fatalf("before pruning the table holds %d addresses; want %d", n, 2*pools+1)
	}
	s.views.pruner.lastNs.Store(0)
	s.views.prune(monoclock.Now() + int64(pruneIdle) + int64(time.Minute))
	live := s.views.dials()
	if n := s.table.Len(); n != len(live)+1 || n > 2*maxViews+1 {
		t.Errorf("after pruning the table holds %d addresses; want the %d of the kept views and the static one", n, len(live))
	}
	if _, ok := s.table.Lookup("static:80"); !ok {
		t.Error("the static upstream was dropped")
	}
	for dial := range live {
		if _, ok := s.table.Lookup(dial); !ok {
			t.Errorf("%s, in a kept view, was dropped", dial)
		}
	}
}
