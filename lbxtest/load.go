package lbxtest

import (
	"encoding/json"
	"runtime"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// MaxLoadAlloc is the most that validating one configuration may
// allocate. No option of ours sizes anything near it; a window or buffer
// sized by a hostile value blows far past it.
const MaxLoadAlloc = 256 << 20

// ValidateHostile runs a whole Caddy configuration through caddy.Validate
// (what `caddy validate` does, and what POST /load does before it starts
// anything: decode, provision and validate every module, then clean up).
// Errors are the expected outcome for most hostile inputs and are ignored;
// the test fails if validation panics (which the fuzzer reports by
// itself), allocates more than MaxLoadAlloc, or takes more than 10 s.
func ValidateHostile(t testing.TB, config []byte) {
	t.Helper()
	var cfg caddy.Config
	if json.Unmarshal(config, &cfg) != nil {
		return
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	_ = caddy.Validate(&cfg)
	took := time.Since(start)
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > MaxLoadAlloc {
		t.Fatalf("validating allocated %d MiB for a config of %d bytes: %s", n>>20, len(config), config)
	}
	if took > 10*time.Second {
		t.Fatalf("validating took %v: %s", took, config)
	}
}

// HandlerConfig returns a config whose one HTTP route runs handler, a
// handler module's JSON object.
func HandlerConfig(handler []byte) []byte {
	out := []byte(`{"admin":{"disabled":true},"apps":{"http":{"servers":{"fuzz":{"listen":["127.0.0.1:0"],"routes":[{"handle":[`)
	out = append(out, handler...)
	return append(out, `]}]}}}}}`...)
}
