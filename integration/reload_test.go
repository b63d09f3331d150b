package integration

import (
	"fmt"
	"slices"
	"testing"
)

// Latency state is per dial address and survives a reload that keeps the
// address; it is released when no config uses the address any more.
func TestEWMAStateSurvivesReload(t *testing.T) {
	e := newEnv(t)
	b1, b2 := e.backend("b1", plainHTTP), e.backend("b2", plainHTTP)
	proxy := func(bs ...*backend) string {
		return fmt.Sprintf("\treverse_proxy %s {\n\t\tlb_policy ewma\n\t}\n", dials(bs...))
	}

	// Config A.
	e.load(proxy(b1, b2))
	if r := e.drive("/", 60, 4); len(r.errors) > 0 || r.counts["b1"] == 0 || r.counts["b2"] == 0 {
		t.Fatalf("config A: %v, errors %q; want both backends used, no errors", r.counts, r.errors)
	}
	before := report(t)
	for _, b := range []*backend{b1, b2} {
		if u, ok := before.upstream(b.addr); !ok || u.Samples == 0 || u.EstimateMs <= 0 {
			t.Fatalf("config A: %s: %+v (listed %v); want samples and an estimate", b.name, u, ok)
		}
	}

	// Config B: another route added, same upstreams. No traffic between
	// the reload and the check: the state must not depend on the new
	// config having served a request before the old one was stopped.
	e.load("\thandle /other {\n\t\trespond other\n\t}\n" + proxy(b1, b2))
	after := report(t)
	for _, b := range []*backend{b1, b2} {
		old, _ := before.upstream(b.addr)
		u, ok := after.upstream(b.addr)
		if !ok {
			t.Errorf("config B: %s no longer listed after a reload that kept it", b.name)
			continue
		}
		t.Logf("%s: samples %d → %d, estimate %.3f → %.3f ms", b.name, old.Samples, u.Samples, old.EstimateMs, u.EstimateMs)
		if u.Samples < old.Samples || u.EstimateMs <= 0 {
			t.Errorf("config B: %s: samples %d → %d, estimate %.3f ms; want samples kept and a non-zero estimate",
				b.name, old.Samples, u.Samples, u.EstimateMs)
		}
	}
	// And the new config keeps using them.
	if r := e.drive("/", 20, 2); len(r.errors) > 0 {
		t.Fatalf("config B: errors %q", r.errors)
	}

	// Config C: b2 dropped. Its state is released; b1's stays.
	e.load(proxy(b1))
	final := report(t)
	if u, ok := final.upstream(b2.addr); ok {
		t.Errorf("config C: %s is still listed (%+v) though no config uses it", b2.name, u)
	}
	if _, ok := final.upstream(b1.addr); !ok {
		t.Errorf("config C: %s is no longer listed though config C uses it", b1.name)
	}
}

// A stock config is untouched by lbx: round_robin cycles through the
// upstreams in order, and no lbx state is kept for them.
func TestStockRoundRobinUnchanged(t *testing.T) {
	e := newEnv(t)
	bs := []*backend{e.backend("b0", plainHTTP), e.backend("b1", plainHTTP), e.backend("b2", plainHTTP)}
	e.load(fmt.Sprintf("reverse_proxy %s {\n\tlb_policy round_robin\n}", dials(bs...)))

	index := func(name string) int {
		return slices.IndexFunc(bs, func(b *backend) bool { return b.name == name })
	}
	var seq []string
	for range 9 {
		seq = append(seq, e.mustGet("/rr"))
	}
	t.Logf("sequence: %v", seq)
	for i := 1; i < len(seq); i++ {
		prev, cur := index(seq[i-1]), index(seq[i])
		if prev < 0 || cur != (prev+1)%len(bs) {
			t.Fatalf("round_robin sequence %v: request %d went to %s after %s; want the next upstream in order",
				seq, i, seq[i], seq[i-1])
		}
	}

	rep := report(t)
	for _, b := range bs {
		if u, ok := rep.upstream(b.addr); ok {
			t.Errorf("/lbx/upstreams lists %s (%+v) under a stock policy; the transport must not be wrapped", b.name, u)
		}
	}
	if p, ok := rep.pool(bs...); ok {
		t.Errorf("/lbx/upstreams lists a pool for a stock policy: %+v", p)
	}
}
