package integration

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// The black hole: a backend that answers 503 at once has the fewest
// requests in flight, so least_conn feeds it the most traffic. ewma prices
// it out after its first failure (and ejects it if it keeps failing); a
// stock policy behind the panic wrapper with outlier ejection stops
// getting it after 3 failures in a row.
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

	// ewma with outlier ejection: the first instant 503 is charged at
	// least twice the pool's typical latency, so the hole is priced out at
	// once; it is ejected if it still fails 3 times in a row (requests
	// already on their way, at most the 8 in flight, may reach it).
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy ewma {
		outlier {
			consecutive_failures 3
			base_ejection_time 1m
		}
	}
}`, dials(bs...)))
	before := hole.hits.Load()
	res := e.drive("/", 400, 8)
	got := int(hole.hits.Load() - before)
	t.Logf("ewma+outlier: %v; %d of 400 to the black hole (failed)", res.counts, got)
	if got > 3+8 || len(res.errors) != got {
		t.Fatalf("black hole got %d of 400 requests (%d failed: %q)", got, len(res.errors), res.errors[:min(len(res.errors), 5)])
	}
	if float64(got)/400 >= 0.02 || got >= len(stock.errors) {
		t.Fatalf("ewma+outlier sent %d of 400 to the black hole (least_conn %d); want under 2%%", got, len(stock.errors))
	}
	if u, _ := report(t).upstream(hole.addr); got >= 3 && u.Ejections != 1 {
		t.Fatalf("the black hole failed %d times in a row, yet it was not ejected: %+v", got, u)
	}

	// A stock policy behind the panic wrapper has only ejection to protect
	// it: least_conn keeps choosing the hole until 3 failures eject it.
	hole2 := e.startBackends(1)[0]
	hole2.status.Store(http.StatusServiceUnavailable)
	bs = append(bs[:3:3], hole2)
	e.load(fmt.Sprintf(`reverse_proxy %s {
	lb_policy panic {
		outlier {
			consecutive_failures 3
			base_ejection_time 1m
		}
		policy least_conn
	}
}`, dials(bs...)))
	res = e.drive("/", 400, 8)
	got = int(hole2.hits.Load())
	t.Logf("panic(least_conn)+outlier: %v; %d of 400 to the black hole (failed)", res.counts, got)
	if got < 3 || got > 3+8 || len(res.errors) != got {
		t.Fatalf("black hole got %d of 400 requests (%d failed); want 3 and those in flight", got, len(res.errors))
	}
	u, ok := report(t).upstream(hole2.addr)
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
		fmt.Sprintf(`caddy_lbx_upstream_ejected{upstream=%q} 1`, hole2.addr),
		fmt.Sprintf(`caddy_lbx_upstream_ejections_total{reason="consecutive_failures",upstream=%q} 1`, hole2.addr),
		fmt.Sprintf(`caddy_lbx_upstream_ejected{upstream=%q} 0`, bs[0].addr),
		`caddy_lbx_pool_panic{policy="panic(least_conn)"`,
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
