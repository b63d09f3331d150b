// Package adminjson serves lbx's read-only views on Caddy's admin
// endpoint, all in one way: GET only, indented JSON.
package adminjson

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
)

// Handler returns an admin handler that answers GET with build's result
// as indented JSON, built anew for every request, and refuses other
// methods.
func Handler[T any](build func() T) caddy.AdminHandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		if r.Method != http.MethodGet {
			return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
		}
		return Write(w, http.StatusOK, build())
	}
}

// Write answers v as indented JSON with status: the form of every lbx
// admin answer, views and operations alike.
func Write(w http.ResponseWriter, status int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
