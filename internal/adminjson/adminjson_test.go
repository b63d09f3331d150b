package adminjson

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestHandler: GET gets the view, built per request, as indented JSON;
// any other method is refused with 405 and builds nothing.
func TestHandler(t *testing.T) {
	builds := 0
	h := Handler(func() map[string]int { builds++; return map[string]int{"builds": builds} })
	for want := 1; want <= 2; want++ {
		rec := httptest.NewRecorder()
		if err := h(rec, httptest.NewRequest(http.MethodGet, "/lbx/x", nil)); err != nil {
			t.Fatal(err)
		}
		if got, wantBody := rec.Body.String(), "{\n  \"builds\": "+string(rune('0'+want))+"\n}\n"; got != wantBody {
			t.Errorf("body %q; want %q", got, wantBody)
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
			t.Errorf("Content-Type %q", ct)
		}
	}
	err := h(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/lbx/x", nil))
	var apiErr caddy.APIError
	if !errors.As(err, &apiErr) || apiErr.HTTPStatus != http.StatusMethodNotAllowed {
		t.Errorf("POST: %v; want 405", err)
	}
	if builds != 2 {
		t.Errorf("%d builds; want 2 (none for the POST)", builds)
	}
}
