package rebalance

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/shed"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// startAppCtx is testApp with the caller's context; mut, when not nil,
// changes the apps' settings before they are provisioned.
func startAppCtx(t *testing.T, ctx caddy.Context, name string, src loadSource, mut func(*cluster.App, *App)) *App {
	t.Helper()
	zero := 0
	c := &cluster.App{NodeName: name, Bind: "127.0.0.1:0"}
	a := &App{
		MinConnections: &zero, ShedRate: 10, source: src, cluster: c,
		Interval: caddy.Duration(100 * time.Millisecond), History: caddy.Duration(100 * time.Millisecond),
	}
	if mut != nil {
		mut(c, a)
	}
	for _, step := range []func() error{
		func() error { return c.Provision(ctx) }, func() error { return a.Provision(ctx) },
		a.Validate, c.Start, a.Start,
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		a.stopAll()
		a.Cleanup()
	})
	return a
}

// TestShedEventAndMetrics runs two members, one overloaded, with a real
// events app in the overloaded one's config: each interval that sheds
// emits rebalance_shed with what it shed, and the metrics agree with the
// load source and the events.
func TestShedEventAndMetrics(t *testing.T) {
	ctx, rec := lbxtest.SubscribeEvents(t, EventShed)
	fleet := newFakeFleet(400, 100)
	srcA, srcB := fleet[0], fleet[1]
	a := startAppCtx(t, ctx, "ev-a", srcA, nil)
	testApp(t, "ev-b", srcB, func(c *cluster.App, x *App) { c.Join = []string{a.gossipAddr()} })

	lbxtest.WaitFor(t, 20*time.Second, "ev-a sheds, then reaches the stop band", func() (bool, string) {
		load, shed := srcA.get()
		a.node.mu.Lock()
		d := a.node.last
		a.node.mu.Unlock()
		return shed > 0 && !d.Active(), fmt.Sprintf("load %.0f, shed %d, last decision %+v", load, shed, d)
	})
	_, shed := srcA.get()

	events := rec.Events()
	if len(events) == 0 {
		t.Fatal("no rebalance_shed event")
	}
	total := 0
	for _, e := range events {
		d := e.Data
		if e.Name() != EventShed || d["node"] != "ev-a" || d["metric"] != metricConnections || d["members_counted"] != 2 {
			t.Errorf("event %s %v", e.Name(), d)
		}
		count, _ := d["count"].(int)
		if count <= 0 || d["idle"] != count || d["active"] != 0 || d["hijacked"] != 0 {
			t.Errorf("event counts %v", d)
		}
		if local, avg := d["local"].(float64), d["average"].(float64); !(local > avg && avg > 0) {
			t.Errorf("event local %v, average %v: want local above a positive average", local, avg)
		}
		total += count
	}
	if total != shed {
		t.Errorf("events add up to %d shed; the source shed %d", total, shed)
	}

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metricsCollector{})
	val := func(name string, labels map[string]string) float64 {
		t.Helper()
		v, ok := metricValue(t, reg, name, labels)
		if !ok {
			t.Fatalf("no %s%v", name, labels)
		}
		return v
	}
	nodeA, nodeB := map[string]string{"node": "ev-a"}, map[string]string{"node": "ev-b"}
	if v := val("caddy_lbx_rebalance_shed_decisions_total", nodeA); v != float64(len(events)) {
		t.Errorf("ev-a shed_decisions_total = %v; want %d (one per event)", v, len(events))
	}
	for kind, want := range map[string]int{"idle": shed, "active": 0, "hijacked": 0} {
		if v := val("caddy_lbx_rebalance_connections_shed_total", map[string]string{"node": "ev-a", "kind": kind}); v != float64(want) {
			t.Errorf("ev-a connections_shed_total{kind=%q} = %v; want %d", kind, v, want)
		}
	}
	if v := val("caddy_lbx_rebalance_shed_decisions_total", nodeB); v != 0 {
		t.Errorf("ev-b shed_decisions_total = %v; want 0", v)
	}
	for _, l := range []map[string]string{nodeA, nodeB} {
		if v := val("caddy_lbx_rebalance_members_counted", l); v != 2 {
			t.Errorf("%v members_counted = %v; want 2", l, v)
		}
	}
	// Shedding has stopped, so the loads stay put; ev-b's metrics may lag
	// them by an interval.
	loadA, _ := srcA.get()
	loadB, _ := srcB.get()
	if loadA+loadB != 500 {
		t.Errorf("the fleet holds %.0f connections; want 500", loadA+loadB)
	}
	lbxtest.WaitFor(t, 2*time.Second, "ev-b's load and average settle", func() (bool, string) {
		local, _ := metricValue(t, reg, "caddy_lbx_rebalance_local_load", nodeB)
		avg, _ := metricValue(t, reg, "caddy_lbx_rebalance_cluster_average", nodeB)
		return local == loadB && avg == (loadA+loadB)/2, fmt.Sprintf("local %v (want %v), average %v (want %v)", local, loadB, avg, (loadA+loadB)/2)
	})
}

// TestEventNoEventsApp: without an events app in the config the emitter
// sends nothing and does not create one (internal/events tests that it
// holds none).
func TestEventNoEventsApp(t *testing.T) {
	ctx := testContext(t)
	e := newEmitter(ctx)
	e.emitShed("n", metricConnections, 2, shed.Decision{Average: 1, Counted: 2}, ShedResult{Idle: 1}, 0)
	if _, err := ctx.AppIfConfigured("events"); err == nil {
		t.Fatal("the events app was created")
	}
}
