package integration

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// The black hole: a backend that answers 503 at once has the fewest
// requests in flight, so least_conn feeds it the most traffic. ewma with
// outlier ejection takes it out after a few failures in a row.
func TestOutlierEjectsBlackHole(t *testing.T) {
	e := newEnv(t)
	bs := e.startBackends(4)
	hole := bs[3]
	hole.status.Store(http.StatusServiceUnavailable)

	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy least_conn
}`, dials(bs...)))
	// The black hole answers only 503s: the failed requests are its share.
	stock := e.drive("/", 400, 8)
	t.Logf("least_conn: %v; %d of 400 to the black hole (failed)", stock.counts, len(stock.errors))

	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		outlier {
			consecutive_failures 3
			base_ejection_time 1m
		}
	}
}`, dials(bs...)))
	res := e.drive("/", 400, 8)
	t.Logf("ewma+outlier: %v; %d of 400 to the black hole (failed)", res.counts, len(res.errors))
	// 3 failures eject it; requests already on their way when it was
	// ejected (at most the 8 in flight) may still reach it.
	if got := int(hole.hits.Load()) - len(stock.errors); got > 3+8 || len(res.errors) != got {
		t.Fatalf("black hole got %d of 400 requests (%d failed) after 3 failures", got, len(res.errors))
	}
	if len(res.errors) >= len(stock.errors) {
		t.Fatalf("ewma+outlier sent %d requests to the black hole, least_conn %d", len(res.errors), len(stock.errors))
	}
	u, ok := report(t).upstream(hole.addr)
	if !ok || u.Ejections != 1 || u.EjectedMs <= 0 {
		t.Fatalf("admin API must show the black hole ejected once: %+v", u)
	}
	if p, ok := report(t).pool(bs...); !ok || p.Available != 3 || p.Upstreams[3].Available {
		t.Fatalf("pool report must count the ejected upstream as unavailable: %+v", p)
	}
	// The same in Prometheus form, on Caddy's admin /metrics.
	res2, err := adminClient.Get("http://" + adminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(res2.Body)
	res2.Body.Close()
	for _, want := range []string{
		fmt.Sprintf(`caddy_lbx_upstream_ejected{upstream=%q} 1`, hole.addr),
		fmt.Sprintf(`caddy_lbx_upstream_ejections_total{reason="consecutive_failures",upstream=%q} 1`, hole.addr),
		fmt.Sprintf(`caddy_lbx_upstream_ejected{upstream=%q} 0`, bs[0].addr),
		`caddy_lbx_pool_panic{policy="ewma"`,
	} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	for _, b := range bs[:3] {
		if u, _ := report(t).upstream(b.addr); u.Ejections != 0 {
			t.Fatalf("healthy %s ejected: %+v", b.name, u)
		}
	}
}
