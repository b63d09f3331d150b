package lbpolicy

import (
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/dustin/go-humanize"

	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/hoststate"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves lbx's view of the upstreams on Caddy's admin endpoint:
//
//	GET /lbx/upstreams
//
// returns every upstream address any config uses, with its latency
// estimate, requests in flight, samples and failures, and every pool a
// selection policy of ours serves, with weights, availability and panic
// mode. Numbers are machine-readable; fields ending in _human repeat them
// for people.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/lbx/upstreams",
		Handler: adminjson.Handler(buildUpstreamsStatus),
	}}
}

// upstreamView is one upstream in the admin API's output.
type upstreamView struct {
	Dial string `json:"dial"`
	// EstimateMs is the raw peak-EWMA latency estimate (not decayed), in
	// milliseconds; 0 when never sampled.
	EstimateMs    float64 `json:"latency_estimate_ms"`
	EstimateHuman string  `json:"latency_estimate_human"`
	// EstimateAgeMs is how long ago the estimate last changed.
	EstimateAgeMs    float64 `json:"estimate_age_ms"`
	InFlight         int     `json:"in_flight"`
	Pending          int64   `json:"awaiting_headers"`
	Samples          uint64  `json:"samples"`
	SamplesHuman     string  `json:"samples_human"`
	Failures         uint64  `json:"failures"`
	LastFailureHuman string  `json:"last_failure_human,omitempty"`
	PassiveFails     int     `json:"passive_fails"`
	// EjectedForMs is how long the upstream stays ejected by outlier
	// detection, in milliseconds; 0 when it is not ejected.
	EjectedForMs float64 `json:"ejected_for_ms"`
	Ejections    uint64  `json:"ejections_total"`
	// EjectionsOverflow counts the ejections max_ejection_percent refused:
	// the upstream met a rule while the pool was at its cap.
	EjectionsOverflow uint64 `json:"ejections_overflow_total"`
	// EjectionReason is why the upstream is ejected now, or was last
	// ejected: "consecutive_failures", "success_rate" or
	// "failure_percentage"; absent when it never was.
	EjectionReason string `json:"ejection_reason,omitempty"`
	// EjectionsByReason splits ejections_total by reason.
	EjectionsByReason   map[string]uint64 `json:"ejections_by_reason"`
	ConsecutiveFailures int64             `json:"consecutive_failures"`
}

// upstreamsStatus is the body of GET /lbx/upstreams.
type upstreamsStatus struct {
	Upstreams []upstreamView `json:"upstreams"`
	Pools     []poolStatus   `json:"pools"`
}

// buildUpstreamsStatus assembles the admin API's view of the current state.
func buildUpstreamsStatus() upstreamsStatus {
	status := upstreamsStatus{Upstreams: []upstreamView{}, Pools: allPoolStatuses()}
	now := time.Now()
	for _, s := range hoststate.All() {
		v := upstreamView{
			Dial:          s.Dial,
			EstimateMs:    float64(s.Estimate) / 1e6,
			EstimateHuman: s.Estimate.Round(10 * time.Microsecond).String(),
			EstimateAgeMs: float64(s.Age) / 1e6,
			InFlight:      s.InFlight,
			Pending:       s.Pending,
			Samples:       s.Samples,
			SamplesHuman:  humanize.Comma(int64(s.Samples)),
			Failures:      s.Failures,
			PassiveFails:  s.PassiveFails,

			EjectedForMs:        float64(s.EjectedFor) / 1e6,
			Ejections:           s.Ejections,
			EjectionsOverflow:   s.Overflows,
			EjectionsByReason:   make(map[string]uint64, len(s.Outlier.ByReason)),
			ConsecutiveFailures: s.ConsecFailures,
		}
		for r, n := range s.Outlier.ByReason {
			v.EjectionsByReason[hoststate.EjectReason(r).String()] = n
		}
		if s.Outlier.HasEjected {
			v.EjectionReason = s.Outlier.LastReason.String()
		}
		if s.Samples == 0 {
			v.EstimateHuman = "no samples yet"
		}
		if s.SinceFailure > 0 {
			v.LastFailureHuman = humanize.Time(now.Add(-s.SinceFailure))
		}
		status.Upstreams = append(status.Upstreams, v)
	}
	return status
}

// Interface guards
var _ caddy.AdminRouter = adminAPI{}
