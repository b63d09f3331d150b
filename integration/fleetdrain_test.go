package integration

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// drainNode is one Caddy process of TestFleetDrain.
type drainNode struct {
	name, admin, http, serf string
	proc                    *fleet.Proc
}

// TestFleetDrain: three real Caddy nodes with one ops key, each proxying
// to the same three backends with least_time, under load from clients
// that never retry. A drain made on one node stops every node sending new
// requests to the backend within two push intervals, with no failed
// request; a node that joins afterwards drains it too; an undrain on
// another node brings it back everywhere, on a slow-start ramp.
func TestFleetDrain(t *testing.T) {
	bin := drainBuildCaddy(t)
	var hits [3]atomic.Int64
	backends := make([]string, 3)
	for i := range backends {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits[i].Add(1)
			_, _ = io.Copy(io.Discard, r.Body)
			time.Sleep(2 * time.Millisecond)
			_, _ = io.WriteString(w, "ok")
		}))
		t.Cleanup(srv.Close)
		backends[i] = strings.TrimPrefix(srv.URL, "http://")
	}
	gossipKey, opsKey := fleet.NewKey(), fleet.NewKey()
	start := func(name, join string) *drainNode {
		t.Helper()
		ports, err := fleet.FreePorts(3)
		if err != nil {
			t.Fatal(err)
		}
		n := &drainNode{name: name, admin: fmt.Sprintf("127.0.0.1:%d", ports[0]),
			http: fmt.Sprintf("127.0.0.1:%d", ports[1]), serf: fmt.Sprintf("127.0.0.1:%d", ports[2])}
		joinLine := ""
		if join != "" {
			joinLine = "\n\t\tjoin " + join
		}
		cfg := fmt.Sprintf(`{
	admin %s
	persist_config off
	auto_https off
	default_bind 127.0.0.1
	cluster {
		node_name %s
		bind %s%s
		encrypt_key {env.LBX_GOSSIP_KEY}
		ops_key {env.LBX_OPS_KEY}
	}
}

http://%s {
	reverse_proxy %s {
		lb_policy least_time {
			slow_start 5s
		}
	}
}
`, n.admin, name, n.serf, joinLine, n.http, strings.Join(backends, " "))
		p, err := fleet.StartProc(bin, t.TempDir(), cfg, "LBX_GOSSIP_KEY="+gossipKey, "LBX_OPS_KEY="+opsKey)
		if err != nil {
			t.Fatal(err)
		}
		n.proc = p
		t.Cleanup(func() {
			_ = p.Kill()
			if t.Failed() {
				t.Logf("%s's log:\n%s", name, p.Log())
			}
		})
		lbxtest.WaitFor(t, 20*time.Second, name+"'s admin API answers", func() (bool, string) {
			var v map[string]any
			err := getJSON("http://"+n.admin+"/lbx/drains", &v)
			return err == nil, fmt.Sprint(err)
		})
		return n
	}
	alive := func(n *drainNode, want int) {
		t.Helper()
		lbxtest.WaitFor(t, 20*time.Second, fmt.Sprintf("%s sees %d members alive", n.name, want), func() (bool, string) {
			var v struct {
				Nodes []struct {
					Members []struct{ Status string }
				}
			}
			if err := getJSON("http://"+n.admin+"/lbx/cluster", &v); err != nil || len(v.Nodes) != 1 {
				return false, fmt.Sprint(err)
			}
			k := 0
			for _, m := range v.Nodes[0].Members {
				if m.Status == "alive" {
					k++
				}
			}
			return k == want, fmt.Sprintf("%d alive", k)
		})
	}
	drainedOn := func(n *drainNode, upstream string) (bool, string) {
		var v struct {
			Propagated bool
			Entries    []struct {
				Upstream string
				Drained  bool
			}
		}
		if err := getJSON("http://"+n.admin+"/lbx/drains", &v); err != nil {
			return false, err.Error()
		}
		for _, e := range v.Entries {
			if e.Upstream == upstream {
				return e.Drained, fmt.Sprintf("%+v", v)
			}
		}
		return false, fmt.Sprintf("%+v", v)
	}
	// rampingOn reports whether n's pool shows upstream on its slow-start
	// ramp (below its full weight).
	rampingOn := func(n *drainNode, upstream string) (bool, string) {
		var v struct {
			Pools []struct {
				Upstreams []struct {
					Dial                   string
					SlowStartWeightPercent *float64 `json:"slow_start_weight_percent"`
				}
			}
		}
		if err := getJSON("http://"+n.admin+"/lbx/upstreams", &v); err != nil {
			return false, err.Error()
		}
		for _, p := range v.Pools {
			for _, u := range p.Upstreams {
				if u.Dial == upstream && u.SlowStartWeightPercent != nil && *u.SlowStartWeightPercent < 100 {
					return true, fmt.Sprintf("%.0f%%", *u.SlowStartWeightPercent)
				}
			}
		}
		return false, fmt.Sprintf("%+v", v)
	}
	post := func(n *drainNode, path string) {
		t.Helper()
		res, err := http.Post("http://"+n.admin+path, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK || !strings.Contains(string(body), `"propagated": true`) {
			t.Fatalf("POST %s: %d %s", path, res.StatusCode, body)
		}
	}

	nodes := []*drainNode{start("fd-0", "")}
	nodes = append(nodes, start("fd-1", nodes[0].serf), start("fd-2", nodes[0].serf))
	for _, n := range nodes {
		alive(n, 3)
	}

	// Load: POSTs, which no client retries, four at a time per node.
	ctx, stop := context.WithCancel(context.Background())
	var (
		wg           sync.WaitGroup
		sent, failed atomic.Int64
		failMu       sync.Mutex
		firstFailure string
		load         = func(n *drainNode) {
			defer wg.Done()
			client := &http.Client{Timeout: 10 * time.Second}
			for ctx.Err() == nil {
				res, err := client.Post("http://"+n.http+"/", "text/plain", strings.NewReader("x"))
				sent.Add(1)
				if err == nil {
					_, _ = io.Copy(io.Discard, res.Body)
					res.Body.Close()
					if res.StatusCode == http.StatusOK {
						continue
					}
					err = fmt.Errorf("status %d", res.StatusCode)
				}
				failed.Add(1)
				failMu.Lock()
				if firstFailure == "" {
					firstFailure = n.name + ": " + err.Error()
				}
				failMu.Unlock()
			}
		}
	)
	startLoad := func(ns ...*drainNode) {
		for _, n := range ns {
			for range 4 {
				wg.Add(1)
				go load(n)
			}
		}
	}
	t.Cleanup(func() { stop(); wg.Wait() })
	startLoad(nodes...)
	lbxtest.WaitFor(t, 10*time.Second, "every backend serves", func() (bool, string) {
		return hits[0].Load() > 50 && hits[1].Load() > 50 && hits[2].Load() > 50,
			fmt.Sprint(hits[0].Load(), hits[1].Load(), hits[2].Load())
	})

	target := backends[1]
	drainAt := time.Now()
	post(nodes[0], "/lbx/drain?upstream="+url.QueryEscape(target))
	for _, n := range nodes {
		lbxtest.WaitFor(t, 2*time.Second-time.Since(drainAt), n.name+" has the drain within two intervals", func() (bool, string) {
			return drainedOn(n, target)
		})
	}
	// Requests chosen before the drain arrived finish (2 ms each): wait
	// until none has arrived for 100 ms; after that, none may arrive.
	last, lastAt := hits[1].Load(), time.Now()
	lbxtest.WaitFor(t, 5*time.Second, "the drained backend's last requests", func() (bool, string) {
		if h := hits[1].Load(); h != last {
			last, lastAt = h, time.Now()
		}
		return time.Since(lastAt) >= 100*time.Millisecond, fmt.Sprint(last)
	})
	before, sentBefore := hits[1].Load(), sent.Load()
	lbxtest.WaitFor(t, 10*time.Second, "more load after the drain", func() (bool, string) {
		return sent.Load() > sentBefore+1500, fmt.Sprint(sent.Load() - sentBefore)
	})
	if got := hits[1].Load() - before; got != 0 {
		t.Fatalf("the drained backend got %d new requests of %d after every node had the drain", got, sent.Load()-sentBefore)
	}

	// A node that joins afterwards drains it too.
	late := start("fd-late", nodes[1].serf)
	alive(late, 4)
	lbxtest.WaitFor(t, 15*time.Second, "the late node has the drain", func() (bool, string) {
		return drainedOn(late, target)
	})
	before, sentBefore = hits[1].Load(), sent.Load()
	startLoad(late)
	lbxtest.WaitFor(t, 10*time.Second, "load through the late node too", func() (bool, string) {
		return sent.Load() > sentBefore+1500, fmt.Sprint(sent.Load() - sentBefore)
	})
	if got := hits[1].Load() - before; got != 0 {
		t.Fatalf("the drained backend got %d new requests with the late node serving", got)
	}

	// An undrain from another node brings it back everywhere.
	post(nodes[2], "/lbx/undrain?upstream="+url.QueryEscape(target))
	for _, n := range append(nodes, late) {
		lbxtest.WaitFor(t, 2*time.Second, n.name+" has the undrain", func() (bool, string) {
			ok, why := drainedOn(n, target)
			return !ok, why
		})
	}
	// ... with slow start: every node's pool shows it ramping.
	for _, n := range append(nodes, late) {
		lbxtest.WaitFor(t, 2*time.Second, n.name+" ramps the undrained backend", func() (bool, string) {
			return rampingOn(n, target)
		})
	}
	before = hits[1].Load()
	lbxtest.WaitFor(t, 10*time.Second, "the undrained backend serves again", func() (bool, string) {
		return hits[1].Load() > before+100, fmt.Sprint(hits[1].Load() - before)
	})

	stop()
	wg.Wait()
	if n := failed.Load(); n != 0 {
		t.Fatalf("%d of %d requests failed; the first: %s", n, sent.Load(), firstFailure)
	}
	t.Logf("%d requests, none failed", sent.Load())
}
