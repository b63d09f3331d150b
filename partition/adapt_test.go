package partition

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestAdapt adapts each testdata/*.caddyfiletest (a Caddyfile, a line of
// ten dashes, then the expected JSON or a substring of the expected
// error), as in Caddy's caddytest/integration/caddyfile_adapt and this
// repository's caddyfile package. Set PARTITION_GOLDEN_UPDATE=1 to
// rewrite the JSON expectations from the adapter's output.
func TestAdapt(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.caddyfiletest"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata/*.caddyfiletest files (%v)", err)
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".caddyfiletest"), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			input, want, ok := strings.Cut(string(data), "\n----------\n")
			if !ok {
				t.Fatal("no line of ten dashes")
			}
			want = strings.TrimSpace(want)
			got, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input+"\n"), nil)
			if want != "" && !strings.HasPrefix(want, "{") {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("error %v; want one containing %q", err, want)
				}
				return
			}
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			for _, w := range warnings {
				t.Errorf("warning: line %d: %s: %s", w.Line, w.Directive, w.Message)
			}
			var gotBuf bytes.Buffer
			if err := json.Indent(&gotBuf, got, "", "\t"); err != nil {
				t.Fatal(err)
			}
			if os.Getenv("PARTITION_GOLDEN_UPDATE") != "" {
				out := input + "\n----------\n" + gotBuf.String() + "\n"
				if err := os.WriteFile(file, []byte(out), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			var wantBuf bytes.Buffer
			if err := json.Indent(&wantBuf, []byte(want), "", "\t"); err != nil {
				t.Fatalf("expected JSON: %v", err)
			}
			if gotBuf.String() != wantBuf.String() {
				t.Errorf("adapted JSON differs\n--- got:\n%s\n--- want:\n%s", gotBuf.String(), wantBuf.String())
			}
		})
	}
}

// TestUnmarshalCaddyfileDirect checks the unmarshaler on its own, without
// the HTTP Caddyfile adapter around it.
func TestUnmarshalCaddyfileDirect(t *testing.T) {
	d := caddyfile.NewTestDispenser(`partition {
		to 10.0.0.1:80 0/2 10.0.0.2:80 1/2
		to 10.0.0.1:80 0/2
		fail_limit 2
		merge first
		lb_retries 3
	}`)
	var h Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if len(h.Upstreams) != 3 || h.FailLimit != 2 || h.Proxy == nil || h.Proxy.LoadBalancing.Retries != 3 {
		t.Errorf("upstreams %v fail_limit %d proxy %+v", h.Upstreams, h.FailLimit, h.Proxy)
	}
	if string(h.MergeRaw) != `{"merger":"first"}` {
		t.Errorf("merge %s", h.MergeRaw)
	}
}
