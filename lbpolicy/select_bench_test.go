package lbpolicy

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// BenchmarkSelect compares the cost of one selection for lbx's ewma policy
// and Caddy's stock policies, on a small and a large pool. The targets:
// ewma in two-choice mode allocates nothing, costs the same on 3 and 1000
// upstreams (within 1.5×), and is within 1.5× of stock random_choose 2.
//
//	go test ./lbpolicy -run '^$' -bench Select -benchmem
func BenchmarkSelect(b *testing.B) {
	for _, n := range []int{3, 1000} {
		pool := newPool(b, n)
		p2c := provisionEWMA(b, &EWMASelection{Choices: 2})
		scan := provisionEWMA(b, &EWMASelection{Choices: ChoicesAll})
		for _, s := range []*EWMASelection{p2c, scan} {
			for i, u := range pool {
				observe(s, u, time.Duration(1+i%5)*time.Millisecond, hoststate.Success)
			}
		}
		policies := []struct {
			name string
			sel  reverseproxy.Selector
		}{
			{"ewma_choices_2", p2c},
			{"ewma_choices_all", scan},
			{"stock_random_choose_2", reverseproxy.RandomChoiceSelection{Choose: 2}},
			{"stock_least_conn", reverseproxy.LeastConnSelection{}},
			{"stock_random", reverseproxy.RandomSelection{}},
		}
		for _, p := range policies {
			b.Run(fmt.Sprintf("%s/pool=%d", p.name, n), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if p.sel.Select(pool, nil, nil) == nil {
						b.Fatal("nil pick")
					}
				}
			})
		}
	}
}

// BenchmarkSelectParallel measures ewma two-choice selection under
// contention from all cores.
func BenchmarkSelectParallel(b *testing.B) {
	pool := newPool(b, 16)
	s := provisionEWMA(b, &EWMASelection{Choices: 2})
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if s.Select(pool, nil, nil) == nil {
				b.Fatal("nil pick")
			}
		}
	})
}
