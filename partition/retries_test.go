package partition

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestRetriesZeroMeansNone: `lb_retries 0` turns retries off, while
// leaving lb_retries out keeps the default of one retry on another
// replica of the partition.
func TestRetriesZeroMeansNone(t *testing.T) {
	e := newEnv(t)
	good := e.backend("good")
	deadAddr := e.deadAddr() // connection refused
	// lb_policy first always tries the dead replica first.
	to := []string{deadAddr + " 0/1", good.addr + " 0/1"}

	e.load(partitionSite(to, "lb_policy first", "lb_retries 0"))
	for i := range 5 {
		res := e.get("/")
		if want := "1/1 partitions failed, fail_limit=1 [p0]connection refused\n"; res.status != http.StatusBadGateway || res.body != want {
			t.Fatalf("lb_retries 0, request %d: status %d body %q; want 502 %q", i, res.status, res.body, want)
		}
	}
	if n := good.hits.Load(); n != 0 {
		t.Errorf("lb_retries 0: the live replica got %d requests; nothing may be retried", n)
	}

	e.load(partitionSite(to, "lb_policy first"))
	for i := range 5 {
		if res := e.get("/"); res.status != http.StatusOK {
			t.Fatalf("default retries, request %d: status %d body %q; the retry must reach the live replica", i, res.status, res.body)
		}
	}
	if n := good.hits.Load(); n != 5 {
		t.Errorf("default retries: the live replica got %d of 5 requests", n)
	}

	// Retries given both ways in JSON are refused.
	cfg := fmt.Sprintf(`{"admin":{"listen":"localhost:%d"},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:%d"],
		"routes":[{"handle":[{"handler":"partition","upstreams":[{"dial":%q,"tag":"0/1"}],
			"retries":0,"proxy":{"load_balancing":{"retries":2}}}]}]}}}}}`, adminPort, httpPort, good.addr)
	if err := postJSON(cfg); err == nil || !strings.Contains(err.Error(), "retries given twice") {
		t.Errorf("retries twice: load error %v", err)
	}
}
