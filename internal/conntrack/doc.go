// Package conntrack follows the connections of net/http servers and
// closes them gracefully when asked to shed some, for a node that hands
// its excess clients back to the outer load balancer. It knows nothing of
// Caddy's config or of the cluster: the rebalance package's Caddy modules
// are thin surfaces over it.
//
// The pieces:
//   - Tracker (conns.go): the connections of every server whose
//     ConnState and ConnContext hooks it is registered with, by state;
//     Shed (idle first, active ones at a response boundary, hijacked
//     streams last; idle HTTP/2 ones through a GOAWAY), which never closes
//     an HTTP/1 connection a request may be on (idle.go: a shed idle one
//     closes at its next response boundary, or once idle for a bound with
//     no request arriving), and Sweep, the per-interval pass that recounts
//     shed streams that never end and closes them at a boundary timeout;
//   - WrapResponseWriter (response.go): the HTTP layer of a graceful shed,
//     "Connection: close" on a shed connection's next response, and the
//     WebSocket frame follower that closes a shed WebSocket with a close
//     frame (wsclose.go);
//   - ByteCounters (listener.go): a listener whose connections count the
//     bytes read and written, keeping sendfile, half-close and the socket
//     reachable, and telling cleartext HTTP/2 connections by their preface.
package conntrack
