package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// clusterView is the part of GET /lbx/cluster this test reads.
type clusterView struct {
	Nodes []struct {
		Name    string `json:"node_name"`
		Members []struct {
			Name   string            `json:"name"`
			Status string            `json:"status"`
			Tags   map[string]string `json:"tags"`
		} `json:"members"`
	} `json:"nodes"`
}

// TestClusterDiscoveryWithoutShedding: membership alone, with no
// rebalance app anywhere. A real cmd/caddy process joins the serf cluster
// as member api-1, tagged role=api with the port it serves on; the
// in-process Caddy, another member, proxies with `dynamic serf` upstreams
// chosen by that tag. Requests reach api-1; both members see each other
// in /lbx/cluster; no rebalance app runs and no load tag is gossiped; when
// api-1 leaves (SIGTERM: Caddy stops, the member leaves gracefully), it
// is gone from the upstreams and requests are refused, not hung.
func TestClusterDiscoveryWithoutShedding(t *testing.T) {
	e := newEnv(t)
	bin := drainBuildCaddy(t)
	apiHTTP, apiSerf, apiAdmin, frontSerf := freePort(t), freePort(t), freePort(t), freePort(t)
	api := startDrainCaddy(t, bin, fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
	auto_https off
	cluster {
		node_name api-1
		bind 127.0.0.1:%d
		tags {
			role api
			http_port %d
		}
	}
}

http://127.0.0.1:%d {
	respond "api-1"
}
`, apiAdmin, apiSerf, apiHTTP, apiHTTP))

	e.loadWith(fmt.Sprintf(`	cluster {
		node_name front
		bind 127.0.0.1:%d
		join 127.0.0.1:%d
	}
`, frontSerf, apiSerf), fmt.Sprintf(`:%d {
	reverse_proxy {
		dynamic serf {
			tag role api
			port_tag http_port
			refresh 100ms
		}
	}
}
`, httpPort))

	waitFor(t, 20*time.Second, "requests through dynamic serf reach api-1", func() (bool, string) {
		status, _, body, err := e.get("/")
		return err == nil && status == http.StatusOK && string(body) == "api-1", fmt.Sprintf("%d %q %v", status, body, err)
	})

	// Both members, alive, seen from both sides; no load tag.
	views := map[string]string{"front": "http://" + adminAddr + "/lbx/cluster", "api-1": fmt.Sprintf("http://127.0.0.1:%d/lbx/cluster", apiAdmin)}
	for who, url := range views {
		var v clusterView
		if err := getJSON(url, &v); err != nil {
			t.Fatalf("%s: %v", who, err)
		}
		if len(v.Nodes) != 1 || len(v.Nodes[0].Members) != 2 {
			t.Fatalf("%s's /lbx/cluster: %+v; want one node with two members", who, v)
		}
		for _, m := range v.Nodes[0].Members {
			if m.Status != "alive" {
				t.Errorf("%s sees %s %s", who, m.Name, m.Status)
			}
			for k := range m.Tags {
				if strings.HasPrefix(k, "lbx_") {
					t.Errorf("%s sees %s with tag %s: something published a load without a rebalance app", who, m.Name, k)
				}
			}
		}
	}
	// No shedding app in either config.
	for who, url := range map[string]string{"front": "http://" + adminAddr + "/config/apps", "api-1": fmt.Sprintf("http://127.0.0.1:%d/config/apps", apiAdmin)} {
		var apps map[string]json.RawMessage
		if err := getJSON(url, &apps); err != nil {
			t.Fatalf("%s: %v", who, err)
		}
		if _, ok := apps["rebalance"]; ok {
			t.Errorf("%s's config has a rebalance app", who)
		}
		if _, ok := apps["cluster"]; !ok {
			t.Errorf("%s's config has no cluster app", who)
		}
	}
	if r := e.drive("/", 40, 4); len(r.errors) > 0 || r.statuses[http.StatusOK] != 40 {
		t.Fatalf("40 requests: %v, errors %q", r.statuses, firstFew(r.errors))
	}

	// api-1 leaves: the list empties, and reverse_proxy answers at once
	// with no upstream instead of dialing the old address.
	if err := api.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-api.Done():
	case <-time.After(15 * time.Second):
		t.Fatal("api-1 did not stop within 15s of SIGTERM")
	}
	waitFor(t, 10*time.Second, "api-1 gone from the upstreams", func() (bool, string) {
		status, _, body, err := e.get("/")
		return err == nil && status == http.StatusServiceUnavailable, fmt.Sprintf("%d %q %v", status, body, err)
	})
}

// getJSON decodes the JSON body of GET url into out.
func getJSON(url string, out any) error {
	res, err := adminClient.Get(url)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %d %s", url, res.StatusCode, body)
	}
	return json.Unmarshal(body, out)
}
