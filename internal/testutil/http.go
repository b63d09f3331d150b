package testutil

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
)

// NamedBackend starts an HTTP server on 127.0.0.1 that answers every
// request with its name, closed at the end of the test, and returns its
// port.
func NamedBackend(t testing.TB, name string) (port string) {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, name)
	}))
	t.Cleanup(srv.Close)
	_, port, _ = net.SplitHostPort(srv.Listener.Addr().String())
	return port
}
