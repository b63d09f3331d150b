package partition

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// writeFile replaces path's content atomically (write, then rename), with
// a modification time that differs from the previous one.
func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(path); err == nil {
		// Coarse file system clocks: make sure the time moves.
		next := info.ModTime().Add(time.Second)
		if err := os.Chtimes(tmp, next, next); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestNamingWatcher(t *testing.T) {
	path := filepath.Join(t.TempDir(), "server_list")
	writeFile(t, path, "127.0.0.1:8004 0/1\n")
	core, logs := observer.New(zapcore.DebugLevel)
	var applied [][]Entry
	var reject string
	w := &namingWatcher{
		path:       path,
		logger:     zap.New(core),
		maxRemoved: 100, // each version here replaces the last one
		apply: func(es []Entry) error {
			if reject != "" {
				return errString(reject)
			}
			applied = append(applied, es)
			return nil
		},
	}
	last := func() []Entry { return applied[len(applied)-1] }

	if err := w.load(); err != nil || len(applied) != 1 || last()[0].Dial != "127.0.0.1:8004" {
		t.Fatalf("initial load: %v, %v", err, applied)
	}
	if err := w.load(); err != nil || len(applied) != 1 {
		t.Fatalf("unchanged file re-applied: %v, %d", err, len(applied))
	}

	// A change is applied once it has been stable for one poll.
	writeFile(t, path, "127.0.0.1:8005 0/2\nbad line here\n127.0.0.1:8005 1/2\n")
	if err := w.load(); err != nil || len(applied) != 1 {
		t.Fatalf("change applied before it was stable: %v, %d", err, len(applied))
	}
	if err := w.load(); err != nil || len(applied) != 2 || len(last()) != 2 {
		t.Fatalf("stable change not applied: %v, %v", err, applied)
	}
	warn := logs.FilterMessage("skipping naming file line").All()
	if len(warn) != 1 || warn[0].ContextMap()["line"] != int64(2) || warn[0].ContextMap()["file"] != path {
		t.Errorf("bad line log: %+v", warn)
	}

	// Deleted: the last good list stays; the reason is logged once.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := w.load(); err == nil || !strings.Contains(err.Error(), "does not exist") {
			t.Fatalf("deleted file: %v", err)
		}
	}
	if n := logs.FilterMessage("naming file not used; keeping the last good upstream list").Len(); n != 1 {
		t.Errorf("deletion logged %d times; want once", n)
	}
	if len(applied) != 2 {
		t.Errorf("deletion changed the list")
	}

	// Back, and rejected by apply (say, too many schemes): kept, logged.
	writeFile(t, path, "127.0.0.1:8006 0/1\n")
	reject = "too many schemes"
	_ = w.load()
	if err := w.load(); err == nil || !strings.Contains(err.Error(), "too many schemes") {
		t.Fatalf("rejected version: %v", err)
	}
	if err := w.load(); err == nil {
		t.Fatal("the same rejected version must stay rejected")
	}
	reject = ""
	writeFile(t, path, "127.0.0.1:8007 0/1\n")
	_ = w.load()
	if err := w.load(); err != nil || last()[0].Dial != "127.0.0.1:8007" {
		t.Fatalf("good version after a rejected one: %v, %v", err, applied)
	}
	if logs.FilterMessage("naming file usable again").Len() == 0 {
		t.Error("recovery not logged")
	}

	// A directory is not a naming file.
	w2 := &namingWatcher{path: t.TempDir(), logger: zap.NewNop(), apply: func([]Entry) error { return nil }}
	if err := w2.load(); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("directory: %v", err)
	}
}

type errString string

func (e errString) Error() string { return string(e) }
