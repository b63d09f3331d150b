package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// The -plot flags of bench gossip, fleetsim and rebalance write PNG files
// through these.

// isPNGPath reports whether path names a PNG file, by its extension.
func isPNGPath(path string) bool { return strings.EqualFold(filepath.Ext(path), ".png") }

// plotPath returns where a -plot flag's PNG file goes: path itself when
// absolute, else path under the lbx module's root (moduleRoot), so that
// docs/… lands in the repository's docs whatever the working directory.
// It returns "" for an empty path (no plot).
func plotPath(ctx context.Context, path string) (string, error) {
	if path == "" || filepath.IsAbs(path) {
		return path, nil
	}
	root, err := moduleRoot(ctx)
	if err != nil {
		return "", err
	}
	return filepath.Join(root, path), nil
}

// writePNGFile creates the file path, and its directory if missing, and
// draws into it with draw.
func writePNGFile(path string, draw func(io.Writer) error) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = draw(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}
