package partition

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"
)

// getPartitionsView fetches GET /lbx/partitions from the test Caddy.
func getPartitionsView(t *testing.T) partitionsView {
	t.Helper()
	res, err := adminClient.Get(fmt.Sprintf("http://localhost:%d/lbx/partitions", adminPort))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET /lbx/partitions: status %d: %s", res.StatusCode, body)
	}
	if ct := res.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	var v partitionsView
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("body is not the view: %v: %s", err, body)
	}
	return v
}

// TestAdminPartitions: GET /lbx/partitions lists the loaded handler's
// schemes, partitions and replicas, shows a replica Caddy marked down as
// unavailable and its scheme without capacity, and forgets the handler
// when its config is unloaded.
func TestAdminPartitions(t *testing.T) {
	e := newEnv(t)
	_, ok1, deadAddr := e.loadDeadReplica()

	v := getPartitionsView(t)
	if len(v.Handlers) != 1 {
		t.Fatalf("%d handlers, want 1: %+v", len(v.Handlers), v)
	}
	h := v.Handlers[0]
	if h.Static != 3 || len(h.Schemes) != 2 || h.Capacity != 2 || h.CapacityTotal != 2 {
		t.Fatalf("before traffic: %+v; want 3 static upstreams, 2 schemes, capacity 2 of 2", h)
	}
	two := h.Schemes[1]
	if two.Count != 2 || len(two.Partitions) != 2 || two.Partitions[1].Name != "p1" || two.Partitions[1].Tag != "1/2" ||
		len(two.Partitions[1].Replicas) != 1 || two.Partitions[1].Replicas[0].Dial != ok1.addr {
		t.Errorf("scheme of 2: %+v", two)
	}

	// Requests until the dead replica has been tried and marked down.
	waitFor(t, 10*time.Second, "the dead replica to show as unavailable", func() (bool, string) {
		e.get("/")
		v := getPartitionsView(t)
		one := v.Handlers[0].Schemes[0]
		r := one.Partitions[0].Replicas[0]
		return r.Dial == deadAddr && r.Health == "unavailable" && r.Tried && r.Fails >= 1 && one.Capacity == 0 &&
			one.Partitions[0].Usable == 0 && v.Handlers[0].Capacity == 1, fmt.Sprintf("%+v", v.Handlers[0])
	})

	e.load("\trespond ok")
	if v := getPartitionsView(t); len(v.Handlers) != 0 {
		t.Errorf("after unloading: %+v; want no handlers", v)
	}
}
