package status

import (
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// refusedBody is the answer to a client that is not on this machine: it
// names the fix, since the operator reading it is the one who can apply it.
const refusedBody = "403 Forbidden: lbx_status serves this process's internal state (members, addresses, tags, " +
	"upstreams, key fingerprints) only to a client on this machine, connected to a loopback address.\n" +
	"To serve it to other clients, put authentication (basic_auth, forward_auth) or a remote_ip matcher in front " +
	"of it and set `lbx_status { allow_remote }` (JSON: \"allow_remote\": true). " +
	"To reach it from elsewhere without that, use an SSH tunnel to a site bound to 127.0.0.1 (`bind 127.0.0.1`).\n"

// refusalLogEvery bounds the refusal log lines: a scanner that finds the
// site must not fill the log, so one line per period says how many
// requests were refused since the last one.
const refusalLogEvery = time.Minute

// fromLoopback reports whether r came over a connection between two
// loopback addresses of this machine (or over a Unix socket, which file
// permissions guard).
//
// It decides on the connection, not on headers: r.RemoteAddr is the peer
// of the TCP connection (or, behind Caddy's proxy_protocol listener
// wrapper, the client the trusted load balancer names), which a client
// cannot choose, while X-Forwarded-For and the Host header are whatever
// the client writes — the finding this guards against was a spoofed Host.
// The local address must be loopback too, because the peer address is not
// always the socket's: behind proxy_protocol it is the address a PROXY
// header names, and the interface the connection arrived on is what says
// whether the site was reached from outside. Caddy's client_ip (from
// trusted_proxies) is consulted only to refuse: a loopback peer that the
// operator declared a trusted proxy,
// forwarding a remote client, is that remote client. Headers can thus
// never grant access, only take it away.
func fromLoopback(r *http.Request) bool {
	local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	if local == nil {
		return false // not served by a net/http server: cannot tell
	}
	switch local.Network() {
	case "unix", "unixgram", "unixpacket":
		return true
	}
	if !loopbackAddr(local.String()) || !loopbackAddr(r.RemoteAddr) {
		return false
	}
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return loopbackHost(ip)
	}
	return true
}

// loopbackAddr reports whether addr, a host:port, has a loopback IP.
func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	return loopbackHost(host)
}

// loopbackHost reports whether host is a loopback IP literal (127/8,
// ::1, or 127/8 mapped into IPv6). Names are not resolved.
func loopbackHost(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// refusals counts the requests refused and rate-limits their log lines.
type refusals struct {
	total   atomic.Uint64
	logged  atomic.Uint64 // total at the last log line
	lastLog atomic.Int64  // unix ns of the last log line
}

// refuse answers r with 403 and the fix, and logs at most one line per
// refusalLogEvery.
func (h *Handler) refuse(w http.ResponseWriter, r *http.Request) {
	if h.refused != nil {
		h.refused.note(h.logger, r)
	}
	hd := w.Header()
	hd.Set("Content-Type", "text/plain; charset=utf-8")
	hd.Set("Cache-Control", "no-store")
	hd.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusForbidden)
	if r.Method != http.MethodHead {
		_, _ = w.Write([]byte(refusedBody))
	}
}

// note counts a refusal of r and logs it, with the refusals since the
// last line, unless a line was logged in the last refusalLogEvery.
func (f *refusals) note(logger *zap.Logger, r *http.Request) {
	n := f.total.Add(1)
	now := time.Now().UnixNano()
	last := f.lastLog.Load()
	if now-last < int64(refusalLogEvery) || !f.lastLog.CompareAndSwap(last, now) || logger == nil {
		return
	}
	prev := f.logged.Swap(n)
	localStr := ""
	if local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr); local != nil {
		localStr = local.String()
	}
	logger.Warn("lbx_status refused a client not on loopback; bind the site to 127.0.0.1, or set allow_remote behind authentication",
		zap.String("remote_addr", r.RemoteAddr), zap.String("local_addr", localStr),
		zap.Uint64("refused_since_last_log", n-prev), zap.Uint64("refused_total", n))
}
