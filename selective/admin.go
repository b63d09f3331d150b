package selective

import (
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-lbx/lbx/internal/adminjson"
	"github.com/caddy-lbx/lbx/internal/liveset"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the selective handlers' state on Caddy's admin endpoint:
//
//	GET /lbx/selective
//
// returns every selective handler of the running configs with its policy,
// calls and backup budget, and each group's capacity, usable share,
// latency estimate, attempts in flight and counters.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.lbx_selective",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{
		Pattern: "/lbx/selective",
		Handler: adminjson.Handler(buildView),
	}}
}

// live holds the provisioned handlers, for the admin view, which lists
// them in the order they were provisioned.
var live liveset.Set[*Handler]

func register(h *Handler) { live.Add(h) }

func unregister(h *Handler) { live.Remove(h) }

// selectiveStatus is the admin view.
type selectiveStatus struct {
	Handlers []handlerStatus `json:"handlers"`
}

// handlerStatus is one handler in the admin view.
type handlerStatus struct {
	Policy          string        `json:"policy"`
	Calls           uint64        `json:"calls"`
	MaxRetry        int           `json:"max_retry"`
	BackupRequestMs float64       `json:"backup_request_ms,omitempty"`
	BackupTokens    float64       `json:"backup_tokens"`
	BackupRefused   uint64        `json:"backup_refused"`
	BackupBusy      uint64        `json:"backup_busy"`
	BackupQueued    uint64        `json:"backup_queued"`
	TimeoutMs       float64       `json:"timeout_ms,omitempty"`
	Groups          []groupStatus `json:"groups"`
}

// groupStatus is one group in the admin view.
type groupStatus struct {
	Name      string  `json:"name"`
	Weight    float64 `json:"weight"`
	Usable    float64 `json:"usable"`
	Upstreams float64 `json:"upstreams"`
	Capacity  float64 `json:"capacity"`
	Failing   bool    `json:"failing"`
	// EstimateMs is what the group's answers took: the median time to
	// response headers of its recent answers, in milliseconds, kept while
	// it fails (the name says which of lbx's two estimates it is).
	EstimateMs float64 `json:"answer_median_ms"`
	InFlight   int64   `json:"in_flight"`
	Attempts   uint64  `json:"attempts"`
	Answers    uint64  `json:"answers"`
	Failures   uint64  `json:"failures"`
	BackupSent uint64  `json:"backup_sent"`
	BackupWon  uint64  `json:"backup_won"`
	// BackupDelayMs is the delay backup_request_auto last set for calls
	// whose first attempt went to the group; absent without it.
	BackupDelayMs float64 `json:"backup_delay_ms,omitempty"`
}

func buildView() selectiveStatus {
	now := monoclock.Now()
	v := selectiveStatus{Handlers: []handlerStatus{}}
	for _, h := range live.All() {
		v.Handlers = append(v.Handlers, h.status(now))
	}
	return v
}

func (h *Handler) status(now int64) handlerStatus {
	hv := handlerStatus{
		Policy:          h.Policy.name(),
		Calls:           h.calls.Load(),
		MaxRetry:        h.maxRetry,
		BackupRequestMs: ms(time.Duration(h.BackupRequest)),
		BackupTokens:    h.budget.available(),
		BackupRefused:   h.budget.refused.Load(),
		BackupBusy:      h.backupBusy.Load(),
		BackupQueued:    h.backupQueued.Load(),
		TimeoutMs:       ms(time.Duration(h.Timeout)),
		Groups:          []groupStatus{},
	}
	for _, g := range h.groups {
		usable, total := g.capacity(now)
		st := g.state
		failing := g.failingNow(now)
		capacity := usable * g.weight
		if failing {
			capacity = 0
		}
		var delayMs float64
		if h.BackupRequestAuto != nil {
			delayMs = ms(h.backupDelay(g, now))
		}
		hv.Groups = append(hv.Groups, groupStatus{
			Name:       g.name,
			Weight:     g.weight,
			Usable:     usable,
			Upstreams:  total,
			Capacity:   capacity,
			Failing:    failing,
			EstimateMs: ms(st.stats.Snapshot(now).AnswerMedian),
			InFlight:   st.inFlight.Load(),
			Attempts:   st.attempts.Load(),
			Answers:    st.answers.Load(),
			Failures:   st.failures.Load(),
			BackupSent: st.backupSent.Load(),
			BackupWon:  st.backupWon.Load(),

			BackupDelayMs: delayMs,
		})
	}
	return hv
}

func ms(d time.Duration) float64 { return d.Seconds() * 1e3 }
