package rebalance

import (
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/dustin/go-humanize"

	"github.com/caddy-lbx/lbx/cluster"
	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/conntrack"
	"github.com/caddy-lbx/lbx/internal/shed"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the cluster as this node sees it on Caddy's admin
// endpoint:
//
//	GET /lbx/rebalance
//
// returns, for each rebalance node in the process (normally one), the
// cluster's members with status, load and report age, whether each counts toward the
// average, this node's own load, connections by state, the bytes counted
// by the rebalance listener wrapper, the gossip average and whether the
// last decision used it, its last decision, its shed totals,
// forced closes (boundary_timeout) and how shed WebSockets closed. Fields
// ending in _human repeat numbers for people (loads in their metric's
// unit: "12 MB/s" for throughput).
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx_rebalance",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/lbx/rebalance",
		Handler: handleRebalance,
	}}
}

// memberView is one cluster member in the admin API's output.
type memberView struct {
	Name   string `json:"name"`
	Addr   string `json:"addr"`
	Status string `json:"status"`
	// Metric and Load are the member's last load report; absent when it
	// has not reported.
	Metric    string  `json:"metric,omitempty"`
	Load      float64 `json:"load"`
	LoadHuman string  `json:"load_human,omitempty"`
	// ReportAgeMs is how long ago this node saw the member's report
	// change; -1 when it has not yet.
	ReportAgeMs int64  `json:"report_age_ms"`
	ReportAge   string `json:"report_age_human"`
	// Counted says whether the member counts toward the average; Why
	// says why not.
	Counted bool              `json:"counted"`
	Why     string            `json:"excluded_because,omitempty"`
	Self    bool              `json:"self,omitempty"`
	Tags    map[string]string `json:"tags,omitempty"`
}

// decisionView is a node's last shedding decision.
type decisionView struct {
	At           time.Time `json:"at"`
	Local        float64   `json:"local"`
	LocalHuman   string    `json:"local_human"`
	Current      float64   `json:"current"`
	CurrentHuman string    `json:"current_human"`
	Held         int       `json:"connections_held"`
	Average      float64   `json:"average"`
	AverageHuman string    `json:"average_human"`
	Balance      float64   `json:"balance"`
	Counted      int       `json:"members_counted"`
	Stale        int       `json:"members_stale"`
	NotAlive     int       `json:"members_not_alive"`
	// Invalid counts members whose load tag holds no valid load (not a
	// number from 0 to 1e15).
	Invalid     int `json:"members_invalid"`
	OtherMetric int `json:"members_other_metric"`
	// Ignored counts members left out because they gained no
	// connections while lifted.
	Ignored int `json:"members_ignored"`
	// Shedding is true while the node is in a shedding phase: above the
	// stop band, or Lifting an underloaded member toward the average.
	Shedding   bool    `json:"shedding"`
	Lifting    bool    `json:"lifting"`
	Lowest     float64 `json:"lowest"`
	LowestName string  `json:"lowest_member,omitempty"`
	Shed       int     `json:"shed"`
	// Forced is the number of shed connections closed in that interval
	// because they reached no response boundary within
	// boundary_timeout.
	Forced int    `json:"forced_closes"`
	Reason string `json:"reason"`
	// AverageFrom says where the average came from: "gossip" (the gossip
	// average) or "tags" (the members' load tags; gossip_average says why).
	AverageFrom string `json:"average_from"`
}

// gossipAverageView is the gossip averaging as of a node's last decision.
type gossipAverageView struct {
	// Used is true when the decision used the gossip average; Why says
	// why not.
	Used bool   `json:"used"`
	Why  string `json:"unused_because,omitempty"`
	// Average and Size are the estimates of the cluster's average load
	// and of its number of members (0 before any exchange), and Members
	// the alive members in this node's metric serf lists, this node
	// included: what Size should be.
	Average float64 `json:"average"`
	Size    float64 `json:"size_estimate"`
	Members int     `json:"members_in_metric"`
	// Peers is the number of members this node exchanges with, Exchanges
	// the exchanges it completed within freshness, and
	// LastExchangeAgeMs how long before the decision it completed one
	// last (-1: never).
	Peers             int   `json:"peers"`
	Exchanges         int   `json:"exchanges"`
	LastExchangeAgeMs int64 `json:"last_exchange_age_ms"`
	// Lowest are the lowest-load members the averaging told this node
	// of, lowest first, with their loads and the age of what it knows.
	Lowest []lowEntryView `json:"lowest"`
	// RefusedByTags is true when the average is not used because it is
	// outside what the members' load tags allow (unused_because says
	// how): a member may be sending false estimates. TagsLow and
	// TagsHigh are the smallest and largest average (and estimate) the
	// tags allow, and TagsAverage their average; all three 0 when no
	// other member has a load tag in this node's metric.
	RefusedByTags bool `json:"refused_by_tags"`
	// ClampedToTags is true when the decision used the average but
	// clamped to within tags_slack of the tags' average (the average the
	// decision took is the decision's average).
	ClampedToTags bool    `json:"clamped_to_tags"`
	TagsSlack     float64 `json:"tags_slack"`
	TagsLow       float64 `json:"tags_low"`
	TagsHigh      float64 `json:"tags_high"`
	TagsAverage   float64 `json:"tags_average"`
	// RefusedDecisions counts the decisions that did not use the average
	// because the tags refused it, ClampedDecisions those that clamped
	// it, and MessagesRefused the averaging
	// messages refused because their estimates or flows would take this
	// node's estimate outside what the tags allow, since the node
	// started.
	RefusedDecisions uint64 `json:"refused_decisions"`
	ClampedDecisions uint64 `json:"clamped_decisions"`
	MessagesRefused  uint64 `json:"messages_refused"`
}

// lowEntryView is a lowest-load member the gossip averaging knows of.
type lowEntryView struct {
	Name  string  `json:"name"`
	Load  float64 `json:"load"`
	AgeMs uint32  `json:"age_ms"`
}

// viewAverage returns the admin view of avg, as of a decision at at.
func viewAverage(avg shed.AverageView, at time.Time) gossipAverageView {
	v := gossipAverageView{
		Used: avg.Used, Why: avg.Why, Average: finite(avg.Average), Size: finite(avg.Size),
		Members: avg.Members, Peers: avg.Peers, Exchanges: avg.Exchanges,
		LastExchangeAgeMs: -1, Lowest: []lowEntryView{},
		RefusedByTags: avg.Refused, ClampedToTags: avg.Clamped,
	}
	if avg.Tags.OK {
		v.TagsLow, v.TagsHigh, v.TagsAverage = finite(avg.Tags.Lo()), finite(avg.Tags.Hi()), finite(avg.Tags.Mean)
		v.TagsSlack = finite(avg.MeanSlack)
	}
	if !avg.LastExchange.IsZero() {
		v.LastExchangeAgeMs = max(0, at.Sub(avg.LastExchange).Milliseconds())
	}
	for _, e := range avg.Lows {
		v.Lowest = append(v.Lowest, lowEntryView{Name: e.Name, Load: e.Load, AgeMs: e.AgeMillis})
	}
	return v
}

// viewAverage returns the admin view of n's gossip average as of its last
// decision, with its refusal counts. Call it with n.mu held.
func (n *node) viewAverage() gossipAverageView {
	v := viewAverage(n.average, n.lastAt)
	v.RefusedDecisions, v.ClampedDecisions, v.MessagesRefused = n.averageRefused, n.averageClamped, n.avg.refused.Load()
	return v
}

// nodeView is one rebalance node in the admin API's output.
type nodeView struct {
	Name      string `json:"node_name"`
	Bind      string `json:"bind"`
	Encrypted bool   `json:"encrypted"`
	Metric    string `json:"metric"`
	// BoundaryTimeout is boundary_timeout in milliseconds; 0: never
	// forced.
	BoundaryTimeout int64 `json:"boundary_timeout_ms"`
	// JoinSettle is join_settle in effect, in milliseconds; 0: off.
	JoinSettle int64 `json:"join_settle_ms"`
	// IdleCloseAfter is idle_close_after in milliseconds.
	IdleCloseAfter int64   `json:"idle_close_after_ms"`
	Threshold      float64 `json:"threshold_percent"`
	StopBand       float64 `json:"stop_band_percent"`
	ShedRate       float64 `json:"shed_rate_percent"`
	MinConns       int     `json:"min_connections"`
	JoinError      string  `json:"join_error,omitempty"`
	// NameConflict is set when this node's serf member shut down because
	// another member uses its node_name (serf's name conflict vote): the
	// node then neither gossips, sees the cluster nor sheds, and Members
	// is empty.
	NameConflict string       `json:"name_conflict,omitempty"`
	Members      []memberView `json:"members"`
	Decision     decisionView `json:"last_decision"`
	// GossipAverage is the gossip averaging as of the last decision.
	GossipAverage gossipAverageView `json:"gossip_average"`
	// Connections are this process's HTTP connections by state.
	Connections conntrack.Counts `json:"connections"`
	// Bytes are this process's byte totals, as the rebalance listener
	// wrapper counts them (metric throughput's source).
	Bytes bytesView `json:"bytes"`
	// ShedTotal counts the connections this node shed, by how.
	ShedTotal ShedResult `json:"shed_total"`
	// ForcedCloses counts the shed active connections this node closed
	// because they reached no response boundary within boundary_timeout
	// (they are also in shed_total.active).
	ForcedCloses uint64 `json:"forced_closes_total"`
	// IdleCloses counts the shed HTTP/1.1 connections this process
	// closed because they stayed idle for idle_close_after with no
	// request arriving (they are also in shed_total).
	IdleCloses     uint64 `json:"idle_closes_total"`
	ShedTotalHuman string `json:"shed_total_human"`
	// WebSocketCloses says how the WebSocket streams this process shed
	// through rebalance_close ended: with a close frame, or without.
	WebSocketCloses conntrack.WebSocketCloses `json:"websocket_closes"`
}

// bytesView is the process's byte totals in the admin API's output.
type bytesView struct {
	conntrack.ByteTotals
	InHuman  string `json:"in_human"`
	OutHuman string `json:"out_human"`
	// Counting says whether a server of a loaded config has the rebalance
	// listener wrapper; without it the totals stay 0.
	Counting bool `json:"counting"`
}

// viewBytes returns the admin view of cs's bytes.
func viewBytes(cs connStats) bytesView {
	return bytesView{
		ByteTotals: cs.bytes,
		InHuman:    humanize.Bytes(cs.bytes.In),
		OutHuman:   humanize.Bytes(cs.bytes.Out),
		Counting:   cs.counting,
	}
}

// rebalanceView is the body of GET /lbx/rebalance.
type rebalanceView struct {
	Nodes []nodeView `json:"nodes"`
}

// buildRebalanceView assembles the admin view of every node in the
// process.
func buildRebalanceView() rebalanceView {
	rep := rebalanceView{Nodes: []nodeView{}}
	cs := loadedConns().stats()
	nodes.Range(func(_, v any) bool {
		rep.Nodes = append(rep.Nodes, v.(*node).view(time.Now(), cs))
		return true
	})
	sort.Slice(rep.Nodes, func(i, j int) bool { return rep.Nodes[i].Bind < rep.Nodes[j].Bind })
	return rep
}

// view returns the node's admin view, with cs, the process's connections.
func (n *node) view(now time.Time, cs connStats) nodeView {
	s := n.driver()
	var (
		members []cluster.Member
		st      cluster.Status
	)
	if s != nil {
		members, _ = s.cluster.Members()
		st, _ = s.cluster.Status()
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	v := nodeView{
		Name:         n.name,
		Bind:         n.key,
		Encrypted:    st.Encrypted,
		JoinError:    st.JoinError,
		Members:      []memberView{},
		NameConflict: st.Conflict,
		Decision: decisionView{
			At: n.lastAt, Local: finite(n.local), Current: finite(n.current), Held: n.held,
			Average: finite(n.last.Average), Balance: finite(n.last.Balance), Counted: n.last.Counted,
			Stale: n.last.Stale, NotAlive: n.last.NotAlive, Invalid: n.last.Invalid, OtherMetric: n.last.OtherMetric, Ignored: n.last.Ignored,
			Shedding: n.last.Active(), Lifting: n.last.Lift.Lifting, Lowest: finite(n.last.Lowest), LowestName: n.last.LowestName,
			Shed: n.last.Shed, Forced: n.lastForced, Reason: n.last.Reason,
			AverageFrom: shed.FromTags,
		},
		GossipAverage:   n.viewAverage(),
		Connections:     cs.conns,
		Bytes:           viewBytes(cs),
		ShedTotal:       n.shed,
		ForcedCloses:    n.forced,
		IdleCloses:      cs.idleCloses,
		WebSocketCloses: cs.ws,
	}
	if s != nil {
		v.Metric = s.metric
		v.Decision.LocalHuman = formatLoad(s.metric, n.local)
		v.Decision.CurrentHuman = formatLoad(s.metric, n.current)
		v.Decision.AverageHuman = formatLoad(s.metric, n.last.Average)
		// The config's options as given, defaults in (Provision).
		o := s.owner
		v.Threshold, v.StopBand, v.ShedRate, v.MinConns = o.Threshold, o.StopBand, o.ShedRate, *o.MinConnections
		v.BoundaryTimeout = s.boundary.Milliseconds()
		v.JoinSettle = s.params.EffectiveJoinSettle().Milliseconds()
		v.IdleCloseAfter = s.idleClose.Milliseconds()
	}
	if n.average.Used {
		v.Decision.AverageFrom = shed.FromGossip
	}
	v.ShedTotalHuman = fmt.Sprintf("%s connections (%s idle, %s active, %s upgraded); %s forced closed at boundary_timeout",
		humanize.Comma(int64(n.shed.Total())), humanize.Comma(int64(n.shed.Idle)),
		humanize.Comma(int64(n.shed.Active)), humanize.Comma(int64(n.shed.Hijacked)),
		humanize.Comma(int64(n.forced)))
	var params shed.Params
	if s != nil {
		params = s.params
	}
	for _, m := range members {
		mv := memberView{
			Name:   m.Name,
			Addr:   fmt.Sprintf("%s:%d", m.Addr, m.Port),
			Status: m.Status.String(),
			Self:   m.Self,
			Tags:   m.Tags,
		}
		raw := m.Tags[shed.LoadTag]
		metric, load, ok := shed.ParseLoadTag(raw)
		if ok {
			mv.Metric, mv.Load, mv.LoadHuman = metric, load, formatLoad(metric, load)
		}
		at := n.seen[m.Name].at
		if mv.Self {
			at = n.lastAt
		}
		mv.ReportAgeMs, mv.ReportAge = -1, "no report seen to change yet"
		if !at.IsZero() {
			mv.ReportAgeMs = now.Sub(at).Milliseconds()
			mv.ReportAge = humanize.RelTime(at, now, "ago", "from now")
		}
		if mv.Self {
			mv.Counted = true
			v.Members = append(v.Members, mv)
			continue
		}
		// The rule Decide uses; the load is NaN when the tag holds none.
		r := shed.Report{Name: m.Name, Status: m.Status, Load: load, At: at, Metric: metric}
		switch params.Standing(r, now) {
		case shed.NotAlive:
			mv.Why = "not alive"
		case shed.Stale:
			mv.Why = "report not fresh"
			if raw == "" {
				mv.Why = "no load report"
			}
		case shed.Invalid:
			mv.Why = fmt.Sprintf("invalid load report (want a number from 0 to %g): %.64q", float64(shed.MaxLoad), raw)
		case shed.OtherMetric:
			mv.Why = "reports another metric"
		default:
			if n.lift.Ignored == m.Name && now.Before(n.lift.IgnoredUntil) {
				mv.Why = "gained no connections while lifted; left out for " + humanize.RelTime(now, n.lift.IgnoredUntil, "", "")
				break
			}
			mv.Counted = true
		}
		v.Members = append(v.Members, mv)
	}
	sort.Slice(v.Members, func(i, j int) bool { return v.Members[i].Name < v.Members[j].Name })
	return v
}

// finite returns v, or 0 when v is NaN or an infinity, which JSON cannot
// encode: the admin view must always encode.
func finite(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	return v
}

// handleRebalance serves GET /lbx/rebalance.
var handleRebalance = adminjson.Handler(buildRebalanceView)

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)
