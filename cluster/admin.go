package cluster

import (
	"fmt"
	"sort"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/adminjson"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the cluster membership as this node sees it on Caddy's
// admin endpoint:
//
//	GET /lbx/cluster
//
// returns, for each serf member of the process (normally one), its name,
// address, whether gossip is encrypted, the last join error, a name
// conflict if serf shut it down over one, and every member serf knows
// with its status and tags.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx_cluster",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/lbx/cluster",
		Handler: adminjson.Handler(buildClusterView),
	}}
}

// nodeView is one serf member of this process in the admin view.
type nodeView struct {
	Name      string `json:"node_name"`
	Bind      string `json:"bind"`
	Addr      string `json:"advertised"`
	Encrypted bool   `json:"encrypted"`
	Joined    bool   `json:"joined"`
	JoinError string `json:"join_error,omitempty"`
	// NameConflict is set when serf shut the member down because another
	// member uses its node_name: the node no longer gossips or sees the
	// cluster, and Members is empty.
	NameConflict string       `json:"name_conflict,omitempty"`
	Members      []memberView `json:"members"`
}

// memberView is one cluster member in the admin view.
type memberView struct {
	Name   string            `json:"name"`
	Addr   string            `json:"addr"`
	Status string            `json:"status"`
	Self   bool              `json:"self,omitempty"`
	Tags   map[string]string `json:"tags,omitempty"`
}

// clusterView is the body of GET /lbx/cluster.
type clusterView struct {
	Nodes []nodeView `json:"nodes"`
}

// buildClusterView assembles the admin view of every serf member in the
// process.
func buildClusterView() clusterView {
	view := clusterView{Nodes: []nodeView{}}
	members.Range(func(_, v any) bool {
		view.Nodes = append(view.Nodes, v.(*member).view())
		return true
	})
	sort.Slice(view.Nodes, func(i, j int) bool { return view.Nodes[i].Bind < view.Nodes[j].Bind })
	return view
}

// view returns the member's admin view.
func (m *member) view() nodeView {
	st := m.status()
	v := nodeView{
		Name: st.Name, Bind: m.key, Addr: st.Addr, Encrypted: st.Encrypted, Joined: st.Joined,
		JoinError: st.JoinError, NameConflict: st.Conflict, Members: []memberView{},
	}
	if st.Conflict != "" {
		// serf's member list is frozen at the shutdown: not the cluster.
		return v
	}
	for _, mem := range m.list() {
		v.Members = append(v.Members, memberView{
			Name: mem.Name, Addr: fmt.Sprintf("%s:%d", mem.Addr, mem.Port), Status: mem.Status.String(),
			Self: mem.Self, Tags: mem.Tags,
		})
	}
	return v
}

// Interface guard
var _ caddy.AdminRouter = (*adminAPI)(nil)
