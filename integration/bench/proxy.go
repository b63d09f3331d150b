package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/template"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/integration/fleet"
	"github.com/caddy-lbx/lbx/integration/loadmodel"
)

// process is a child process started by the benchmark, with its output in
// a log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed when the process has exited
}

// startProcess starts bin with args in its own process group, with stdout
// and stderr going to logPath.
func startProcess(name, logPath string, env []string, bin string, args ...string) (*process, error) {
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = filepath.Dir(logPath)
	cmd.Env = env
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait() // the exit status of a stopped proxy is of no interest
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// pid returns the process id, which is also its process group id.
func (p *process) pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// signal sends sig to the process's group, or to the process alone where
// groups are not supported.
func (p *process) signal(sig syscall.Signal) {
	if signalGroup(p.pid(), sig) != nil {
		_ = p.cmd.Process.Signal(sig)
	}
}

// stop asks the process to exit (SIGTERM), and kills its group if it has
// not exited within five seconds. It waits at most two more seconds.
func (p *process) stop() error {
	if p.exited() {
		return nil
	}
	p.signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(5 * time.Second):
	}
	p.signal(syscall.SIGKILL)
	select {
	case <-p.done:
		return fmt.Errorf("%s (pid %d) ignored SIGTERM and was killed", p.name, p.pid())
	case <-time.After(2 * time.Second):
		return fmt.Errorf("%s (pid %d) did not exit after SIGKILL", p.name, p.pid())
	}
}

// logTail returns the last part of the process's output, for error
// messages.
func (p *process) logTail() string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	const keep = 2000
	if len(b) > keep {
		b = b[len(b)-keep:]
	}
	return strings.TrimSpace(string(b))
}

// proxy is a running load balancer (or, for the direct baseline, none).
type proxy struct {
	url      string
	adminURL string   // Caddy's admin API, "" for others
	proc     *process // nil for the direct baseline
}

// lbxState fetches lbx's view of the upstreams (GET /lbx/upstreams) from
// Caddy's admin API, or returns nil.
func (p *proxy) lbxState(ctx context.Context) json.RawMessage {
	if p.adminURL == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.adminURL+"lbx/upstreams", nil)
	if err != nil {
		return nil
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil || resp.StatusCode != http.StatusOK || !json.Valid(b) {
		return nil
	}
	return b
}

// cpu returns the CPU time used so far by the proxy's processes.
func (p *proxy) cpu() (time.Duration, bool) {
	if p.proc == nil || !cpuSupported {
		return 0, false
	}
	d, err := groupCPU(p.proc.pid())
	return d, err == nil
}

// stop stops the proxy's processes.
func (p *proxy) stop() error {
	if p.proc == nil {
		return nil
	}
	return p.proc.stop()
}

// proxyEnv is the environment of proxy processes: the benchmark's own,
// with HOME and the XDG directories moved into dir so that Caddy writes
// nothing outside it.
func proxyEnv(dir string) []string {
	env := make([]string, 0, len(os.Environ())+3)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME":
			continue
		}
		env = append(env, kv)
	}
	return append(env,
		"HOME="+dir,
		"XDG_CONFIG_HOME="+filepath.Join(dir, "config"),
		"XDG_DATA_HOME="+filepath.Join(dir, "data"),
	)
}

// proxyOptions are the settings a scenario adds to every proxy's
// defaults. The zero value adds nothing.
type proxyOptions struct {
	// Weights, one per upstream, go to the policies that take weights
	// (policy.weights: lbx ewma, nginx, HAProxy); Caddy's stock policies
	// run unweighted.
	Weights []int
	// HealthCheck turns on active health checks of loadmodel.HealthPath
	// every healthInterval: Caddy's health_uri, HAProxy's option httpchk.
	// nginx OSS has no active checks and keeps its passive defaults.
	HealthCheck bool
	// Retries retries failed attempts on another upstream: Caddy
	// lb_retries 2 with a retry match on transport errors and on
	// 502/503/504 (see caddyfileTemplate), nginx
	// proxy_next_upstream on errors, timeouts and 502/503/504 for up to 3
	// tries, HAProxy retries 2 on connection failures, empty responses,
	// response timeouts and 502/503/504, redispatching every retry.
	Retries bool
	// Backup and BackupBudget are the backup_request and backup_budget
	// of the policies that hedge (bench hedge).
	Backup       time.Duration
	BackupBudget float64
	// ServerIDs, one per upstream, are HAProxy's server ids (its
	// consistent hash places a server by id, so a server removed from
	// the list leaves the others' ids, and keys, where they were). nil:
	// HAProxy numbers the servers in order.
	ServerIDs []int
}

// healthInterval is the active health checks' interval.
const healthInterval = "500ms"

// proxyConfig is what the config templates are filled with.
type proxyConfig struct {
	Dir       string
	Port      int
	AdminPort int      // Caddy's admin API
	Upstream  []string // host:port of every backend
	Weight    []int    // per upstream, or nil
	ServerID  []int    // HAProxy's id per upstream, or nil
	// Balance are the lines of HAProxy's backend that choose a server,
	// instead of balance leastconn.
	Balance []string
	Policy  string // Caddy's lb_policy arguments
	// PolicyOptions are lines of the lb_policy block, if any.
	PolicyOptions  []string
	HealthURI      string // "" for no active health checks
	HealthInterval string
	Retries        bool
	// Selective wraps the reverse_proxy in a selective handler's one
	// group; BackupRequest and BackupBudget are its options ("" for none).
	Selective     bool
	BackupRequest string
	BackupBudget  string
	// Groups are the reverse_proxies: one of every upstream unless a
	// selective splits them.
	Groups []proxyGroup
}

// proxyGroup is one reverse_proxy of a Caddy config (a selective's group).
type proxyGroup struct {
	Name     string
	Upstream []string
}

// splitGroups cuts upstreams into n groups of consecutive upstreams, as
// even as can be, named g1…gn (n ≤ 1: one group "all").
func splitGroups(upstreams []string, n int) []proxyGroup {
	if n <= 1 {
		return []proxyGroup{{Name: "all", Upstream: upstreams}}
	}
	n = min(n, len(upstreams))
	gs := make([]proxyGroup, n)
	for i := range gs {
		gs[i] = proxyGroup{Name: fmt.Sprintf("g%d", i+1), Upstream: upstreams[i*len(upstreams)/n : (i+1)*len(upstreams)/n]}
	}
	return gs
}

// caddyfileTemplate is the Caddy config: the admin API on a loopback port
// (idle unless lbx's state is fetched at the end of a case), errors-only
// logs, plain HTTP on 127.0.0.1, and reverse_proxy with the default
// transport and every default except the selection policy (and the health
// checks and retries a scenario asks for).
//
// The retries match transport errors in a matcher set of their own, and
// first: Caddy v2.11.9 evaluates every lb_retry_match set for a transport
// error (a reset after the request was sent), and a status expression
// alone never matches one (no status), so `lb_retries 2` with only
// `{http.reverse_proxy.status_code} in [502, 503, 504]` retries no reset
// at all; a set that errors ends the evaluation, hence the order. For a
// response, Caddy evaluates only the sets that read response
// placeholders: the status one.
var caddyfileTemplate = template.Must(template.New("Caddyfile").Parse(`{
	admin 127.0.0.1:{{.AdminPort}}
	persist_config off
	auto_https off
	grace_period 1s
	log {
		level ERROR
	}
}

http://:{{.Port}} {
	bind 127.0.0.1
{{- if .Selective}}
	selective {
{{- if .BackupRequest}}
		backup_request {{.BackupRequest}}
{{- end}}
{{- if .BackupBudget}}
		backup_budget {{.BackupBudget}}
{{- end}}
{{- end}}
{{- range .Groups}}
{{- if $.Selective}}
		group {{.Name}} {
{{- end}}
	reverse_proxy{{range .Upstream}} {{.}}{{end}} {
{{- if $.Policy}}
		lb_policy {{$.Policy}}
{{- if $.PolicyOptions}} {
{{- range $.PolicyOptions}}
			{{.}}
{{- end}}
		}
{{- end}}
{{- end}}
{{- if $.HealthURI}}
		health_uri {{$.HealthURI}}
		health_interval {{$.HealthInterval}}
{{- end}}
{{- if $.Retries}}
		lb_retries 2
		lb_retry_match {
			expression ` + "`{http.reverse_proxy.is_transport_error} == true`" + `
		}
		lb_retry_match {
			expression ` + "`{http.reverse_proxy.status_code} in [502, 503, 504]`" + `
		}
{{- end}}
	}
{{- if $.Selective}}
		}
{{- end}}
{{- end}}
{{- if .Selective}}
	}
{{- end}}
}
`))

// nginxTemplate is the nginx config: one process in the foreground, all
// files in Dir, no access log, and upstream keep-alive so nginx is not
// charged for connection setup. Everything else is nginx's default
// (including passive health: max_fails=1 fail_timeout=10s, and
// proxy_next_upstream error timeout), except the weights and retries a
// scenario asks for.
var nginxTemplate = template.Must(template.New("nginx.conf").Parse(`daemon off;
master_process off;
worker_processes 1;
pid {{.Dir}}/nginx.pid;
error_log {{.Dir}}/nginx-error.log error;
worker_rlimit_nofile 16384;

events {
	worker_connections 8192;
}

http {
	access_log off;
	client_body_temp_path {{.Dir}}/client_body;
	proxy_temp_path {{.Dir}}/proxy_temp;
	fastcgi_temp_path {{.Dir}}/fastcgi_temp;
	uwsgi_temp_path {{.Dir}}/uwsgi_temp;
	scgi_temp_path {{.Dir}}/scgi_temp;
	keepalive_requests 1000000;

	upstream backends {
		least_conn;
{{- range $i, $u := .Upstream}}
		server {{$u}}{{if $.Weight}} weight={{index $.Weight $i}}{{end}};
{{- end}}
		keepalive 256;
		keepalive_requests 1000000;
	}

	server {
		listen 127.0.0.1:{{.Port}};
		location / {
			proxy_pass http://backends;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
{{- if .Retries}}
			proxy_next_upstream error timeout http_502 http_503 http_504;
			proxy_next_upstream_tries 3;
{{- end}}
		}
	}
}
`))

// haproxyTemplate is the HAProxy config: HTTP mode, leastconn, server-side
// connection reuse, no logs, and timeouts longer than any request of the
// benchmark. Everything else is HAProxy's default, except the weights,
// health checks and retries a scenario asks for.
var haproxyTemplate = template.Must(template.New("haproxy.cfg").Parse(`global
	maxconn 8192
	hard-stop-after 3s

defaults
	mode http
	timeout connect 2s
	timeout client 30s
	timeout server 30s
	timeout http-keep-alive 30s
	http-reuse always

frontend fe
	bind 127.0.0.1:{{.Port}}
	default_backend be

backend be
{{- if .Balance}}
{{- range .Balance}}
	{{.}}
{{- end}}
{{- else}}
	balance leastconn
{{- end}}
{{- if .HealthURI}}
	option httpchk GET {{.HealthURI}}
{{- end}}
{{- if .Retries}}
	retries 2
	retry-on conn-failure empty-response response-timeout 502 503 504
	option redispatch 1
{{- end}}
{{- range $i, $u := .Upstream}}
	server b{{$i}} {{$u}}{{if $.ServerID}} id {{index $.ServerID $i}}{{end}}{{if $.Weight}} weight {{index $.Weight $i}}{{end}}{{if $.HealthURI}} check inter {{$.HealthInterval}}{{end}}
{{- end}}
`))

// writeTemplate fills t with c into path.
// A Caddyfile is formatted as `caddy fmt` would, which the adapter
// otherwise warns about (the selective wrapper nests the reverse_proxy
// one level deeper).
func writeTemplate(t *template.Template, path string, c proxyConfig) error {
	var b bytes.Buffer
	if err := t.Execute(&b, c); err != nil {
		return err
	}
	out := b.Bytes()
	if t == caddyfileTemplate {
		out = caddyfile.Format(out)
	}
	return os.WriteFile(path, out, 0o644)
}

// tools are the executables the benchmark runs.
type tools struct {
	caddy   string
	nginx   string // "" if not installed
	haproxy string // "" if not installed
}

// newProxyConfig fills the config of pol's proxy (all but its ports) in
// front of upstreams with opts.
func newProxyConfig(pol policy, dir string, upstreams []string, opts proxyOptions) (proxyConfig, error) {
	c := proxyConfig{Dir: dir, Upstream: upstreams, Policy: pol.caddyPolicy}
	if len(opts.Weights) > 0 {
		if len(opts.Weights) != len(upstreams) {
			return c, fmt.Errorf("%d weights for %d upstreams", len(opts.Weights), len(upstreams))
		}
		if pol.weights {
			if pol.kind == kindCaddy {
				w := make([]string, len(opts.Weights))
				for i, x := range opts.Weights {
					w[i] = strconv.Itoa(x)
				}
				c.PolicyOptions = append(c.PolicyOptions, "weights "+strings.Join(w, " "))
			} else {
				c.Weight = opts.Weights
			}
		}
	}
	switch pol.kind {
	case kindCaddy:
		c.PolicyOptions = append(c.PolicyOptions, pol.options...)
	case kindHAProxy:
		c.Balance = pol.options
		if len(opts.ServerIDs) > 0 {
			if len(opts.ServerIDs) != len(upstreams) {
				return c, fmt.Errorf("%d server ids for %d upstreams", len(opts.ServerIDs), len(upstreams))
			}
			c.ServerID = opts.ServerIDs
		}
	}
	if opts.HealthCheck {
		c.HealthURI, c.HealthInterval = loadmodel.HealthPath, healthInterval
	}
	c.Retries = opts.Retries
	c.Selective = pol.selective
	c.Groups = splitGroups(upstreams, pol.groups)
	if pol.selective && pol.backup {
		c.BackupRequest = opts.Backup.String()
		if pol.backupAuto {
			c.BackupRequest = "auto"
		}
		// A budget of 0 leaves selective's default, as users who write
		// only backup_request get.
		if opts.BackupBudget > 0 {
			c.BackupBudget = strconv.FormatFloat(opts.BackupBudget, 'f', -1, 64) + "%"
		}
	}
	return c, nil
}

// startProxy starts the load balancer that pol names in a new directory
// under dir, in front of upstreams, and waits until it answers.
func startProxy(ctx context.Context, t tools, pol policy, dir string, upstreams []string, opts proxyOptions) (*proxy, error) {
	port, err := fleet.FreePort()
	if err != nil {
		return nil, err
	}
	c, err := newProxyConfig(pol, dir, upstreams, opts)
	if err != nil {
		return nil, err
	}
	c.Port = port
	var p *process
	adminURL := ""
	switch pol.kind {
	case kindCaddy:
		if c.AdminPort, err = fleet.FreePort(); err != nil {
			return nil, err
		}
		adminURL = "http://127.0.0.1:" + strconv.Itoa(c.AdminPort) + "/"
		cfg := filepath.Join(dir, "Caddyfile")
		if err := writeTemplate(caddyfileTemplate, cfg, c); err != nil {
			return nil, err
		}
		p, err = startProcess("caddy", filepath.Join(dir, "caddy.log"), proxyEnv(dir),
			t.caddy, "run", "--config", cfg, "--adapter", "caddyfile")
	case kindNginx:
		cfg := filepath.Join(dir, "nginx.conf")
		if err := writeTemplate(nginxTemplate, cfg, c); err != nil {
			return nil, err
		}
		p, err = startProcess("nginx", filepath.Join(dir, "nginx.log"), proxyEnv(dir),
			t.nginx, "-e", filepath.Join(dir, "nginx-error.log"), "-p", dir+"/", "-c", cfg)
	case kindHAProxy:
		cfg := filepath.Join(dir, "haproxy.cfg")
		if err := writeTemplate(haproxyTemplate, cfg, c); err != nil {
			return nil, err
		}
		p, err = startProcess("haproxy", filepath.Join(dir, "haproxy.log"), proxyEnv(dir),
			t.haproxy, "-f", cfg, "-db")
	default:
		return nil, fmt.Errorf("policy %s has no proxy to start", pol.key)
	}
	if err != nil {
		return nil, err
	}
	px := &proxy{url: "http://127.0.0.1:" + strconv.Itoa(port) + "/", adminURL: adminURL, proc: p}
	if err := waitReady(ctx, px.url+loadmodel.HealthPath[1:], p); err != nil {
		stopErr := px.stop()
		return nil, errors.Join(fmt.Errorf("%s for %s: %w\n%s", p.name, pol.key, err, p.logTail()), stopErr)
	}
	return px, nil
}

// waitReady polls url until it answers 200, the process exits, ctx is
// done or 20 seconds pass. The benchmark polls the backends' health path
// through the proxy, which every backend answers at once, even one that
// fails everything else.
func waitReady(ctx context.Context, url string, p *process) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	client := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if p.exited() {
			return errors.New("exited before it was ready")
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w", ctx.Err())
		case <-tick.C:
		}
	}
}
