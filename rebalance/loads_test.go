package rebalance

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/serf/serf"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// reportLoad makes the serf member s gossip load in metric as the
// rebalance app does (the tag lbx_load with a sequence number that grows
// with each report), about every 100 ms on top of the tags, until the
// returned stop is called or the test ends.
func reportLoad(t *testing.T, s *serf.Serf, tags map[string]string, metric string, load float64) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for seq := 1; ; seq++ {
			next := make(map[string]string, len(tags)+1)
			for k, v := range tags {
				next[k] = v
			}
			next[shed.LoadTag] = fmt.Sprintf("%s %g %d", metric, load, seq)
			_ = s.SetTags(next) // waits for the broadcast, up to a second
			select {
			case <-quit:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			close(quit)
			<-done
		})
	}
	t.Cleanup(stop)
	return stop
}

// TestMemberLoads: real serf members on loopback report loads to a real
// rebalance app. The loads that count are exactly those of the members
// the app's decision counts: fresh, alive, same metric; a member whose
// report never changes, one in another metric, one without a report and
// one that left do not.
func TestMemberLoads(t *testing.T) {
	// Never shedding: while only some reports count yet, 7 can be far
	// above their average, and the test reads the front's own load.
	front := testApp(t, "ml-front", &fakeSource{load: 7}, func(_ *cluster.App, a *App) {
		many := 1000
		a.MinConnections = &many
	})
	join := front.gossipAddr()
	fresh := lbxtest.SerfMember(t, "ml-fresh", nil, join)
	reportLoad(t, fresh, map[string]string{"http_port": "8001"}, metricConnections, 120)
	cpu := lbxtest.SerfMember(t, "ml-cpu", nil, join)
	reportLoad(t, cpu, nil, metricCPU, 50)
	lbxtest.SerfMember(t, "ml-stale", map[string]string{shed.LoadTag: "connections 5 1"}, join)
	lbxtest.SerfMember(t, "ml-silent", map[string]string{"http_port": "8004"}, join)
	gone := lbxtest.SerfMember(t, "ml-gone", nil, join)
	stopGone := reportLoad(t, gone, nil, metricConnections, 1)

	counting := func() (map[string]float64, error) {
		ms, err := nodeLoads{front.cluster}.memberLoads(time.Now())
		if err != nil {
			return nil, err
		}
		out := map[string]float64{}
		for _, m := range ms {
			if m.Counts {
				out[m.Name] = m.Load
			}
		}
		return out, nil
	}
	lbxtest.WaitFor(t, 15*time.Second, "ml-fresh and ml-gone count", func() (bool, string) {
		got, err := counting()
		_, a := got["ml-fresh"]
		_, b := got["ml-gone"]
		return err == nil && a && b, fmt.Sprintf("%v %v", got, err)
	})
	stopGone()
	if err := gone.Leave(); err != nil {
		t.Fatal(err)
	}
	gone.Shutdown()
	lbxtest.WaitFor(t, 15*time.Second, "only ml-fresh and this node count, as in the decision", func() (bool, string) {
		got, err := counting()
		ok, why := seesLoads(front.node, 2)
		return err == nil && ok && len(got) == 2 && got["ml-fresh"] == 120 && got["ml-front"] == 7,
			fmt.Sprintf("loads %v %v; decision: %s", got, err, why)
	})
	ms, _ := nodeLoads{front.cluster}.memberLoads(time.Now())
	for _, m := range ms {
		if m.Name == "ml-fresh" {
			if addr, err := m.DialAddr("", "http_port"); err != nil || addr != "127.0.0.1:8001" {
				t.Errorf("ml-fresh dials at %q (%v)", addr, err)
			}
		}
	}
	stopped := &App{cluster: &cluster.App{}}
	if _, err := (nodeLoads{stopped.cluster}).memberLoads(time.Now()); err != errNotStarted {
		t.Errorf("no node: %v", err)
	}
}
