package partition

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// TestSerfEntries: members to tagged upstreams.
func TestSerfEntries(t *testing.T) {
	ip := net.ParseIP("10.0.0.1")
	ip2 := net.ParseIP("10.0.0.2")
	members := []cluster.Member{
		{Name: "a", Addr: ip, Status: cluster.StatusAlive, Tags: map[string]string{"partition": "1/3, 0/3,0/4", "http_port": "8001", "role": "search"}},
		{Name: "b", Addr: ip2, Status: cluster.StatusAlive, Tags: map[string]string{"partition": "2/3", "role": "search"}},
		{Name: "bad", Addr: ip2, Status: cluster.StatusAlive, Tags: map[string]string{"partition": "0/3,3/3", "role": "search"}},
		{Name: "left", Addr: ip2, Status: cluster.StatusLeft, Tags: map[string]string{"partition": "0/3", "role": "search"}},
		{Name: "web", Addr: ip2, Status: cluster.StatusAlive, Tags: map[string]string{"partition": "0/3", "role": "web"}},
		{Name: "notpart", Addr: ip2, Status: cluster.StatusAlive, Tags: map[string]string{"role": "search"}},
		{Name: "badport", Addr: ip2, Status: cluster.StatusAlive, Tags: map[string]string{"partition": "0/3", "http_port": "x", "role": "search"}},
	}
	cfg := &SerfNaming{Selector: cluster.Selector{Port: "9000", PortTag: "http_port", Tags: map[string]string{"role": "search"}}}
	got, problems := SerfEntries(members, cfg)
	var gs []string
	for _, e := range got {
		gs = append(gs, e.Dial+" "+e.Tag.String())
	}
	want := "10.0.0.1:8001 0/3,10.0.0.1:8001 1/3,10.0.0.1:8001 0/4,10.0.0.2:9000 2/3"
	if strings.Join(gs, ",") != want {
		t.Errorf("entries %v\nwant %s", gs, want)
	}
	if len(problems) != 2 || !strings.Contains(problems[0], `member bad: tag partition="0/3,3/3": invalid partition tag "3/3"`) ||
		!strings.Contains(problems[1], `member badport: tag http_port: port "x"`) {
		t.Errorf("problems %q", problems)
	}
	// Another tag key and no port fallback.
	members[1].Tags = map[string]string{"shard": "0/1", "http_port": "7"}
	got, problems = SerfEntries(members[1:2], &SerfNaming{PartitionTag: "shard", Selector: cluster.Selector{PortTag: "http_port"}})
	if len(got) != 1 || got[0].Dial != "10.0.0.2:7" || got[0].Tag != (Tag{0, 1}) || len(problems) != 0 {
		t.Errorf("shard tag: %v %v", got, problems)
	}
}

// TestSerfTagCaddyfileErrors covers every error of serf_tag.
func TestSerfTagCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"partition {\n serf_tag\n}", "serf_tag: give a port or a port_tag"},
		{"partition {\n serf_tag a b\n}", "serf_tag: at most one argument"},
		{"partition {\n serf_tag {\n  port\n }\n}", "serf_tag: port: missing value"},
		{"partition {\n serf_tag {\n  port 0\n }\n}", `serf_tag: port "0"`},
		{"partition {\n serf_tag {\n  port 1\n  port 2\n }\n}", "serf_tag: port specified more than once"},
		{"partition {\n serf_tag {\n  port_tag a b\n }\n}", `serf_tag: port_tag: one value expected, got another: "b"`},
		{"partition {\n serf_tag {\n  port 1\n  tag role\n }\n}", "serf_tag: tag: want <key> <value>"},
		{"partition {\n serf_tag {\n  port 1\n  tag role a\n  tag role b\n }\n}", `serf_tag: tag "role" specified more than once`},
		{"partition {\n serf_tag {\n  bogus\n }\n}", `serf_tag: unknown option "bogus"`},
		{"partition {\n serf_tag {\n  port 1\n }\n serf_tag {\n  port 2\n }\n}", "serf_tag specified more than once"},
	} {
		err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v; want one containing %q", tc.in, err, tc.want)
		}
	}
}

func portOf(b *backend) string {
	_, p, _ := net.SplitHostPort(b.addr)
	return p
}

// TestSerfNamingFollowsMembers: a real Caddy with the cluster app joined
// to real serf members on loopback, each fronting a real backend, and a
// partition handler whose upstreams come from the members' partition
// tags. Under continuous load: a 2-partition scheme serves; a member
// tagged for a 3-partition scheme on all three partitions joins and takes
// about half the requests; a member of the 2-partition scheme leaves and
// the 3-partition scheme takes them all; a member with a bad tag or
// another role is never used; no request fails.
func TestSerfNamingFollowsMembers(t *testing.T) {
	e := newEnv(t)
	b0, b1, b2, bad, web := e.backend("b0"), e.backend("b1"), e.backend("b2"), e.backend("bad"), e.backend("web")
	m0 := lbxtest.SerfMember(t, "m0", map[string]string{"partition": "0/2", "http_port": portOf(b0), "role": "search"}, "")
	lbxtest.SerfMember(t, "m1", map[string]string{"partition": "1/2", "http_port": portOf(b1), "role": "search"}, lbxtest.SerfAddr(m0))
	lbxtest.SerfMember(t, "mbad", map[string]string{"partition": "0/2,2/2", "http_port": portOf(bad), "role": "search"}, lbxtest.SerfAddr(m0))
	lbxtest.SerfMember(t, "mweb", map[string]string{"partition": "0/2", "http_port": portOf(web), "role": "web"}, lbxtest.SerfAddr(m0))

	e.global = fmt.Sprintf("cluster {\n\t\tnode_name front\n\t\tbind 127.0.0.1:%d\n\t\tjoin %s\n\t}",
		freeUDPTCPPort(t), lbxtest.SerfAddr(m0))
	e.load(`	partition {
		serf_tag partition {
			port_tag http_port
			tag role search
		}
		poll_interval 100ms
		header_up X-Partition {partition.index}/{partition.count}
	}`)

	waitFor(t, 10*time.Second, "the 2-partition scheme answers", func() (bool, string) {
		r := e.get("/")
		return r.status == http.StatusOK && b0.hits.Load() > 0 && b1.hits.Load() > 0, fmt.Sprintf("%d %q", r.status, r.body)
	})

	load := e.startLoad(4)
	load.waitRequests(t, 100)

	// A 3-partition member (all three partitions on one backend) joins.
	lbxtest.SerfMember(t, "m2", map[string]string{"partition": "0/3,1/3,2/3", "http_port": portOf(b2), "role": "search"}, lbxtest.SerfAddr(m0))
	start := time.Now()
	waitFor(t, 30*time.Second, "the 3-partition member takes requests", func() (bool, string) {
		return b2.hits.Load() > 0, fmt.Sprintf("b2 hits %d", b2.hits.Load())
	})
	t.Logf("a joining member got its first sub-request after %v", time.Since(start).Round(time.Millisecond))
	h0, h2 := b0.hits.Load(), b2.hits.Load()
	load.waitRequests(t, 600)
	d0, d2 := b0.hits.Load()-h0, (b2.hits.Load()-h2)/3
	// Both schemes have capacity 1: requests split about 1:1 (b2 sees 3
	// sub-requests per request of its scheme).
	ratio := float64(d0) / float64(d0+d2)
	t.Logf("2-scheme requests %d, 3-scheme requests %d (share of the 2-scheme %.2f)", d0, d2, ratio)
	if ratio < 0.35 || ratio > 0.65 {
		t.Errorf("2-scheme share %.2f; want about 0.5", ratio)
	}

	// m0 leaves: partition 0 of the 2-scheme has no replica, so the
	// 3-partition scheme takes everything.
	start = time.Now()
	if err := m0.Leave(); err != nil {
		t.Fatal(err)
	}
	left := time.Now()
	m0.Shutdown()
	var h1 int64
	waitFor(t, 10*time.Second, "no request for the 2-partition scheme", func() (bool, string) {
		n := b1.hits.Load()
		if n != h1 {
			h1 = n
			time.Sleep(200 * time.Millisecond) // quiet for a while
			return b1.hits.Load() == h1, fmt.Sprintf("b1 hits %d", n)
		}
		return false, fmt.Sprintf("b1 hits %d", n)
	})
	t.Logf("after m0's Leave (which took %v) the 2-partition scheme got no more requests within %v",
		left.Sub(start).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	load.waitRequests(t, 100)
	load.halt()
	if f := load.failures(); len(f) > 0 {
		t.Errorf("%d failed requests (of %d); first: %s", len(f), load.ok.Load()+int64(len(f)), f[0])
	}
	t.Logf("%d requests, %d failed", load.ok.Load(), len(load.failures()))
	if bad.hits.Load() != 0 || web.hits.Load() != 0 {
		t.Errorf("the member with a bad tag got %d requests, the role=web one %d", bad.hits.Load(), web.hits.Load())
	}
}

// TestSerfNamingNeedsClusterApp: serf_tag without the cluster app
// does not load, and says why.
func TestSerfNamingNeedsClusterApp(t *testing.T) {
	e := newEnv(t)
	err := e.loadErr("\tpartition {\n\t\tserf_tag {\n\t\t\tport 80\n\t\t}\n\t}")
	if err == nil || !strings.Contains(err.Error(), "no cluster app in this config") {
		t.Fatalf("error %v; want one saying the cluster app is missing", err)
	}
}

// freeUDPTCPPort returns a port free for TCP and UDP on 127.0.0.1 just now.
func freeUDPTCPPort(t *testing.T) int {
	t.Helper()
	for range 20 {
		port := freePort(t)
		pc, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			pc.Close()
			return port
		}
	}
	t.Fatal("no free port")
	return 0
}
