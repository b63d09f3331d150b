package lbpolicy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
	"github.com/caddy-lbx/lbx/internal/orca"
)

// proxyWithPolicy provisions a real reverse_proxy handler with n upstreams
// and the given selection policy JSON, exactly as Caddy would from a
// config, and returns its policy and upstream pool.
func proxyWithPolicy(b *testing.B, policy string, n int) (reverseproxy.Selector, reverseproxy.UpstreamPool) {
	return proxyWithLB(b, policy, "", n)
}

// proxyWithLB is proxyWithPolicy with more load_balancing options (JSON
// members, each with a leading comma).
func proxyWithLB(b *testing.B, policy, lb string, n int) (reverseproxy.Selector, reverseproxy.UpstreamPool) {
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		b.Fatal(err)
	}
	ups := make([]string, n)
	for i := range ups {
		ups[i] = fmt.Sprintf(`{"dial":"%s-%d:80"}`, strings.ReplaceAll(b.Name(), "/", "_"), i)
	}
	raw := fmt.Sprintf(`{"upstreams":[%s],"load_balancing":{"selection_policy":%s%s}}`, strings.Join(ups, ","), policy, lb)
	mod, err := ctx.LoadModuleByID("http.handlers.reverse_proxy", json.RawMessage(raw))
	if err != nil {
		b.Fatal(err)
	}
	h := mod.(*reverseproxy.Handler)
	b.Cleanup(func() { _ = h.Cleanup() })
	return h.LoadBalancing.SelectionPolicy, h.Upstreams
}

// BenchmarkSelect compares the cost of one selection for lbx's ewma policy
// and Caddy's stock policies, each provisioned in a real reverse_proxy
// handler, on a small and a large pool. The targets: ewma in two-choice
// mode allocates nothing, costs the same on 3 and 1000 upstreams (within
// 1.5×), and is within 1.5× of stock random_choose 2.
//
//	go test ./lbpolicy -run '^$' -bench Select -benchmem
func BenchmarkSelect(b *testing.B) {
	policies := []struct{ name, json, lb string }{
		{"ewma_choices_2", `{"policy":"ewma","choices":2}`, ""},
		{"ewma_choices_all", `{"policy":"ewma","choices":"all"}`, ""},
		{"ewma_choices_2_outlier", `{"policy":"ewma","choices":2,"outlier":{}}`, ""},
		// every option an ewma pool adds to a selection: outlier ejection, a slow
		// start (nobody ramping, the common case) and a retry budget
		// (marking each request as it arrives)
		{"ewma_choices_2_ss", `{"policy":"ewma","choices":2,"slow_start":{"window":"30s"}}`, ""},
		{"ewma_choices_2_rb", `{"policy":"ewma","choices":2,"retry_budget":{}}`, ""},
		{"ewma_choices_2_outlier_ss_rb", `{"policy":"ewma","choices":2,"outlier":{},"slow_start":{"window":"30s"},"retry_budget":{}}`, ""},
		// every upstream has a fresh load report (see reported below)
		{"ewma_choices_2_reports", `{"policy":"ewma","choices":2}`, ""},
		{"ewma_choices_all_reports", `{"policy":"ewma","choices":"all"}`, ""},
		{"stock_random_choose_2", `{"policy":"random_choose","choose":2}`, ""},
		{"stock_least_conn", `{"policy":"least_conn"}`, ""},
		{"panic_least_conn", `{"policy":"panic","selection_policy":{"policy":"least_conn"}}`, ""},
		{"panic_least_conn_outlier", `{"policy":"panic","outlier":{},"selection_policy":{"policy":"least_conn"}}`, ""},
		// with retries configured, a first attempt also records the
		// upstream it chose, for a retry to avoid
		{"ewma_choices_2_retries", `{"policy":"ewma","choices":2}`, `,"retries":2`},
		{"ewma_choices_all_retries", `{"policy":"ewma","choices":"all"}`, `,"retries":2`},
		{"panic_least_conn_retries", `{"policy":"panic","selection_policy":{"policy":"least_conn"}}`, `,"retries":2`},
		// consistent hashing with bounded loads beside Caddy's unbounded
		// rendezvous hash of the same key
		{"consistent_hash", `{"policy":"consistent_hash"}`, ""},
		{"stock_uri_hash", `{"policy":"uri_hash"}`, ""},
	}
	for _, n := range []int{3, 1000} {
		for _, p := range policies {
			b.Run(fmt.Sprintf("%s/pool=%d", p.name, n), func(b *testing.B) {
				sel, pool := proxyWithLB(b, p.json, p.lb, n)
				if lt, ok := sel.(leastTimer); ok {
					s := lt.leastTime()
					for i, u := range pool {
						observe(s, u, time.Duration(1+i%5)*time.Millisecond, hoststate.Success)
						if strings.HasSuffix(p.name, "_reports") {
							r, err := orca.Parse(fmt.Sprintf("TEXT application_utilization=%g", 0.2+0.1*float64(i%8)))
							if err != nil {
								b.Fatal(err)
							}
							s.table.Stats(u.Dial).SetLoadReport(r, monoclock.Now(), time.Hour)
						}
					}
				}
				// a request as Caddy's server hands it over, with its
				// variables; emptied each time, as a new request's are
				vars := map[string]any{}
				req := httptest.NewRequestWithContext(context.WithValue(context.Background(), caddyhttp.VarsCtxKey, vars), http.MethodGet, "/", nil)
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					clear(vars)
					if sel.Select(pool, req, nil) == nil {
						b.Fatal("nil pick")
					}
				}
			})
		}
	}
}

// BenchmarkSelectRetry measures a request's first attempt and one retry
// together, with retries configured: the retry reads what was tried,
// leaves it out and records its own choice (it may allocate; a first
// attempt does not).
func BenchmarkSelectRetry(b *testing.B) {
	for _, p := range []struct{ name, json string }{
		{"ewma_choices_2", `{"policy":"ewma","choices":2}`},
		{"ewma_choices_all", `{"policy":"ewma","choices":"all"}`},
		{"panic_least_conn", `{"policy":"panic","selection_policy":{"policy":"least_conn"}}`},
	} {
		b.Run(p.name+"/pool=16", func(b *testing.B) {
			sel, pool := proxyWithLB(b, p.json, `,"retries":2`, 16)
			vars, repl := map[string]any{}, caddy.NewReplacer()
			ctx := context.WithValue(context.WithValue(context.Background(), caddyhttp.VarsCtxKey, vars), caddy.ReplacerCtxKey, repl)
			req := httptest.NewRequestWithContext(ctx, http.MethodGet, "/", nil)
			b.ReportAllocs()
			for b.Loop() {
				clear(vars)
				repl.Delete(triedKey)
				first := sel.Select(pool, req, nil)
				if retry := sel.Select(pool, req, nil); retry == nil || retry == first {
					b.Fatalf("retry picked %v after %v", retry, first)
				}
			}
		})
	}
}

// BenchmarkSelectParallel measures ewma two-choice selection under
// contention from all cores.
func BenchmarkSelectParallel(b *testing.B) {
	sel, pool := proxyWithPolicy(b, `{"policy":"ewma","choices":2}`, 16)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if sel.Select(pool, nil, nil) == nil {
				b.Fatal("nil pick")
			}
		}
	})
}
