package rebalance

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-lbx/lbx/internal/conntrack"
)

// TestCloseHandlerWraps: on a connection the tracker knows, the handler
// hands next conntrack's writer, which adds "Connection: close" once the
// connection is shed (the behaviour itself is conntrack's to test).
func TestCloseHandlerWraps(t *testing.T) {
	tr := conntrack.NewTracker()
	c1, c2 := net.Pipe()
	defer c1.Close()
	defer c2.Close()
	req := httptest.NewRequest("GET", "/", nil).WithContext(tr.ConnContext(context.Background(), c1))
	tr.ConnState(c1, http.StateActive)
	if r := tr.Shed(1); r.Active != 1 {
		t.Fatalf("Shed(1) = %+v", r)
	}
	rec := httptest.NewRecorder()
	var h CloseHandler
	err := h.ServeHTTP(rec, req, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if w == http.ResponseWriter(rec) {
			t.Error("writer not wrapped on a tracked connection")
		}
		_, err := w.Write([]byte("ok"))
		return err
	}))
	if err != nil {
		t.Fatal(err)
	}
	if got := rec.Header().Get("Connection"); got != "close" {
		t.Errorf("shed connection: Connection %q; want close", got)
	}
}

// TestCloseHandlerUntracked: without a tracked connection (no rebalance
// app) and with the server not shutting down (no replacer says so), the
// handler passes the request through untouched.
func TestCloseHandlerUntracked(t *testing.T) {
	rec := &recorder{header: http.Header{}}
	var h CloseHandler
	err := h.ServeHTTP(rec, &http.Request{Header: http.Header{}, URL: nil}, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if w != http.ResponseWriter(rec) {
			t.Error("writer wrapped without a tracked connection")
		}
		return nil
	}))
	if err != nil {
		t.Fatal(err)
	}
}

// recorder is a minimal ResponseWriter.
type recorder struct{ header http.Header }

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) Write(p []byte) (int, error) { return len(p), nil }
func (r *recorder) WriteHeader(int)             {}

// TestCloseHandlerUnmarshal covers the directive's syntax.
func TestCloseHandlerUnmarshal(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"rebalance_close", ""},
		{"rebalance_close x", `unexpected argument "x"`},
		{"rebalance_close {\n a\n}", "unexpected block"},
	} {
		var h CloseHandler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%q: %v", tc.in, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%q: error %v; want %q", tc.in, err, tc.want)
		}
	}
}
