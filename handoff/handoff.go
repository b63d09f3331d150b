// Package handoff is a listener wrapper that keeps a config reload from
// losing requests on new and kept-alive connections.
//
// A reload starts the new config's servers on sockets of their own
// (SO_REUSEPORT) before it stops the old config's. Until the old socket
// closes, the kernel gives it part of the new connections, and the old
// server drops any whose request it reads after its shutdown began (Go's
// http.Server closes them unanswered: the client sees EOF). With
// lbx_handoff, what either socket accepts is served by the newest config
// that listens on the address: from the moment the new server exists, the
// old one gets no new connection, and what the old socket accepted goes to
// the new server. The old server's Shutdown closes its kept-alive
// connections too, racing the clients' next requests: those go to the new
// server at a response boundary instead (see conn).
package handoff

import (
	"fmt"
	"net"
	"os"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/metricsreg"
)

func init() {
	caddy.RegisterModule(Wrapper{})
}

// Wrapper is the lbx_handoff listener wrapper. It has no options. Put it
// before `tls` in the server's listener_wrappers, so that what it hands
// from one config to the next is the plain connection, which the new
// config's TLS then terminates:
//
//	{
//		servers {
//			listener_wrappers {
//				lbx_handoff
//				tls
//			}
//		}
//	}
//
// Placed after `tls` on a server with TLS it would hand over connections
// whose TLS belongs to the old config, so there it passes connections
// through unchanged and logs a warning. Connections are handed over only
// between listeners with the same wrappers before lbx_handoff.
type Wrapper struct {
	logger  *zap.Logger
	wrapped *listenerSet
}

// listenerSet is the listeners one config's wrapper made.
type listenerSet struct {
	mu  sync.Mutex
	all []*listener
}

// CaddyModule returns the Caddy module information.
func (Wrapper) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "caddy.listeners.lbx_handoff",
		New: func() caddy.Module { return new(Wrapper) },
	}
}

// Provision registers the metric, and says once per process when Linux
// will reset the connections queued on an old socket at reloads.
func (w *Wrapper) Provision(ctx caddy.Context) error {
	w.logger = ctx.Logger()
	w.wrapped = new(listenerSet)
	migrateOnce.Do(func() {
		if b, err := os.ReadFile(migrateReqFile); err == nil && strings.TrimSpace(string(b)) == "0" {
			w.logger.Info("net.ipv4.tcp_migrate_req is 0: at a reload, Linux resets the new connections still queued on the old config's socket as it closes; set it to 1 to have them moved to the new one (docs/handoff.md)")
		}
	})
	return metricsreg.Register(ctx, handedOver)
}

// migrateReqFile is the sysctl that lets Linux move the connections queued
// on a closing SO_REUSEPORT socket to another socket of its group.
const migrateReqFile = "/proc/sys/net/ipv4/tcp_migrate_req"

// migrateOnce keeps the note about migrateReqFile to one per process.
var migrateOnce sync.Once

// WrapListener joins ln to the listeners other configs have on its
// address.
func (w *Wrapper) WrapListener(ln net.Listener) net.Listener {
	if t := fmt.Sprintf("%T", ln); t == "*tls.listener" {
		w.logger.Warn("lbx_handoff is after tls in listener_wrappers; connections are not handed over at reloads: put lbx_handoff before tls",
			zap.String("address", ln.Addr().String()))
		return ln
	}
	l := attach(ln)
	w.wrapped.mu.Lock()
	w.wrapped.all = append(w.wrapped.all, l)
	w.wrapped.mu.Unlock()
	return l
}

// Cleanup closes the listeners this config wrapped, if its servers have
// not (a config that failed to start), so that the other configs on their
// addresses take their connections.
func (w *Wrapper) Cleanup() error {
	if w.wrapped == nil {
		return nil // not provisioned
	}
	w.wrapped.mu.Lock()
	wrapped := w.wrapped.all
	w.wrapped.all = nil
	w.wrapped.mu.Unlock()
	for _, l := range wrapped {
		l.Close()
	}
	return nil
}

// handedOver counts connections a socket of an older config accepted and
// a newer config's server took (or an older one's, after a newer config
// failed to start).
var handedOver = prometheus.NewCounter(prometheus.CounterOpts{
	Name: "caddy_lbx_handoff_connections_total",
	Help: "Connections accepted on one config's socket and served by another config's server at a reload (lbx_handoff).",
})

// Interface guards
var (
	_ caddy.Provisioner     = (*Wrapper)(nil)
	_ caddy.CleanerUpper    = (*Wrapper)(nil)
	_ caddy.ListenerWrapper = (*Wrapper)(nil)
)
