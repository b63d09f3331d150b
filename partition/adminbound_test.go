package partition

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// TestAdminViewBounded checks that the admin view of a handler with a
// long upstream list lists at most the replicas asked for per partition,
// the not usable ones first, with totals that count them all; and that
// ?replicas= is checked. Before the bound the view of 50,000 upstreams
// listed every one (several MB).
func TestAdminViewBounded(t *testing.T) {
	l, hosts := chooseCase(t, "unusable", 50000)
	defer hosts.Release()
	h := &Handler{}
	h.current.Store(l)
	now := monoclock.Now()
	v := h.view(now, defaultViewReplicas)
	body, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if len(body) > 16<<10 {
		t.Errorf("view of %d upstreams is %d bytes; want at most 16 KiB", len(l.byAddr), len(body))
	}
	if len(v.Schemes) != 2 {
		t.Fatalf("%d schemes; want 2", len(v.Schemes))
	}
	p := v.Schemes[1].Partitions[3]
	if p.Total != 12499 || p.Ejected != 12499 || p.Usable != 0 || len(p.Replicas) != defaultViewReplicas ||
		p.Omitted != 12499-defaultViewReplicas || p.Replicas[0].Health != "ejected" {
		t.Errorf("partition p3 of 4: total %d, ejected %d, usable %d, %d listed, %d omitted, first %+v",
			p.Total, p.Ejected, p.Usable, len(p.Replicas), p.Omitted, p.Replicas[0])
	}
	if p := v.Schemes[0].Partitions[0]; p.Total != 1 || p.Usable != 1 || len(p.Replicas) != 1 || p.Omitted != 0 {
		t.Errorf("partition p0 of 3: %+v; want its one usable replica listed", p)
	}

	for q, want := range map[string]int{"": 200, "replicas=0": 200, "replicas=1000": 200, "replicas=1001": 400, "replicas=-1": 400, "replicas=x": 400} {
		rec := httptest.NewRecorder()
		err := servePartitions(rec, httptest.NewRequest(http.MethodGet, "/lbx/partitions?"+q, nil))
		got := rec.Code
		var apiErr caddy.APIError
		if errors.As(err, &apiErr) {
			got = apiErr.HTTPStatus
		}
		if got != want {
			t.Errorf("?%s: status %d (%v); want %d", q, got, err, want)
		}
	}
}
