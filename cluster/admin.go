package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"sort"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/drain"
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
//
// It also manages the gossip keyring across the cluster, through serf's
// key queries (like `consul keyring`):
//
//	GET  /lbx/cluster/keys          the keys the nodes have
//	POST /lbx/cluster/keys/install  {"key": "<base64>"}: every node adds it
//	POST /lbx/cluster/keys/use      {"key": "<base64>"}: every node's primary
//	POST /lbx/cluster/keys/remove   {"key": "<base64>"}: every node drops it
//
// Each answers a keyringReport: the nodes asked, their answers and
// errors by node, and for the list each key's fingerprint with how many
// nodes have it and use it as primary; never a key. Bodies are sent as
// application/json. Install, use and remove take a cluster-wide lease
// first: one at a time, the others refused with 409 (keylock.go).
// `?local=1` lists, installs or uses a key on this node alone: the heal of
// a node that can no longer decrypt its peers (the view's
// decrypt_failures). Add `?bind=<host:port>`
// when the process runs more than one member (see the view's bind).
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
	routes := []caddy.AdminRoute{{
		Pattern: "/lbx/cluster",
		Handler: adminjson.Handler(buildClusterView),
	}}
	for op := range keyringOps {
		routes = append(routes, caddy.AdminRoute{Pattern: keyringPath(op), Handler: keyringHandler(op)})
	}
	return routes
}

// keyringPath is the admin path of a keyring operation.
func keyringPath(op keyringOp) string {
	if op == opList {
		return "/lbx/cluster/keys"
	}
	return "/lbx/cluster/keys/" + op.String()
}

// maxKeyringBody bounds a keyring request's body: a key is at most 44
// bytes of base64.
const maxKeyringBody = 1 << 10

// keyringHandler serves op: GET for the list, POST with {"key": ...}
// (Content-Type application/json) for the others. A bad request is
// refused (and counted) before any query; an operation refused by its
// checks (another in progress, a step that would split the cluster)
// answers 409 (404 for the removal of a key no node has) with the
// reason; the answer is 200 when every node succeeded, else 502 with the
// report, whose error field says what failed. ?local=1 runs list,
// install or use on this node's keyring alone.
func keyringHandler(op keyringOp) caddy.AdminHandlerFunc {
	method := http.MethodPost
	if op == opList {
		method = http.MethodGet
	}
	return func(w http.ResponseWriter, r *http.Request) error {
		if r.Method != method {
			return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed; %s takes %s", r.Method, keyringPath(op), method)}
		}
		q := r.URL.Query()
		m, err := keyringMember(q.Get("bind"))
		if err != nil {
			return err
		}
		local, err := localParam(q.Get("local"))
		if err != nil {
			m.record(op, keyringReport{}, errKeyringRefused{error: err})
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
		}
		var key []byte
		if op != opList {
			status := http.StatusBadRequest
			if key, status, err = readKeyRequest(w, r); err != nil {
				m.record(op, keyringReport{}, errKeyringRefused{error: err})
				return caddy.APIError{HTTPStatus: status, Err: err}
			}
		}
		rep, err := m.keyringOp(op, key, local)
		var refused errKeyringRefused
		if errors.As(err, &refused) {
			status := refused.status
			if status == 0 {
				status = http.StatusConflict
			}
			return caddy.APIError{HTTPStatus: status, Err: refused.error}
		}
		status := http.StatusOK
		if err != nil {
			status = http.StatusBadGateway
		}
		return adminjson.Write(w, status, rep)
	}
}

// localParam reads the local query parameter: "", 0 or false (the
// cluster), 1 or true (this node alone).
func localParam(v string) (bool, error) {
	switch v {
	case "", "0", "false":
		return false, nil
	case "1", "true":
		return true, nil
	}
	return false, fmt.Errorf("local=%q: want 1 (this node's keyring alone) or 0", v)
}

// readKeyRequest reads {"key": "<base64>"}, a JSON object alone (no
// unknown field, nothing after it) sent as application/json, and
// decodes the key; its errors name the problem, never the key, with the
// HTTP status to answer.
func readKeyRequest(w http.ResponseWriter, r *http.Request) ([]byte, int, error) {
	if ct := r.Header.Get("Content-Type"); ct == "" {
		return nil, http.StatusUnsupportedMediaType, errors.New(`request body: no Content-Type; send the body {"key": "<base64 key>"} with Content-Type: application/json`)
	} else if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
		return nil, http.StatusUnsupportedMediaType, fmt.Errorf(`request body: Content-Type %.64q; send the body {"key": "<base64 key>"} with Content-Type: application/json`, ct)
	}
	var body struct {
		Key string `json:"key"`
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxKeyringBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&body); err != nil {
		return nil, http.StatusBadRequest, fmt.Errorf(`request body: want {"key": "<base64 key>"}: %v`, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, http.StatusBadRequest, errors.New(`request body: data after the JSON object; want {"key": "<base64 key>"} alone`)
	}
	if body.Key == "" {
		return nil, http.StatusBadRequest, errors.New(`request body: key is missing or empty; want {"key": "<base64 key>"}`)
	}
	key, err := parseKey(body.Key)
	if err != nil {
		return nil, http.StatusBadRequest, fmt.Errorf("key: %v", err)
	}
	return key, 0, nil
}

// keyringMember returns the running serf member a keyring request is
// for: the process's only one, or the one bound to bind.
func keyringMember(bind string) (*member, error) {
	var running []*member
	var binds []string
	members.Range(func(_, v any) bool {
		if m := v.(*member); m.running() {
			running = append(running, m)
			binds = append(binds, m.key)
		}
		return true
	})
	sort.Strings(binds)
	if bind != "" {
		for _, m := range running {
			if m.key == bind {
				return m, nil
			}
		}
		return nil, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("bind %q: no running serf member binds it; running: %v", bind, binds)}
	}
	switch len(running) {
	case 0:
		return nil, caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: ErrNotRunning}
	case 1:
		return running[0], nil
	}
	return nil, caddy.APIError{HTTPStatus: http.StatusConflict, Err: fmt.Errorf("%d serf members run in this process (binds %v); choose one with ?bind=<host:port>", len(running), binds)}
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
	NameConflict string `json:"name_conflict,omitempty"`
	// DecryptFailures counts the gossip messages this node could not
	// decrypt, by remote address, with how to heal it; absent when none.
	DecryptFailures *decryptView `json:"decrypt_failures,omitempty"`
	// DrainsPropagated is true when a config with an ops_key carries
	// this process's drains to the members (see GET /lbx/drains).
	DrainsPropagated bool `json:"drains_propagated"`
	// DrainEntriesRefused counts drain entries from members that were
	// refused: a bad signature (another or no ops_key), out of bounds, or
	// no room.
	DrainEntriesRefused uint64       `json:"drain_entries_refused"`
	Members             []memberView `json:"members"`
}

// memberView is one cluster member in the admin view.
type memberView struct {
	Name   string            `json:"name"`
	Addr   string            `json:"addr"`
	Status string            `json:"status"`
	Self   bool              `json:"self,omitempty"`
	Tags   map[string]string `json:"tags,omitempty"`
	// Refused lists this member's dial addresses the dial policy refused
	// within the last minute, with the reason.
	Refused []refusedView `json:"refused,omitempty"`
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
		DecryptFailures:  m.decrypt.view(decryptHeal),
		DrainsPropagated: drain.Shared().Propagated(), DrainEntriesRefused: drain.Shared().Dropped(),
	}
	if st.Conflict != "" {
		// serf's member list is frozen at the shutdown: not the cluster.
		return v
	}
	refused := m.refused.byMember(time.Now())
	for _, mem := range m.list() {
		v.Members = append(v.Members, memberView{
			Name: shownName(mem.Name), Addr: fmt.Sprintf("%s:%d", mem.Addr, mem.Port), Status: mem.Status.String(),
			Self: mem.Self, Tags: mem.Tags, Refused: refused[mem.Name],
		})
	}
	return v
}

// Interface guard
var _ caddy.AdminRouter = (*adminAPI)(nil)
