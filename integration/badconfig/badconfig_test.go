// Package badconfig pushes bad configurations through Caddy's admin API
// (POST /load) to a real cmd/caddy process that is serving traffic through
// every lbx module, and checks what an operator relies on: the process
// survives, the running config keeps serving with no failed request, and
// the error says what was wrong.
package badconfig

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	_ "github.com/caddy-lbx/lbx"
	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/lbxtest"
)

// baseline is a config that uses every lbx module with every option it
// has, so that the generated matrix reaches them all. Placeholders in
// braces are filled in by newServer.
const baseline = `{
	admin 127.0.0.1:{ADMIN}
	auto_https off
	servers {
		listener_wrappers {
			lbx_handoff
			rebalance
		}
	}
	cluster {
		node_name badconfig
		bind 127.0.0.1:{SERF}
		tags {
			role edge
		}
	}
	rebalance {
		metric connections
		interval 1s
		history 10s
		freshness 5s
		threshold 20%
		stop_band 5%
		shed_rate 1%
		min_connections 50
		boundary_timeout 30s
		idle_close_after 2m
	}
}

:{HTTP} {
	handle /ewma {
		reverse_proxy {B1} {B2} {
			lb_policy ewma {
				choices all
				decay 10s
				weights 1 2
				panic_threshold 40%
				retry_budget 20% {
					min_concurrent 3
				}
				slow_start 10s {
					min_weight 10%
					aggression 1.5
				}
				load_reports {
					max_age 5s
					probe /load {
						per_request 0.2
						max_rate 20
						timeout 1s
					}
				}
				outlier {
					consecutive_failures 5
					failure_status 502 503
					base_ejection_time 30s
					max_ejection_time 300s
					max_ejection_percent 50%
					interval 10s
					success_rate on
					success_rate_min_hosts 5
					success_rate_min_requests 100
					success_rate_stdev_factor 1.9
					failure_percentage_threshold 85%
					failure_percentage_min_hosts 5
					failure_percentage_min_requests 50
					health_check_restore on
				}
			}
		}
	}
	handle /hash {
		reverse_proxy {B1} {B2} {
			lb_policy consistent_hash {http.request.uri} {
				balance_factor 1.5
				weights 1 2
				panic_threshold 40%
				outlier {
					consecutive_failures 5
					interval 10s
				}
				slow_start 10s {
					min_weight 10%
					aggression 1.5
				}
			}
		}
	}
	handle /panic {
		reverse_proxy {B1} {B2} {
			lb_policy panic {
				threshold 30%
				outlier {
					consecutive_failures 5
					interval 10s
				}
				slow_start 10s {
					min_weight 10%
					aggression 1.5
				}
				policy least_conn
			}
		}
	}
	handle /partition {
		partition {
			to {B1} 0/2
			to {B2} 1/2
			fail_limit 1
			timeout 5s
			max_request_body 1MB
			max_response_body 1MB
			max_merge_memory 1GiB
			merge json
			lb_retries 1
			lb_policy ewma {
				outlier {
					interval 10s
				}
			}
		}
	}
	handle /selective {
		selective {
			group one weight 2 {
				reverse_proxy {B1}
			}
			group two {
				reverse_proxy {B2}
			}
			policy failover 70
			max_retry 1
			retry_on dial timeout 502 503
			backup_request 50ms
			backup_match {
				method GET
			}
			backup_budget 10%
			timeout 5s
			max_replay_body 1MB
			status_header X-Selective
		}
	}
	handle /selective-auto {
		selective {
			group one {
				reverse_proxy {B1}
			}
			group two {
				reverse_proxy {B2}
			}
			backup_request auto quantile 99 min 5ms max 500ms
		}
	}
	handle /parallel {
		parallel {
			branch one {
				reverse_proxy {B1}
			}
			branch two {
				reverse_proxy {B2}
			}
			fail_limit 1
			timeout 5s
			max_request_body 1MB
			max_response_body 1MB
			max_merged_body 2MB
			max_merge_memory 1GiB
			merge json {
				missing_field missing
			}
			skip "{parallel.branch} == 'two' && {query.one} == '1'"
		}
	}
	handle /split {
		parallel {
			branch {
				reverse_proxy {B1}
			}
			branch {
				reverse_proxy {B2}
			}
			split_body request.ids {
				key id
				max_elements 1000
			}
		}
	}
	handle /split-partition {
		partition {
			to {B1} 0/2
			to {B2} 1/2
			split_body ids index
		}
	}
	handle /naming {
		partition {
			naming_file {NAMING}
			poll_interval 1s
			merge concat
		}
	}
	handle /cluster {
		reverse_proxy {
			dynamic serf {
				tag role edge
				port {HTTP}
				refresh 1s
			}
			lb_policy cluster_load {
				port {HTTP}
				refresh 1s
			}
		}
	}
	handle /close {
		rebalance_close
		respond "closing"
	}
	handle /lbx/* {
		lbx_status
	}
}
`

// trafficPaths are the routes the background traffic uses; each must
// answer 200 under the baseline.
var trafficPaths = []string{"/ewma", "/hash", "/panic", "/partition", "/parallel", "/selective", "/selective-auto", "/naming", "/lbx/upstreams"}

// server is a cmd/caddy process serving the baseline, with traffic on it.
type server struct {
	t        *testing.T
	proc     *fleet.Proc
	admin    string // base URL of the admin API
	http     string // base URL of the site
	baseJSON []byte // the baseline, adapted
	vars     map[string]string

	// failures holds the time and text of each failed request.
	mu       sync.Mutex
	failures []failure
	requests atomic.Int64
	// skipped counts the ticks that sent nothing because 16 requests were
	// waiting for their answers.
	skipped atomic.Int64
	stop    chan struct{}
	stopped chan struct{}
}

// failure is a request that failed, sent at start and failed at end.
type failure struct {
	start, end time.Time
	msg        string
}

// caddyBin is built once per test binary.
var (
	buildOnce sync.Once
	caddyBin  string
	buildErr  error
)

func buildCaddy(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "lbx-badconfig-")
		if err != nil {
			buildErr = err
			return
		}
		caddyBin = filepath.Join(dir, "caddy")
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		buildErr = fleet.BuildCaddy(ctx, "", caddyBin)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return caddyBin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if caddyBin != "" {
		os.RemoveAll(filepath.Dir(caddyBin))
	}
	os.Exit(code)
}

func freePort(t *testing.T) string { return strconv.Itoa(lbxtest.FreePort(t)) }

// backend answers every request with a small JSON object naming itself.
func backend(t *testing.T, name string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"from":%q}`, name)
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// newServer starts cmd/caddy on the baseline and waits until every traffic
// path answers.
func newServer(t *testing.T) *server {
	bin := buildCaddy(t)
	dir := t.TempDir()
	naming := filepath.Join(dir, "naming")
	b1, b2 := backend(t, "b1"), backend(t, "b2")
	if err := os.WriteFile(naming, []byte(b1+" 0/2\n"+b2+" 1/2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := &server{t: t, vars: map[string]string{
		"{ADMIN}": freePort(t), "{HTTP}": freePort(t), "{SERF}": freePort(t),
		"{B1}": b1, "{B2}": b2, "{NAMING}": naming,
	}, stop: make(chan struct{}), stopped: make(chan struct{})}
	s.admin = "http://127.0.0.1:" + s.vars["{ADMIN}"]
	s.http = "http://127.0.0.1:" + s.vars["{HTTP}"]

	cf := s.fill(baseline)
	out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
	if err != nil {
		t.Fatalf("adapting the baseline: %v", err)
	}
	if len(warnings) > 0 {
		t.Fatalf("adapting the baseline: warnings %v", warnings)
	}
	s.baseJSON = out

	proc, err := fleet.StartProc(bin, filepath.Join(dir, "caddy"), cf)
	if err != nil {
		t.Fatal(err)
	}
	s.proc = proc
	t.Cleanup(func() {
		if err := proc.Kill(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			log := proc.Log()
			if len(log) > 8000 {
				log = log[len(log)-8000:]
			}
			t.Logf("caddy log (tail):\n%s", log)
		}
	})
	client := &http.Client{Timeout: 5 * time.Second}
	for _, p := range trafficPaths {
		deadline := time.Now().Add(30 * time.Second)
		for {
			resp, err := client.Get(s.http + p)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == 200 {
					break
				}
			}
			if proc.Exited() || time.Now().After(deadline) {
				t.Fatalf("%s did not answer 200 within 30s (last error %v)", p, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return s
}

// fill replaces the placeholders of a config template.
func (s *server) fill(tmpl string) string {
	for k, v := range s.vars {
		tmpl = strings.ReplaceAll(tmpl, k, v)
	}
	return tmpl
}

// startTraffic sends requests to the traffic paths, one every 4 ms while
// fewer than 16 wait for their answers, until stopTraffic; each answer
// other than 200, and each request unanswered within 10 s, is a failure.
func (s *server) startTraffic() {
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 8}}
	go func() {
		defer close(s.stopped)
		tick := time.NewTicker(4 * time.Millisecond)
		defer tick.Stop()
		var wg sync.WaitGroup
		defer wg.Wait()
		sem := make(chan struct{}, 16)
		for i := 0; ; i++ {
			select {
			case <-s.stop:
				return
			case <-tick.C:
			}
			select {
			case sem <- struct{}{}:
			default:
				// 16 requests are waiting: skip this tick rather than pile
				// on. A slow answer (a saturated CPU) is not a lost one; a
				// server that does not answer at all fails each waiting
				// request at the client's timeout.
				s.skipped.Add(1)
				continue
			}
			wg.Add(1)
			go func(path string) {
				defer wg.Done()
				defer func() { <-sem }()
				start := time.Now()
				defer s.requests.Add(1)
				resp, err := client.Get(s.http + path)
				if err != nil {
					s.fail(start, err)
					return
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					s.fail(start, fmt.Errorf("GET %s: %d %s", path, resp.StatusCode, bytes.TrimSpace(body)))
				}
			}(trafficPaths[i%len(trafficPaths)])
		}
	}()
}

func (s *server) fail(start time.Time, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failures = append(s.failures, failure{start, time.Now(), err.Error()})
}

func (s *server) stopTraffic() {
	close(s.stop)
	<-s.stopped
}

// failuresOutside returns the failed requests that overlap no window.
func (s *server) failuresOutside(windows [][2]time.Time) []failure {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []failure
next:
	for _, f := range s.failures {
		for _, w := range windows {
			if !f.end.Before(w[0]) && !f.start.After(w[1]) {
				continue next
			}
		}
		out = append(out, f)
	}
	return out
}

// load posts a config to /load and returns the status and the body
// (lbxtest.PostLoad, which sends a load again when the admin endpoint
// Caddy is replacing drops it). Whether the process survived and what it
// serves are checked after every load.
func (s *server) load(contentType string, body []byte) (int, string, error) {
	status, answer, err := lbxtest.PostLoad(&http.Client{Timeout: 60 * time.Second}, s.admin, contentType, body)
	return status, string(answer), err
}

// restore loads the baseline again after a config that was accepted.
func (s *server) restore() {
	s.t.Helper()
	status, body, err := s.load("application/json", s.baseJSON)
	if err != nil || status != 200 {
		s.t.Fatalf("restoring the baseline: %d %s %v", status, body, err)
	}
}

// peakRSS returns the process's peak resident set size in bytes (Linux).
func (s *server) peakRSS() (int64, bool) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.proc.Pid()))
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err == nil
		}
	}
	return 0, false
}

// badCase is one config pushed through /load.
type badCase struct {
	name        string
	contentType string
	body        []byte
	// want is what the error must contain; for generated cases it is
	// the option's name, and a config that loads is allowed (the value
	// was valid after all) and undone.
	want      string
	orWant    string // another text that will do, when not empty
	mayAccept bool
}

// mentions reports whether an error body says what c wants it to.
func (c badCase) mentions(body string) bool {
	return strings.Contains(body, c.want) || c.orWant != "" && strings.Contains(body, c.orWant)
}

// jsonCase builds a case from the baseline JSON changed by edit.
func (s *server) jsonCase(name, want string, edit func(cfg map[string]any)) badCase {
	var cfg map[string]any
	if err := json.Unmarshal(s.baseJSON, &cfg); err != nil {
		s.t.Fatal(err)
	}
	edit(cfg)
	body, err := json.Marshal(cfg)
	if err != nil {
		s.t.Fatal(err)
	}
	return badCase{name: name, contentType: "application/json", body: body, want: want}
}

// caddyfileCase builds a case from the baseline Caddyfile changed by
// replacing old with new (old must occur).
func (s *server) caddyfileCase(name, want, old, new string) badCase {
	cf := s.fill(baseline)
	if !strings.Contains(cf, old) {
		s.t.Fatalf("case %s: %q is not in the baseline", name, old)
	}
	return badCase{name: name, contentType: "text/caddyfile", body: []byte(strings.Replace(cf, old, new, 1)), want: want}
}

// run pushes every case and checks each answer and the process.
func (s *server) run(cases []badCase) (rejected, accepted int) {
	t := s.t
	var windows [][2]time.Time
	var windowNames []string
	s.startTraffic()
	for _, c := range cases {
		// Let requests complete between two loads, so that each config
		// pushed meets traffic.
		deadline := time.Now().Add(2 * time.Second)
		for n := s.requests.Load(); s.requests.Load() < n+2 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		start := time.Now()
		status, body, err := s.load(c.contentType, c.body)
		if s.proc.Exited() {
			t.Fatalf("%s: caddy exited (%v) after POST /load", c.name, s.proc.WaitErr())
		}
		if err != nil {
			t.Fatalf("%s: POST /load: %v", c.name, err)
		}
		switch {
		case status == 200 && c.mayAccept:
			accepted++
			s.restore()
			windows = append(windows, [2]time.Time{start, time.Now()})
			windowNames = append(windowNames, c.name)
		case status == 200:
			t.Errorf("%s: accepted; want an error containing %q", c.name, c.want)
			s.restore()
			windows = append(windows, [2]time.Time{start, time.Now()})
			windowNames = append(windowNames, c.name)
		case status >= 500 && !strings.Contains(body, `"error"`):
			t.Errorf("%s: %d %s; want a 4xx with the error", c.name, status, body)
		case !c.mentions(body):
			t.Errorf("%s: error %s\n  does not mention %q", c.name, strings.TrimSpace(body), c.want)
		default:
			rejected++
		}
	}
	// Some traffic after the last case, so that a failure it caused shows.
	deadline := time.Now().Add(500 * time.Millisecond)
	for n := s.requests.Load(); s.requests.Load() < n+50 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	s.stopTraffic()
	if s.proc.Exited() {
		t.Fatalf("caddy exited: %v", s.proc.WaitErr())
	}
	s.mu.Lock()
	for _, f := range s.failures {
		for i, w := range windows {
			if !f.end.Before(w[0]) && !f.start.After(w[1]) {
				s.t.Logf("failed request in window of %s: %s", windowNames[i], f.msg)
			}
		}
	}
	s.mu.Unlock()
	fails := s.failuresOutside(windows)
	for i, f := range fails {
		if i == 10 {
			t.Errorf("… and %d more", len(fails)-10)
			break
		}
		t.Errorf("failed request while the baseline served: %s", f.msg)
	}
	t.Logf("%d cases: %d rejected, %d accepted (and undone); %d requests (%d ticks skipped with 16 waiting), %d failed outside accepted windows",
		len(cases), rejected, accepted, s.requests.Load(), s.skipped.Load(), len(fails))
	if rss, ok := s.peakRSS(); ok {
		t.Logf("caddy peak RSS %d MiB", rss>>20)
		if rss > 1<<30 {
			t.Errorf("caddy peak RSS %d MiB; want under 1 GiB", rss>>20)
		}
	}
	return rejected, accepted
}
