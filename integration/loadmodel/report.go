package loadmodel

import (
	"net/http"
	"strconv"
	"sync"
	"time"
)

// LoadReportHeader is the response header in which a backend reports its
// own load while load reports are on: an ORCA load report in the TEXT
// form, as Envoy, gRPC and lbx read it in-band.
const LoadReportHeader = "Endpoint-Load-Metrics"

// LoadReportPath is the path every backend answers at once with 200 and,
// while load reports are on, its load report: the endpoint a proxy's load
// probes ask (lbx's `load_reports { probe /load }`). A probe takes no
// worker, as a load endpoint served by its own thread would not, so its
// report counts the requests in the system without it.
const LoadReportPath = "/load"

// LoadProbes returns the number of requests for LoadReportPath served
// since the backend started.
func (b *Backend) LoadProbes() int64 { return b.probes.Load() }

// SetLoadReports turns the backend's load reports on or off. It takes
// effect from the next response, so a benchmark can run the same backends
// reporting in one case and silent in the next. Reports are off when a
// backend starts.
func (b *Backend) SetLoadReports(on bool) { b.reports.Store(on) }

// LoadReports reports whether the backend sends load reports.
func (b *Backend) LoadReports() bool { return b.reports.Load() }

// SetReportBehind chooses what an answer's report counts: with behind
// false (the default), the requests in the system with the one answered
// included, so a 1-worker backend reports at least 1 on every answer;
// with behind true, only the requests it leaves behind, the queue the next
// request would find. Probes' reports count the requests in the system
// either way.
func (b *Backend) SetReportBehind(behind bool) { b.reportBehind.Store(behind) }

// report adds the backend's load report to a response, when reports are
// on. inSystem is the number of requests queued or in service it counts
// (for an answer, the one answered included unless SetReportBehind).
//
// The report is what the backend knows of itself, and nothing more:
//
//   - application_utilization is inSystem ÷ Workers (less the one
//     answered with SetReportBehind), unsmoothed: 1 means
//     every worker busy and none waiting, 3 on a 1-worker backend two
//     waiting behind the one in service. It is the instant's queue, not an
//     average, because the proxy ages and combines reports itself, and a
//     backend that smoothed would report an antagonist's burst of a second
//     or two after it had begun to hurt, and for a while after it ended.
//   - rps_fractional and eps are the answers (and, of those, failures)
//     in the last whole second, from a counter of two one-second buckets.
//
// The model spends no CPU (it sleeps), so it reports no
// cpu_utilization.
func (b *Backend) report(w http.ResponseWriter, inSystem int64) {
	if !b.reports.Load() {
		return
	}
	rps, eps := b.rates.last(time.Now())
	w.Header().Set(LoadReportHeader, FormatLoadReport(float64(inSystem)/float64(b.model.Workers), rps, eps))
}

// FormatLoadReport writes an ORCA TEXT load report of application
// utilization, requests and errors per second, the form a backend sends
// in LoadReportHeader.
func FormatLoadReport(utilization float64, rps, eps int64) string {
	buf := make([]byte, 0, 96)
	buf = append(buf, "TEXT application_utilization="...)
	buf = strconv.AppendFloat(buf, utilization, 'g', 4, 64)
	buf = append(buf, ", rps_fractional="...)
	buf = strconv.AppendInt(buf, rps, 10)
	buf = append(buf, ", eps="...)
	buf = strconv.AppendInt(buf, eps, 10)
	return string(buf)
}

// rateWindow counts answers and failures per whole second of wall time,
// keeping the current second and the one before it.
type rateWindow struct {
	mu  sync.Mutex
	sec int64 // the current second, in Unix seconds
	// cur and prev count the current second and the one before it:
	// [0] answers, [1] failures.
	cur, prev [2]int64
}

// roll moves the window to the second of now.
func (r *rateWindow) roll(now time.Time) {
	s := now.Unix()
	switch {
	case s == r.sec:
	case s == r.sec+1:
		r.prev, r.cur, r.sec = r.cur, [2]int64{}, s
	case s > r.sec:
		r.prev, r.cur, r.sec = [2]int64{}, [2]int64{}, s
	}
	// A clock that steps back leaves the window where it was.
}

// note counts an answer at now, a failure if failed.
func (r *rateWindow) note(now time.Time, failed bool) {
	r.mu.Lock()
	r.roll(now)
	r.cur[0]++
	if failed {
		r.cur[1]++
	}
	r.mu.Unlock()
}

// last returns the answers and failures counted in the last whole second
// before now.
func (r *rateWindow) last(now time.Time) (answers, failures int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.roll(now)
	return r.prev[0], r.prev[1]
}
