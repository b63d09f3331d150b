package partition

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// BenchmarkFanOut measures what fanning out costs on top of the slowest
// partition. A real Caddy (run in this process, admin off) serves three
// routes over three backends on 127.0.0.1 that answer a small JSON object
// after 1, 2 and 4 ms: /fan, a partition handler over all three (merge
// json), /parallel, a parallel handler with one branch per backend (a
// reverse_proxy each), /slowest, reverse_proxy to the 4 ms backend alone,
// and /fast, reverse_proxy to the 1 ms one. Requests are sequential, so ns/op is the
// latency of one request. allocs/op counts the whole process (client,
// Caddy and backends alike): compare fan_out_3 with slowest_alone, which
// does the same except the fan-out. overhead_ms is the median latency of
// a fan-out minus the median latency of the slowest partition alone,
// measured interleaved in one run; parallel_overhead_ms the same for the
// parallel handler.
//
// Run it on its own (it loads its own Caddy config):
//
//	go test ./partition -run '^$' -bench FanOut -benchmem
func BenchmarkFanOut(b *testing.B) {
	delays := []time.Duration{time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond}
	backends := make([]string, len(delays))
	for i, d := range delays {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(d)
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"hits":[%d],"took":{"p%d":%d}}`, i, i, d.Milliseconds())
		}))
		b.Cleanup(srv.Close)
		backends[i] = srv.Listener.Addr().String()
	}
	port := freePort(b)
	cfg := fmt.Sprintf(`{
	"admin": {"disabled": true},
	"logging": {"logs": {"default": {"level": "ERROR"}}},
	"apps": {"http": {"servers": {"bench": {
		"listen": ["127.0.0.1:%d"],
		"automatic_https": {"disable": true},
		"routes": [
			{"match": [{"path": ["/fan"]}], "handle": [{"handler": "partition", "merge": {"merger": "json"},
				"upstreams": [{"dial": %q, "tag": "0/3"}, {"dial": %q, "tag": "1/3"}, {"dial": %q, "tag": "2/3"}]}]},
			{"match": [{"path": ["/parallel"]}], "handle": [{"handler": "parallel", "branches": [
				{"routes": [{"handle": [{"handler": "reverse_proxy", "upstreams": [{"dial": %[2]q}]}]}]},
				{"routes": [{"handle": [{"handler": "reverse_proxy", "upstreams": [{"dial": %[3]q}]}]}]},
				{"routes": [{"handle": [{"handler": "reverse_proxy", "upstreams": [{"dial": %[4]q}]}]}]}]}]},
			{"match": [{"path": ["/slowest"]}], "handle": [{"handler": "reverse_proxy", "upstreams": [{"dial": %[4]q}]}]},
			{"match": [{"path": ["/fast"]}], "handle": [{"handler": "reverse_proxy", "upstreams": [{"dial": %[2]q}]}]}
		]
	}}}}
}`, port, backends[0], backends[1], backends[2])
	if err := caddy.Load([]byte(cfg), true); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = caddy.Stop() })
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: 10 * time.Second}
	b.Cleanup(client.CloseIdleConnections)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	get := func(b *testing.B, path string) time.Duration {
		start := time.Now()
		res, err := client.Get(base + path)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			b.Fatalf("GET %s: status %d", path, res.StatusCode)
		}
		return time.Since(start)
	}
	for _, path := range []string{"/fan", "/parallel", "/slowest", "/fast"} {
		get(b, path) // warm the connections
	}

	for _, c := range []struct{ name, path string }{
		{"fan_out_3", "/fan"},
		{"parallel_3", "/parallel"},
		{"slowest_alone", "/slowest"},
		{"fastest_alone", "/fast"},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				get(b, c.path)
			}
		})
	}
	b.Run("overhead", func(b *testing.B) {
		var fan, par, slowest []time.Duration
		for b.Loop() {
			fan = append(fan, get(b, "/fan"))
			par = append(par, get(b, "/parallel"))
			slowest = append(slowest, get(b, "/slowest"))
		}
		b.ReportMetric(float64(median(fan)-median(slowest))/1e6, "overhead_ms")
		b.ReportMetric(float64(median(par)-median(slowest))/1e6, "parallel_overhead_ms")
		b.ReportMetric(float64(median(slowest))/1e6, "slowest_ms")
	})
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkMergeJSON merges 4 partitions of 1 MB of JSON shaped like a
// search answer (see bigJSON), Prepare included. B/op against the 4 MB
// of input is the merge's memory factor.
//
//	go test ./partition -run '^$' -bench MergeJSON -benchmem
func BenchmarkMergeJSON(b *testing.B) {
	body := bigJSON(1 << 20)
	b.SetBytes(4 << 20)
	b.ReportAllocs()
	for b.Loop() {
		ps := make([]*Part, 4)
		for i := range ps {
			ps[i] = &Part{Index: i, Body: body}
			if err := (JSONMerger{}).Prepare(ps[i]); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := (JSONMerger{}).Merge(ps); err != nil {
			b.Fatal(err)
		}
	}
}
