package lbxtest

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
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

// PostLoad posts body to Caddy's /load at admin (a base URL such as
// "http://localhost:2019") and returns the answer's status and body.
//
// Every load replaces Caddy's admin server. The old server's shutdown
// closes the kept-alive connections it had, and its listener (one of two
// SO_REUSEPORT sockets for a moment) resets the connections still queued on
// it. A POST caught by either fails with "connection reset by peer" or EOF
// and, not being idempotent, is not retried by net/http. So each attempt
// goes on a connection of its own, closed after the answer, and one that
// gets no answer for those reasons is sent again, up to 3 attempts in all.
// Sending a load again is safe: the server never read it, or read it and
// Caddy finds the config unchanged.
func PostLoad(client *http.Client, admin, contentType string, body []byte) (status int, answer []byte, err error) {
	for attempt := 1; attempt <= 3; attempt++ {
		var req *http.Request
		req, err = http.NewRequest(http.MethodPost, admin+"/load", bytes.NewReader(body))
		if err != nil {
			return 0, nil, err
		}
		req.Header.Set("Content-Type", contentType)
		req.Close = true
		var res *http.Response
		res, err = client.Do(req)
		if err == nil {
			defer res.Body.Close()
			answer, err = io.ReadAll(res.Body)
			return res.StatusCode, answer, err
		}
		if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
			break
		}
	}
	return 0, nil, err
}
