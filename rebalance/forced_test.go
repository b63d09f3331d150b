package rebalance

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestNodeForcedCloses runs a node whose load source is a real tracker,
// with boundary_timeout set: a connection whose response never ends (it
// stays active), shed through the source as the node sheds, is
// force-closed by the node's own per-interval sweep, and the forced close
// shows in the rebalance_shed event, the admin view and the
// forced_closes_total metric.
func TestNodeForcedCloses(t *testing.T) {
	tr := conntrack.NewTracker()
	server, client := net.Pipe()
	defer server.Close()
	defer client.Close()
	tr.ConnState(server, http.StateNew)
	tr.ConnState(server, http.StateActive)
	ctx, rec := lbxtest.SubscribeEvents(t, EventShed)
	src := &processSource{tracker: tr}
	a := startAppCtx(t, ctx, "forcing", src, func(_ *cluster.App, a *App) {
		a.ShedRate = 0
		a.Interval = caddy.Duration(100 * time.Millisecond) // the minimum
		a.BoundaryTimeout = caddy.Duration(300 * time.Millisecond)
	})

	if r := src.Shed(1); r != (ShedResult{Active: 1}) {
		t.Fatalf("Shed(1) = %+v", r)
	}
	lbxtest.WaitFor(t, 10*time.Second, "the node forces the connection closed", func() (bool, string) {
		a.node.mu.Lock()
		defer a.node.mu.Unlock()
		return a.node.forced == 1, fmt.Sprintf("forced %d", a.node.forced)
	})
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := client.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("the client's read after the forced close: %v; want EOF", err)
	}

	// The event is emitted after the node's lock is released: wait for it.
	lbxtest.WaitFor(t, 10*time.Second, "one forced close in the events", func() (bool, string) {
		var forced int
		for _, e := range rec.Events() {
			if e.Data["node"] != "forcing" {
				continue
			}
			if f, _ := e.Data["forced"].(int); f > 0 {
				forced += f
				if e.Data["count"] != 0 {
					t.Errorf("event %v: a lone node sheds nothing itself", e.Data)
				}
			}
		}
		return forced == 1, fmt.Sprintf("events report %d forced", forced)
	})
	v := a.node.view(time.Now(), connStats{})
	if v.ForcedCloses != 1 || v.BoundaryTimeout != 300 || !strings.Contains(v.ShedTotalHuman, "1 forced") {
		t.Errorf("admin view: forced_closes_total %d, boundary_timeout_ms %d, %q", v.ForcedCloses, v.BoundaryTimeout, v.ShedTotalHuman)
	}
	if v.JoinSettle != 3000 { // freshness: 5 × 100ms, at least 3s
		t.Errorf("admin view: join_settle_ms %d; want the default, freshness, 3000", v.JoinSettle)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metricsCollector{})
	if got, ok := metricValue(t, reg, "caddy_lbx_rebalance_forced_closes_total", map[string]string{"node": "forcing"}); !ok || got != 1 {
		t.Errorf("forced_closes_total = %v (%v); want 1", got, ok)
	}
	// net/http would report the close; the tracker then forgets it.
	tr.ConnState(server, http.StateClosed)
	if c := tr.Counts(); c != (conntrack.Counts{}) {
		t.Errorf("counts %+v after the close; want none", c)
	}
}
