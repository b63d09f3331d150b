package lbpolicy

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/drain"
)

func init() {
	caddy.RegisterModule(drainAdmin{})
}

// drainAdmin is the operator's door to drains and reweights, on Caddy's
// admin endpoint:
//
//	POST /lbx/drain?upstream=DIAL
//	POST /lbx/undrain?upstream=DIAL
//	POST /lbx/weight?upstream=DIAL&percent=1-100
//	GET  /lbx/drains
//
// A drained upstream gets no new requests from least_time,
// consistent_hash and the panic wrapper (requests in flight finish),
// unless every other usable upstream of its pool is drained too; a
// reweighted one keeps that percent of its configured weight. Undrain
// clears both. The change holds across config reloads until undone, and
// with the cluster app's ops_key it is sent to every member. Each POST
// answers the entry, and whether the change travels to the cluster.
type drainAdmin struct{}

// CaddyModule returns the Caddy module information.
func (drainAdmin) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx_drain",
		New: func() caddy.Module { return new(drainAdmin) },
	}
}

// Routes returns the admin routes.
func (drainAdmin) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/lbx/drain", Handler: drainHandler(opDrain)},
		{Pattern: "/lbx/undrain", Handler: drainHandler(opUndrain)},
		{Pattern: "/lbx/weight", Handler: drainHandler(opWeight)},
		{Pattern: "/lbx/drains", Handler: adminjson.Handler(func() drainsView { return buildDrainsView(drain.Shared()) })},
	}
}

// drainOp is one of the POST routes.
type drainOp uint8

const (
	opDrain drainOp = iota
	opUndrain
	opWeight
)

func (op drainOp) path() string {
	return [...]string{"/lbx/drain", "/lbx/undrain", "/lbx/weight"}[op]
}

// drainHandler serves op on the process's store.
func drainHandler(op drainOp) caddy.AdminHandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		return serveDrainOp(drain.Shared(), op, w, r)
	}
}

// serveDrainOp applies op to st: 405 for a method other than POST, 400
// naming the query parameter that is wrong, 507 when the store is full.
func serveDrainOp(st *drain.Store, op drainOp, w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed; %s takes POST", r.Method, op.path())}
	}
	addr, percent, err := parseDrainQuery(op, r.URL.Query())
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	e, err := st.Set(addr, op == opDrain, percent)
	if errors.Is(err, drain.ErrFull) {
		return caddy.APIError{HTTPStatus: http.StatusInsufficientStorage, Err: err}
	}
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	return adminjson.Write(w, http.StatusOK, drainChange{
		drainEntryView: entryView(e, time.Now()),
		Propagated:     st.Propagated(),
		Note:           changeNote(st.Propagated(), upstreamInUse(addr)),
	})
}

// parseDrainQuery reads upstream (and, for /lbx/weight, percent), refusing
// any other parameter and any given twice.
func parseDrainQuery(op drainOp, q url.Values) (addr string, percent int, err error) {
	percent = 100
	for name, vals := range q {
		if len(vals) != 1 {
			return "", 0, fmt.Errorf("query parameter %q given %d times; give it once", name, len(vals))
		}
		switch {
		case name == "upstream":
			addr = vals[0]
		case name == "percent" && op == opWeight:
			p, perr := strconv.Atoi(vals[0])
			if perr != nil {
				return "", 0, fmt.Errorf("percent=%q: want a whole number from 1 to 100", vals[0])
			}
			if err := drain.CheckPercent(p); err != nil {
				return "", 0, err
			}
			percent = p
		case op == opWeight:
			return "", 0, fmt.Errorf("unknown query parameter %q: want upstream and percent", name)
		default:
			return "", 0, fmt.Errorf("unknown query parameter %q: want upstream", name)
		}
	}
	if addr == "" {
		return "", 0, fmt.Errorf("%s needs upstream=<dial address>, e.g. upstream=10.0.0.1:8080", op.path())
	}
	if op == opWeight && !q.Has("percent") {
		return "", 0, errors.New("/lbx/weight needs percent=<1-100>, the percent of its configured weight the upstream keeps")
	}
	return addr, percent, drain.CheckAddr(addr)
}

// changeNote says what the operator should know of a change: that it
// stays on this node, or that no pool here uses the address.
func changeNote(propagated, inUse bool) string {
	switch {
	case !propagated && !inUse:
		return "local to this node (no cluster ops_key), and no pool of this node uses this address yet"
	case !propagated:
		return "local to this node: the cluster app has no ops_key, so other nodes are not told"
	case !inUse:
		return "no pool of this node uses this address yet; sent to the cluster's members"
	}
	return ""
}

// upstreamInUse reports whether a pool of an lbx policy on this node has
// a member at addr.
func upstreamInUse(addr string) bool {
	for _, p := range allPoolReports() {
		found := false
		p.dials(func(d string) { found = found || d == addr })
		if found {
			return true
		}
	}
	return false
}

// drainEntryView is one entry of the store in the admin API.
type drainEntryView struct {
	Upstream string `json:"upstream"`
	Drained  bool   `json:"drained"`
	// WeightPercent is the percent of its configured weight the upstream
	// keeps (100 when drained or undrained).
	WeightPercent int `json:"weight_percent"`
	// Version orders the changes of the upstream across the cluster.
	Version uint64 `json:"version"`
	// Origin is the node whose admin endpoint made the change; empty
	// outside a cluster.
	Origin string `json:"origin"`
	// FromPeer is true when another member sent the change.
	FromPeer bool `json:"from_peer"`
	// AgeMs is how long ago this node took the change, in milliseconds.
	AgeMs float64 `json:"age_ms"`
}

func entryView(e drain.Entry, now time.Time) drainEntryView {
	return drainEntryView{
		Upstream: e.Addr, Drained: e.Drained, WeightPercent: int(e.WeightPercent),
		Version: e.Version, Origin: e.Origin, FromPeer: e.Remote,
		AgeMs: float64(now.Sub(e.At)) / 1e6,
	}
}

// drainChange is the answer of a POST.
type drainChange struct {
	drainEntryView
	// Propagated is true when the cluster app carries the change to the
	// other members (it has an ops_key).
	Propagated bool `json:"propagated"`
	// Note says what the operator should know, absent when nothing.
	Note string `json:"note,omitempty"`
}

// drainsView is the body of GET /lbx/drains.
type drainsView struct {
	// Propagated is true when the cluster app carries changes to the
	// other members (it has an ops_key); else drains are this node's.
	Propagated bool `json:"propagated"`
	// Dropped counts the entries from other members refused: a bad
	// signature (another or no ops_key), out of bounds, or no room.
	Dropped uint64 `json:"dropped_total"`
	// Entries are every upstream's last change, undrains included (an
	// undrain is kept so that an older drain cannot return), sorted by
	// address.
	Entries []drainEntryView `json:"entries"`
}

func buildDrainsView(st *drain.Store) drainsView {
	now := time.Now()
	v := drainsView{Propagated: st.Propagated(), Dropped: st.Dropped(), Entries: []drainEntryView{}}
	for _, e := range st.Entries() {
		v.Entries = append(v.Entries, entryView(e, now))
	}
	return v
}

// Interface guards
var _ caddy.AdminRouter = drainAdmin{}
