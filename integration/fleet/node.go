package fleet

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/caddy-lbx/lbx/lbxtest"
)

// Settings are the rebalance settings every node of a fleet runs with.
type Settings struct {
	Interval, History, Freshness string  // Caddy durations
	Threshold                    float64 // percent
	ShedRate                     float64 // percent
	MinConnections               int
	// JoinSettle is join_settle ("off", a Caddy duration, or empty for
	// the default).
	JoinSettle string
	// Backend, when set, is a host:port the site proxies every request
	// to (reverse_proxy), instead of answering "ok" itself: a Backend
	// that counts request ids, for the no-retry runs.
	Backend string
	// ShutdownDelay, when set, is Caddy's shutdown_delay (a Caddy
	// duration): on SIGTERM a node serves on this long, every response
	// saying Connection: close (rebalance_close), so that its kept-alive
	// clients leave before it closes their idle connections.
	ShutdownDelay string
}

// NodeSpec is one node's configuration.
type NodeSpec struct {
	Name string
	// Join is the gossip address of a member to join; empty for the
	// first node.
	Join string
	// Key is the base64 gossip key, passed in the environment as
	// LBX_GOSSIP_KEY and read by the Caddyfile's {env.LBX_GOSSIP_KEY}.
	Key string
	// Keys, when not empty, are the gossip keys, primary first, written
	// into the Caddyfile's encrypt_key instead of {env.LBX_GOSSIP_KEY}:
	// a reload can change them, not the process's environment.
	Keys []string
	// Tags are extra serf tags.
	Tags map[string]string
	// NoHandoff leaves out the lbx_handoff listener wrapper every node
	// runs with otherwise (to measure what it saves).
	NoHandoff bool
	Settings
}

// Node is one running Caddy node: its admin, HTTP and gossip addresses.
type Node struct {
	Name              string
	Admin, HTTP, Serf string
	Spec              NodeSpec
	Proc              *Proc
}

// FreePort returns a TCP port that was free on 127.0.0.1 a moment ago.
func FreePort() (int, error) {
	ports, err := FreePorts(1)
	if err != nil {
		return 0, err
	}
	return ports[0], nil
}

// FreePorts returns n distinct TCP ports that were free on 127.0.0.1 a
// moment ago. It holds each until it has them all: a port released at
// once may be handed out again by the next call (a bench run once gave
// a node's admin API and its gossip the same port).
func FreePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Caddyfile returns the node's configuration: the cluster and rebalance
// global options, lbx_handoff (unless spec.NoHandoff), and one site, with
// rebalance_close, that answers "ok" (or proxies to spec.Backend).
func (n *Node) Caddyfile(spec NodeSpec) string {
	servers := "\n\tservers {\n\t\tlistener_wrappers {\n\t\t\tlbx_handoff\n\t\t}\n\t}"
	if spec.NoHandoff {
		servers = ""
	}
	var opts []string
	if spec.Join != "" {
		opts = append(opts, "join "+spec.Join)
	}
	switch {
	case len(spec.Keys) > 0:
		opts = append(opts, "encrypt_key "+strings.Join(spec.Keys, " "))
	case spec.Key != "":
		opts = append(opts, "encrypt_key {env.LBX_GOSSIP_KEY}")
	}
	if len(spec.Tags) > 0 {
		keys := make([]string, 0, len(spec.Tags))
		for k := range spec.Tags {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		tags := "tags {\n"
		for _, k := range keys {
			tags += fmt.Sprintf("\t\t\t%s %s\n", k, spec.Tags[k])
		}
		opts = append(opts, tags+"\t\t}")
	}
	s := spec.Settings
	if s.ShutdownDelay != "" {
		servers += "\n\tshutdown_delay " + s.ShutdownDelay
	}
	handler := `respond "ok"`
	if s.Backend != "" {
		handler = "reverse_proxy " + s.Backend
	}
	joinSettle := ""
	if s.JoinSettle != "" {
		joinSettle = "\n\t\tjoin_settle " + s.JoinSettle
	}
	return fmt.Sprintf(`{
	admin %s
	persist_config off
	auto_https off
	default_bind 127.0.0.1
	log {
		exclude admin.api
	}%s
	cluster {
		node_name %s
		bind %s
		%s
	}
	rebalance {
		interval %s
		history %s
		freshness %s
		threshold %g%%
		shed_rate %g%%
		min_connections %d%s
	}
}

http://%s {
	rebalance_close
	%s
}
`, n.Admin, servers, spec.Name, n.Serf, strings.Join(opts, "\n\t\t"), s.Interval, s.History, s.Freshness,
		s.Threshold, s.ShedRate, s.MinConnections, joinSettle, n.HTTP, handler)
}

// StartNode starts a node on free loopback ports, its files in dir, and
// waits up to 20 s for its admin API to answer.
func StartNode(bin, dir string, spec NodeSpec) (*Node, error) {
	n := &Node{Name: spec.Name, Spec: spec}
	ports, err := FreePorts(3)
	if err != nil {
		return nil, err
	}
	n.Admin = fmt.Sprintf("127.0.0.1:%d", ports[0])
	n.HTTP = fmt.Sprintf("127.0.0.1:%d", ports[1])
	n.Serf = fmt.Sprintf("127.0.0.1:%d", ports[2])
	if err := n.start(bin, dir); err != nil {
		return nil, err
	}
	return n, nil
}

// start runs the node's process from its spec on its ports, its files in
// dir, and waits up to 20 s for its admin API to answer.
func (n *Node) start(bin, dir string) error {
	var env []string
	if n.Spec.Key != "" {
		env = append(env, "LBX_GOSSIP_KEY="+n.Spec.Key)
	}
	proc, err := StartProc(bin, dir, n.Caddyfile(n.Spec), env...)
	if err != nil {
		return err
	}
	n.Proc = proc
	deadline := time.Now().Add(20 * time.Second)
	for {
		if proc.Exited() {
			return fmt.Errorf("%s exited: %v\n%s", n.Name, proc.WaitErr(), proc.Log())
		}
		_, err := n.View()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			_ = proc.Kill()
			return fmt.Errorf("%s's admin API did not answer within 20s: %v\n%s", n.Name, err, proc.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// View is the part of a node's GET /lbx/rebalance this package reads.
type View struct {
	Name      string `json:"node_name"`
	JoinError string `json:"join_error"`
	Members   []struct {
		Name    string            `json:"name"`
		Status  string            `json:"status"`
		Counted bool              `json:"counted"`
		Tags    map[string]string `json:"tags"`
	} `json:"members"`
	Decision struct {
		At       time.Time `json:"at"`
		Counted  int       `json:"members_counted"`
		Shedding bool      `json:"shedding"`
		Lifting  bool      `json:"lifting"`
		Average  float64   `json:"average"`
		Reason   string    `json:"reason"`
	} `json:"last_decision"`
	Connections struct {
		New, Active, Idle, Hijacked, Closing int
	} `json:"connections"`
	ShedTotal struct {
		Idle, Active, Hijacked int
	} `json:"shed_total"`
}

// Held returns the connections the node holds, those shed and closing
// excluded.
func (v View) Held() int {
	c := v.Connections
	return c.New + c.Active + c.Idle + c.Hijacked - c.Closing
}

// Shed returns the connections the node has shed since it started.
func (v View) Shed() int { return v.ShedTotal.Idle + v.ShedTotal.Active + v.ShedTotal.Hijacked }

// Member returns the member named name in the view.
func (v View) Member(name string) (status string, counted bool, tags map[string]string, ok bool) {
	for _, m := range v.Members {
		if m.Name == name {
			return m.Status, m.Counted, m.Tags, true
		}
	}
	return "", false, nil, false
}

// Alive counts the members the node sees alive.
func (v View) Alive() int {
	c := 0
	for _, m := range v.Members {
		if m.Status == "alive" {
			c++
		}
	}
	return c
}

// adminClient's timeout covers the slowest admin call: a keyring change
// waits for serf's query to time out when a member does not answer.
var adminClient = &http.Client{Timeout: 15 * time.Second}

// View reads the node's GET /lbx/rebalance.
func (n *Node) View() (View, error) {
	var body struct {
		Nodes []View `json:"nodes"`
	}
	if err := n.AdminDo(http.MethodGet, "/lbx/rebalance", "", nil, &body); err != nil {
		return View{}, err
	}
	if len(body.Nodes) != 1 {
		return View{}, fmt.Errorf("%s: %d rebalance nodes in the admin view; want 1", n.Name, len(body.Nodes))
	}
	return body.Nodes[0], nil
}

// Reload loads spec through the node's admin API (POST /load with a
// Caddyfile): a real config reload of the running process.
func (n *Node) Reload(spec NodeSpec) error {
	if err := n.Load(n.Caddyfile(spec)); err != nil {
		return err
	}
	n.Spec = spec
	return nil
}

// Load posts caddyfile to the node's admin API (/load), a reload, and
// returns once Caddy has answered: the new config runs and the old one
// has stopped.
func (n *Node) Load(caddyfile string) error {
	status, body, err := lbxtest.PostLoad(adminClient, "http://"+n.Admin, "text/caddyfile", []byte(caddyfile))
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return &AdminError{Node: n.Name, Method: http.MethodPost, Path: "/load", Status: status, Body: body}
	}
	return nil
}

// AdminError is an admin API answer other than 200 OK.
type AdminError struct {
	Node, Method, Path string
	Status             int
	Body               []byte
}

// Error implements error.
func (e *AdminError) Error() string {
	return fmt.Sprintf("%s %s %s: status %d: %s", e.Node, e.Method, e.Path, e.Status, e.Body)
}

// AdminDo sends one request to the node's admin API, with body of type
// ctype (none when ctype is empty), and decodes a JSON answer into out
// when out is not nil. An answer other than 200 is an *AdminError.
func (n *Node) AdminDo(method, path, ctype string, body io.Reader, out any) error {
	req, err := http.NewRequest(method, "http://"+n.Admin+path, body)
	if err != nil {
		return err
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	// A POST is never retried by net/http, so it never goes out on a
	// kept-alive connection that a reload's new admin server may be
	// closing (see lbxtest.PostLoad).
	req.Close = method != http.MethodGet
	res, err := adminClient.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	data, err := io.ReadAll(res.Body)
	if err != nil {
		return err
	}
	if res.StatusCode != http.StatusOK {
		return &AdminError{Node: n.Name, Method: method, Path: path, Status: res.StatusCode, Body: data}
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("%s %s: decoding %s: %v", n.Name, path, data, err)
	}
	return nil
}
