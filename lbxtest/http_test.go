package lbxtest

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// resettingServer answers POST /load with 200 and the body it read, except
// that its first drops connections are reset before any answer, as a
// listener Caddy is closing does. It counts attempts and the ones that
// asked for a connection of their own.
type resettingServer struct {
	*httptest.Server
	drops            int32
	attempts, closes atomic.Int32
}

func newResettingServer(t *testing.T, drops int32) *resettingServer {
	s := &resettingServer{drops: drops}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.attempts.Add(1)
		if r.Close {
			s.closes.Add(1)
		}
		body, _ := io.ReadAll(r.Body)
		if n <= s.drops {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err != nil {
				t.Errorf("hijack: %v", err)
				return
			}
			conn.(*net.TCPConn).SetLinger(0) // close with RST
			conn.Close()
			return
		}
		if r.Method != http.MethodPost || r.URL.Path != "/load" || r.Header.Get("Content-Type") != "text/caddyfile" {
			http.Error(w, "wrong request "+r.Method+" "+r.URL.Path, http.StatusBadRequest)
			return
		}
		w.Write(body)
	}))
	t.Cleanup(s.Close)
	return s
}

func TestPostLoadSendsAgainAfterAReset(t *testing.T) {
	s := newResettingServer(t, 2)
	status, answer, err := PostLoad(http.DefaultClient, s.URL, "text/caddyfile", []byte("cfg"))
	if err != nil || status != http.StatusOK || string(answer) != "cfg" {
		t.Fatalf("PostLoad: %d %q %v; want 200 \"cfg\" on the third attempt", status, answer, err)
	}
	if a, c := s.attempts.Load(), s.closes.Load(); a != 3 || c != 3 {
		t.Errorf("%d attempts, %d of them on a connection of their own; want 3 and 3", a, c)
	}
}

func TestPostLoadGivesUpAfterThreeResets(t *testing.T) {
	s := newResettingServer(t, 100)
	_, _, err := PostLoad(http.DefaultClient, s.URL, "text/caddyfile", []byte("cfg"))
	if err == nil || !strings.Contains(err.Error(), "reset") && !strings.Contains(err.Error(), "EOF") {
		t.Fatalf("PostLoad against a server that always resets: %v; want the reset", err)
	}
	if a := s.attempts.Load(); a != 3 {
		t.Errorf("%d attempts; want 3", a)
	}
}

func TestPostLoadDoesNotResendAnAnswer(t *testing.T) {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "bad config", http.StatusBadRequest)
	}))
	t.Cleanup(s.Close)
	status, answer, err := PostLoad(http.DefaultClient, s.URL, "text/caddyfile", []byte("cfg"))
	if err != nil || status != http.StatusBadRequest || !strings.Contains(string(answer), "bad config") {
		t.Fatalf("PostLoad: %d %q %v; want 400 with the server's error", status, answer, err)
	}
}
