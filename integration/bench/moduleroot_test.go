package main

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

// TestModuleRoot checks that the benchmark finds the plugin's module, the
// parent of the nested one it belongs to: where ./cmd/caddy is built and
// the default plot path starts. It does so through the go command and,
// with no go command on PATH, by walking up to the plugin's go.mod.
func TestModuleRoot(t *testing.T) {
	check := func(how string) {
		t.Helper()
		root, err := moduleRoot(context.Background())
		if err != nil {
			t.Fatalf("%s: %v", how, err)
		}
		if !declaresModule(filepath.Join(root, "go.mod"), lbxModule) {
			t.Fatalf("%s: %s is not the root of %s", how, root, lbxModule)
		}
		if _, err := os.Stat(filepath.Join(root, "cmd", "caddy", "main.go")); err != nil {
			t.Fatalf("%s: %s has no cmd/caddy: %v", how, root, err)
		}
	}
	check("with the go command")
	t.Setenv("PATH", "")
	check("without the go command")
}
