package partition

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/liveset"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the partition handlers' upstreams on Caddy's admin
// endpoint:
//
//	GET /lbx/partitions
//
// returns the process-wide merge memory bound (max_merge_memory: the
// limit, what the fan-outs in flight reserve, how many wait) and every
// partition handler of the running configs with where its
// upstreams come from (static, naming file, serf members) and, for each
// of its schemes, the capacity and each partition's replicas with their
// health: usable, ejected by lbx's outlier detection, or unavailable to
// Caddy (passive health checks, max_requests).
//
// The view stays bounded however long the upstream list is: each
// partition lists at most 8 replicas (?replicas=N asks for up to
// maxViewReplicas), those not usable first, with its totals (total,
// usable, ejected) and how many it left out (replicas_omitted).
type adminAPI struct{}

const (
	// defaultViewReplicas is how many replicas of each partition the
	// view lists when the request does not say.
	defaultViewReplicas = 8
	// maxViewReplicas is the most replicas of each partition ?replicas=
	// may ask for.
	maxViewReplicas = 1000
)

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx_partitions",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/lbx/partitions",
		Handler: caddy.AdminHandlerFunc(servePartitions),
	}}
}

// servePartitions answers GET /lbx/partitions[?replicas=N].
func servePartitions(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	n := defaultViewReplicas
	if q := r.URL.Query().Get("replicas"); q != "" {
		v, err := strconv.Atoi(q)
		if err != nil || v < 0 || v > maxViewReplicas {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest,
				Err: fmt.Errorf("replicas=%q: want a number of replicas per partition from 0 to %d", q, maxViewReplicas)}
		}
		n = v
	}
	return adminjson.Write(w, http.StatusOK, buildPartitionsView(n))
}

// live holds the provisioned handlers, for the admin view: Provision adds
// a handler once it has succeeded, Cleanup removes it.
var live liveset.Set[*Handler]

// partitionsView is the body of GET /lbx/partitions.
type partitionsView struct {
	Handlers []handlerView `json:"handlers"`
	// MergeMemory is the process-wide bound on merge memory
	// (max_merge_memory), which all partition handlers share.
	MergeMemory mergeMemoryView `json:"merge_memory"`
}

// handlerView is one partition handler in the admin view.
type handlerView struct {
	// Static is the number of upstreams given in the config; Naming and
	// Serf the number the naming file and the serf members give now.
	Static     int    `json:"static_upstreams"`
	NamingFile string `json:"naming_file,omitempty"`
	Naming     int    `json:"naming_file_upstreams"`
	SerfTag    string `json:"serf_tag,omitempty"`
	Serf       int    `json:"serf_upstreams"`
	// Capacity is the handler's usable capacity (the sum over schemes of
	// their least usable replica count), CapacityTotal the same with
	// every replica counted.
	Capacity      int          `json:"capacity"`
	CapacityTotal int          `json:"capacity_total"`
	Schemes       []schemeView `json:"schemes"`
}

// schemeView is one partition scheme in the admin view.
type schemeView struct {
	Count int `json:"partitions"`
	// Capacity is the least number of usable replicas over the scheme's
	// partitions: 0 means the scheme gets no traffic.
	Capacity   int             `json:"capacity"`
	Size       int             `json:"size"`
	Partitions []partitionView `json:"partition_list"`
}

// partitionView is one partition of a scheme in the admin view.
type partitionView struct {
	Name   string `json:"name"` // "p<index>", as in X-Partition-Status
	Tag    string `json:"tag"`
	Usable int    `json:"usable"`
	// Total is the partition's number of replicas and Ejected how many
	// of them lbx's outlier detection has ejected; Replicas lists at
	// most the number asked for (8 by default), those not usable first,
	// and Omitted counts the others.
	Total    int           `json:"total"`
	Ejected  int           `json:"ejected"`
	Omitted  int           `json:"replicas_omitted"`
	Replicas []replicaView `json:"replicas"`
}

// replicaView is one replica of a partition in the admin view.
type replicaView struct {
	Dial string `json:"dial"`
	// Health is "usable", "ejected" (by lbx's outlier detection) or
	// "unavailable" (Caddy would not send it a request: passive health
	// checks, max_requests).
	Health string `json:"health"`
	// Tried is false until a sub-request went to the replica; InFlight
	// and Fails are Caddy's counts for its address (0 until tried).
	Tried    bool `json:"tried"`
	InFlight int  `json:"in_flight"`
	Fails    int  `json:"passive_fails"`
}

// buildPartitionsView assembles the admin view of every provisioned
// partition handler, listing at most listed replicas per partition.
func buildPartitionsView(listed int) partitionsView {
	hs := live.All()
	now := monoclock.Now()
	v := partitionsView{Handlers: []handlerView{}, MergeMemory: mergeMemory.view()}
	for _, h := range hs {
		v.Handlers = append(v.Handlers, h.view(now, listed))
	}
	return v
}

// view returns the handler's admin view at now (a monoclock reading),
// listing at most listed replicas per partition.
func (h *Handler) view(now int64, listed int) handlerView {
	h.swapMu.Lock()
	hv := handlerView{
		Static: len(h.static), NamingFile: h.NamingFile, Naming: len(h.fileEntries),
		Serf: len(h.serfEntries), Schemes: []schemeView{},
	}
	h.swapMu.Unlock()
	if h.Serf != nil {
		hv.SerfTag = h.Serf.partitionTag()
	}
	l := h.current.Load()
	if l == nil {
		return hv
	}
	hv.Capacity, hv.CapacityTotal = l.capacity(now)
	for _, s := range l.schemes {
		sv := schemeView{Count: s.count, Capacity: s.capacity(now), Size: s.size(), Partitions: []partitionView{}}
		for i, reps := range s.parts {
			sv.Partitions = append(sv.Partitions, partitionViewOf(i, s.count, reps, now, listed))
		}
		hv.Schemes = append(hv.Schemes, sv)
	}
	return hv
}

// partitionViewOf returns the view of partition i of a scheme of count
// partitions. It counts every replica (O(replicas), for the admin API
// only) but lists at most listed: all of them, in order, when they fit;
// otherwise those not usable first, since they are what an operator looks
// for.
func partitionViewOf(i, count int, reps []*replica, now int64, listed int) partitionView {
	pv := partitionView{Name: "p" + strconv.Itoa(i), Tag: Tag{Index: i, Count: count}.String(),
		Total: len(reps), Replicas: []replicaView{}}
	for _, r := range reps {
		switch {
		case r.usable(now):
			pv.Usable++
		case r.ejected(now):
			pv.Ejected++
		}
	}
	if len(reps) <= listed {
		for _, r := range reps {
			pv.Replicas = append(pv.Replicas, r.view(now))
		}
		return pv
	}
	for _, wantUsable := range []bool{false, true} {
		for _, r := range reps {
			if len(pv.Replicas) == listed {
				break
			}
			if r.usable(now) == wantUsable {
				pv.Replicas = append(pv.Replicas, r.view(now))
			}
		}
	}
	pv.Omitted = len(reps) - len(pv.Replicas)
	return pv
}

// view returns the replica's admin view at now, by the rule usable
// applies.
func (r *replica) view(now int64) replicaView {
	v := replicaView{Dial: r.dial, Health: "usable"}
	u := r.last.Load()
	if u != nil && u.Host != nil {
		v.Tried, v.InFlight, v.Fails = true, u.NumRequests(), u.Fails()
	}
	switch {
	case r.ejected(now):
		v.Health = "ejected"
	case !r.usable(now):
		v.Health = "unavailable"
	}
	return v
}

// Interface guards
var _ caddy.AdminRouter = adminAPI{}
