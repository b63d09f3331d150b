package selective

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// A group's reverse_proxy that names no policy runs ewma: with one fast
// and one slow replica in the group, the slow one gets few requests
// (Caddy's default, random, gives it about half).
func TestGroupDefaultPolicyEWMA(t *testing.T) {
	e := newEnv(t)
	fast, slow := e.backend("fast"), e.backend("slow")
	slow.delay.Store(int64(30 * time.Millisecond))
	e.load(fmt.Sprintf("\tselective {\n\t\tgroup only {\n\t\t\treverse_proxy %s %s\n\t\t}\n\t}", fast.addr, slow.addr))
	by := map[string]int{}
	const n = 100
	for range n {
		r := e.do(http.MethodGet, "/")
		if r.err != nil || r.status != http.StatusOK {
			t.Fatalf("request failed: %v, status %d", r.err, r.status)
		}
		by[r.body]++
	}
	if by["slow"] > n/4 {
		t.Fatalf("answers by replica: %v; want the slow one to get at most a quarter, as ewma gives it", by)
	}
}
