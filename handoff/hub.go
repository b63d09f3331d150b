package handoff

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"
)

// queueSize bounds the connections accepted from the sockets of one
// address that no server has taken yet. Past it the sockets' accept loops
// wait, and connections queue in the kernel as they would without
// lbx_handoff.
const queueSize = 1024

// hubs holds a hub for each address and layer that has an open listener:
// every config's listener for the same address joins the same hub.
var (
	hubsMu sync.Mutex
	hubs   = map[string]*hub{}
)

// hub is where the listeners of one address, one per config generation,
// meet. Each listener's socket loop accepts into conns; only the newest
// open listener takes from it, so that once a reload has started the new
// config's server, connections the old socket accepts go to the new server.
type hub struct {
	key   string
	conns chan accepted

	mu sync.Mutex
	// gens are the open listeners, oldest first.
	gens []*listener
	// changed is closed and replaced whenever gens changes.
	changed chan struct{}

	// dead is closed when the last listener has closed: nothing will take
	// from conns again.
	dead chan struct{}
}

// attach wraps ln, the listener of a new config for its address, and
// makes it the newest listener of that address's hub.
func attach(ln net.Listener) *listener {
	key := fmt.Sprintf("%s %s %T", ln.Addr().Network(), ln.Addr().String(), ln)
	hubsMu.Lock()
	h := hubs[key]
	if h == nil {
		h = &hub{key: key, conns: make(chan accepted, queueSize), changed: make(chan struct{}), dead: make(chan struct{})}
		hubs[key] = h
	}
	l := &listener{Listener: ln, hub: h, closed: make(chan struct{}), socketDone: make(chan struct{})}
	h.mu.Lock()
	h.gens = append(h.gens, l)
	h.notifyLocked()
	h.mu.Unlock()
	hubsMu.Unlock()
	go l.acceptLoop()
	return l
}

// detach removes l from its hub, if it is there. The last listener to
// leave takes the hub out of the registry and closes what is still queued.
func (h *hub) detach(l *listener) {
	hubsMu.Lock()
	h.mu.Lock()
	i := slices.Index(h.gens, l)
	if i < 0 {
		h.mu.Unlock()
		hubsMu.Unlock()
		return
	}
	h.gens = slices.Delete(h.gens, i, i+1)
	last := len(h.gens) == 0
	h.notifyLocked()
	h.mu.Unlock()
	if last && hubs[h.key] == h {
		delete(hubs, h.key)
	}
	hubsMu.Unlock()
	if last {
		close(h.dead)
		h.drain()
	}
}

func (h *hub) notifyLocked() {
	close(h.changed)
	h.changed = make(chan struct{})
}

// newest returns the listener that takes connections now, and the channel
// closed when that may change.
func (h *hub) newest() (*listener, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.gens) == 0 {
		return nil, h.changed
	}
	return h.gens[len(h.gens)-1], h.changed
}

// accepted is a connection and the listener whose socket accepted it.
type accepted struct {
	conn   net.Conn
	prefix []byte // bytes an earlier server read from conn (see conn.Read)
	from   *listener
}

// put queues a for the newest listener, or closes it if the hub is dead.
// It waits while the queue is full.
func (h *hub) put(a accepted) {
	select {
	case h.conns <- a:
		// A hub that died as a went in is drained here, or by detach
		// after it: dead is closed before detach drains.
		select {
		case <-h.dead:
			h.drain()
		default:
		}
	case <-h.dead:
		a.conn.Close()
	}
}

// drain closes every queued connection.
func (h *hub) drain() {
	for {
		select {
		case a := <-h.conns:
			a.conn.Close()
		default:
			return
		}
	}
}

// listener is one config's listener for an address: its own socket, and
// the server's view of the hub.
type listener struct {
	net.Listener // the socket, as Caddy (and earlier wrappers) gave it
	hub          *hub

	closeOnce sync.Once
	closed    chan struct{}
	closeErr  error

	// socketDone is closed when the socket's accept loop has ended;
	// socketErr is why, if not because the listener was closed.
	socketDone chan struct{}
	socketErr  error
}

// errClosed is what Accept returns once the listener is closed; it wraps
// net.ErrClosed, which http.Server takes as the end of Serve.
var errClosed = fmt.Errorf("lbx_handoff: %w", net.ErrClosed)

// Accept returns the next connection accepted on any socket of this
// address, while this listener is the newest; an older one waits until it
// is closed or is the newest again (a newer config failed to start).
func (l *listener) Accept() (net.Conn, error) {
	for {
		newest, changed := l.hub.newest()
		var take chan accepted // nil, never ready, unless this is the newest
		if newest == l {
			take = l.hub.conns
		}
		select {
		case a := <-take:
			select {
			case <-l.closed:
				// Closed as it was taken: the next config serves it.
				go l.hub.put(a)
				return nil, errClosed
			default:
			}
			if a.from != l {
				handedOver.Inc()
			}
			return &conn{Conn: a.conn, l: l, prefix: a.prefix}, nil
		case <-l.closed:
			return nil, errClosed
		case <-l.socketDone:
			if l.socketErr != nil {
				return nil, l.socketErr
			}
			return nil, errClosed
		case <-changed:
		}
	}
}

// Close leaves the hub, so that the newer listener (or, after a failed
// reload, the older one) takes what the sockets accept, then closes this
// listener's socket.
func (l *listener) Close() error {
	l.closeOnce.Do(func() {
		close(l.closed)
		l.hub.detach(l)
		// The accept loop ends with the socket; it is not waited for, as
		// it may be handing a last connection to a listener that has not
		// begun to serve yet.
		l.closeErr = l.Listener.Close()
	})
	return l.closeErr
}

// acceptLoop accepts from the socket into the hub until the socket is
// closed or fails. Temporary errors (too many open files) are retried
// after a pause, as http.Server does.
func (l *listener) acceptLoop() {
	defer close(l.socketDone)
	var pause time.Duration
	for {
		c, err := l.Listener.Accept()
		if err == nil {
			pause = 0
			l.hub.put(accepted{conn: c, from: l})
			// A socket that other configs share (Caddy reuses a Unix
			// socket) stays open after this listener closes: leave it
			// to their loops.
			select {
			case <-l.closed:
				return
			default:
			}
			continue
		}
		select {
		case <-l.closed:
			return
		default:
		}
		// Temporary is deprecated, but it is still how accept reports
		// EMFILE and ECONNABORTED.
		var ne net.Error
		if errors.Is(err, net.ErrClosed) || !errors.As(err, &ne) || !ne.Timeout() && !ne.Temporary() {
			// This listener's server stops serving when Accept
			// returns the error: the other listeners take over.
			l.socketErr = err
			l.hub.detach(l)
			return
		}
		pause = min(max(2*pause, 5*time.Millisecond), time.Second)
		select {
		case <-time.After(pause):
		case <-l.closed:
			return
		}
	}
}
