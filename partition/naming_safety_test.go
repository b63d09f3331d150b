package partition

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// writeInPlace overwrites path's content without a rename, as a careless
// writer does, moving its modification time on so the change is seen on
// file systems with coarse clocks.
func writeInPlace(t *testing.T, path string, data []byte) {
	t.Helper()
	info, statErr := os.Stat(path)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if statErr == nil {
		next := info.ModTime().Add(time.Second)
		if err := os.Chtimes(path, next, next); err != nil {
			t.Fatal(err)
		}
	}
}

// listOf returns a naming file of n upstreams of a 4-partition scheme.
func listOf(n, port int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "127.0.0.%d:%d %d/4\n", 1+i/4, port, i%4)
	}
	return b.String()
}

// safetyWatcher is a watcher of a fresh naming file holding good, already
// loaded, that records what it applies.
type safetyWatcher struct {
	*namingWatcher
	path    string
	logs    *observer.ObservedLogs
	mu      sync.Mutex
	applied [][]Entry
}

func newSafetyWatcher(t *testing.T, good string, maxRemoved float64) *safetyWatcher {
	t.Helper()
	path := filepath.Join(t.TempDir(), "server_list")
	writeFile(t, path, good)
	core, logs := observer.New(zapcore.DebugLevel)
	sw := &safetyWatcher{path: path, logs: logs}
	sw.namingWatcher = &namingWatcher{
		path:       path,
		every:      5 * time.Millisecond,
		logger:     zap.New(core),
		maxRemoved: maxRemoved,
		apply: func(es []Entry) error {
			sw.mu.Lock()
			sw.applied = append(sw.applied, es)
			sw.mu.Unlock()
			return nil
		},
	}
	if err := sw.load(); err != nil {
		t.Fatalf("loading the good list: %v", err)
	}
	return sw
}

// last returns the entries applied last and how many versions were.
func (sw *safetyWatcher) last() ([]Entry, int) {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	return sw.applied[len(sw.applied)-1], len(sw.applied)
}

// poll loads twice: a change is read once it was stable for a poll.
func (sw *safetyWatcher) poll() error {
	_ = sw.load()
	return sw.load()
}

// randomBytes returns n bytes from a fixed seed (they do not end with a
// newline).
func randomBytes(n int) []byte {
	b := make([]byte, n)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

func rejected(reason string) float64 {
	return testutil.ToFloat64(namingRejected.WithLabelValues(reason))
}

// TestNamingFileBadVersionsKeepLastGood: each kind of bad version is not
// applied; the last good list stays, and the refusal is logged and counted
// once, however often the same version is polled.
func TestNamingFileBadVersionsKeepLastGood(t *testing.T) {
	good := listOf(8, 8004)
	random := randomBytes(64 << 10)
	noValid := strings.Repeat("not an upstream line\n# a comment\n10.0.0.1:80\n", 100)
	for _, tc := range []struct {
		name, reason string
		data         []byte
	}{
		{"truncated to 0 bytes", rejectNoValidLine, nil},
		{"64 KiB of random bytes", rejectIncomplete, random},
		{"random bytes ending in a newline", rejectNoValidLine, append(random[:len(random)-1:len(random)-1], '\n')},
		{"text with no valid line", rejectNoValidLine, []byte(noValid)},
		{"truncated mid-line", rejectIncomplete, []byte(good[:len(good)-5])},
		{"truncated mid-line, losing most lines", rejectIncomplete, []byte(good[:30])},
		{"a writer paused after the first line", rejectRemovesTooMany, []byte(good[:strings.IndexByte(good, '\n')+1])},
		{"removes more than half", rejectRemovesTooMany, []byte(listOf(3, 8004) + listOf(8, 9000))},
		{"comments only", rejectNoValidLine, []byte("# nothing here\n\n")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sw := newSafetyWatcher(t, good, DefaultNamingMaxRemovedPercent)
			before := rejected(tc.reason)
			writeInPlace(t, sw.path, tc.data)
			for i := range 3 {
				if err := sw.poll(); err == nil {
					t.Fatalf("poll %d: the bad version was accepted", i)
				}
			}
			if es, n := sw.last(); n != 1 || len(es) != 8 {
				t.Fatalf("applied %d versions, the last of %d upstreams; want the good list of 8 kept", n, len(es))
			}
			if got := rejected(tc.reason) - before; got != 1 {
				t.Errorf("counted %v refusals for reason %s; want 1", got, tc.reason)
			}
			refusals := sw.logs.FilterMessage("naming file not used; keeping the last good upstream list").All()
			if len(refusals) != 1 {
				t.Fatalf("refusal logged %d times; want once", len(refusals))
			}
			if c := refusals[0].ContextMap(); c["kind"] != tc.reason || c["file"] != sw.path || c["reason"] == "" {
				t.Errorf("refusal log %v; want kind %s, the reason and the file", c, tc.reason)
			}
			// A good version after the bad one is applied again.
			writeInPlace(t, sw.path, []byte(listOf(8, 8004)+listOf(4, 8005)))
			if err := sw.poll(); err != nil {
				t.Fatalf("good version after a bad one: %v", err)
			}
			if es, n := sw.last(); n != 2 || len(es) != 12 {
				t.Errorf("applied %d versions, the last of %d upstreams; want the new list of 12", n, len(es))
			}
		})
	}
}

// TestNamingFilePartialWrite: a writer that pauses after the first line
// leaves a version that is refused; once it finishes, its file is applied.
func TestNamingFilePartialWrite(t *testing.T) {
	sw := newSafetyWatcher(t, listOf(8, 8004), DefaultNamingMaxRemovedPercent)
	next := listOf(8, 8004) + listOf(4, 8005)
	f, err := os.OpenFile(sw.path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	step := func(s string) {
		t.Helper()
		if _, err := f.WriteString(s); err != nil {
			t.Fatal(err)
		}
		info, _ := os.Stat(sw.path)
		// Coarse clocks: each step must look like a change.
		next := info.ModTime().Add(time.Second)
		if err := os.Chtimes(sw.path, next, next); err != nil {
			t.Fatal(err)
		}
	}
	// Mid first line, then the first line only: both stable for polls.
	step(next[:10])
	if err := sw.poll(); err == nil || !strings.Contains(err.Error(), "does not end with a newline") {
		t.Fatalf("half a line: %v", err)
	}
	step(next[10 : strings.IndexByte(next, '\n')+1])
	if err := sw.poll(); err == nil || !strings.Contains(err.Error(), "would remove 7 of the 8") {
		t.Fatalf("first line only: %v", err)
	}
	if _, n := sw.last(); n != 1 {
		t.Fatalf("a partial version was applied")
	}
	step(next[strings.IndexByte(next, '\n')+1:])
	if err := sw.poll(); err != nil {
		t.Fatalf("the finished file: %v", err)
	}
	if es, n := sw.last(); n != 2 || len(es) != 12 || es[11].Dial != "127.0.0.1:8005" {
		t.Errorf("finished file not applied: %d versions, last %v", n, es)
	}
}

// TestNamingFileRemovalShare: a version may remove up to the configured
// share of the applied upstreams; more is refused until given in steps or
// allowed by a higher share.
func TestNamingFileRemovalShare(t *testing.T) {
	sw := newSafetyWatcher(t, listOf(10, 8004), 30)
	lines := strings.SplitAfter(listOf(10, 8004), "\n")
	// Remove 3 of 10 (30%): allowed; then 3 of the 7 left (43%): refused.
	writeInPlace(t, sw.path, []byte(strings.Join(lines[3:], "")))
	if err := sw.poll(); err != nil {
		t.Fatalf("removing 30%%: %v", err)
	}
	if es, _ := sw.last(); len(es) != 7 {
		t.Fatalf("applied %d upstreams; want 7", len(es))
	}
	before := rejected(rejectRemovesTooMany)
	writeInPlace(t, sw.path, []byte(strings.Join(lines[6:], "")))
	if err := sw.poll(); err == nil || !strings.Contains(err.Error(), "would remove 3 of the 7 upstreams applied (42.9%), more than naming_max_removed_percent 30%") {
		t.Fatalf("removing 43%%: %v", err)
	}
	if got := rejected(rejectRemovesTooMany) - before; got != 1 {
		t.Errorf("counted %v; want 1", got)
	}
	// Additions never count against the share.
	writeInPlace(t, sw.path, []byte(strings.Join(lines[3:], "")+listOf(40, 9000)))
	if err := sw.poll(); err != nil {
		t.Fatalf("adding: %v", err)
	}
	// 100% allows replacing everything at once.
	sw.maxRemoved = 100
	writeInPlace(t, sw.path, []byte(listOf(2, 7000)))
	if err := sw.poll(); err != nil {
		t.Fatalf("replacing all at 100%%: %v", err)
	}
	if es, _ := sw.last(); len(es) != 2 {
		t.Errorf("applied %d upstreams; want 2", len(es))
	}
}

// TestNamingFileExplicitEmpty: an empty list is applied when, and only
// when, a line "# lbx:empty" says it is meant.
func TestNamingFileExplicitEmpty(t *testing.T) {
	sw := newSafetyWatcher(t, listOf(8, 8004), DefaultNamingMaxRemovedPercent)
	writeInPlace(t, sw.path, []byte("# lbx:empty\n"))
	if err := sw.poll(); err != nil {
		t.Fatalf("explicitly empty: %v", err)
	}
	if es, n := sw.last(); n != 2 || len(es) != 0 {
		t.Fatalf("applied %d versions, the last of %d upstreams; want an empty one", n, len(es))
	}
	// From empty, any list may come back; the marker does not hide
	// upstreams listed with it.
	writeInPlace(t, sw.path, []byte("#lbx:empty\n"+listOf(2, 8004)))
	if err := sw.poll(); err != nil {
		t.Fatal(err)
	}
	if es, _ := sw.last(); len(es) != 2 {
		t.Errorf("applied %d upstreams; want 2", len(es))
	}
	// The marker must be a comment line of its own.
	for _, data := range []string{"# lbx:empty please\n", "x # lbx:empty\n", "# not lbx:empty\n"} {
		v := parseNaming("f", []byte(data))
		if v.empty {
			t.Errorf("%q is taken for the empty marker", data)
		}
	}
}

// TestNamingFileLongLine: a line over 64 KiB is an error for that line
// alone; the lines after it are parsed.
func TestNamingFileLongLine(t *testing.T) {
	data := "127.0.0.1:8004 0/2\n" + strings.Repeat("x", 70000) + "\n127.0.0.1:8004 1/2\n127.0.0.2:8004 " + strings.Repeat("9", 300) + "\n127.0.0.3:8004 1/2\n"
	entries, bad := ParseNamingFile("server_list", []byte(data))
	if len(entries) != 3 || entries[1].Tag.Index != 1 || entries[2].Dial != "127.0.0.3:8004" {
		t.Fatalf("entries %v; want the three valid lines around the long ones", entries)
	}
	if len(bad) != 2 || bad[0].Line != 2 || bad[1].Line != 4 {
		t.Fatalf("bad lines %v; want lines 2 and 4", bad)
	}
	if msg := bad[0].Error(); !strings.HasPrefix(msg, "server_list:2: line of 70000 bytes, longer than the limit of 65536") {
		t.Errorf("long line error %q", msg)
	}
	if msg := bad[1].Error(); len(msg) > 200 {
		t.Errorf("error message of %d bytes quotes the long field", len(msg))
	}

	// Through the watcher: applied without the long line, which is logged.
	sw := newSafetyWatcher(t, "127.0.0.1:8004 0/2\n127.0.0.1:8004 1/2\n", DefaultNamingMaxRemovedPercent)
	writeInPlace(t, sw.path, []byte(data))
	if err := sw.poll(); err != nil {
		t.Fatal(err)
	}
	if es, n := sw.last(); n != 2 || len(es) != 3 {
		t.Errorf("applied %d versions, the last %v", n, es)
	}
	warn := sw.logs.FilterMessage("skipping naming file line").All()
	if len(warn) != 2 || warn[0].ContextMap()["line"] != int64(2) {
		t.Errorf("bad line logs %v", warn)
	}
}

// TestNamingFileTooLarge: a file over 64 MiB is not read at all.
func TestNamingFileTooLarge(t *testing.T) {
	sw := newSafetyWatcher(t, listOf(4, 8004), DefaultNamingMaxRemovedPercent)
	before := rejected(rejectTooLarge)
	if err := os.Truncate(sw.path, maxNamingFileSize+1); err != nil { // sparse: no disk used
		t.Fatal(err)
	}
	for range 3 {
		if err := sw.poll(); err == nil || !strings.Contains(err.Error(), "more than 67108864 bytes") {
			t.Fatalf("too large: %v", err)
		}
	}
	if got := rejected(rejectTooLarge) - before; got != 1 {
		t.Errorf("counted %v; want 1", got)
	}
	if _, n := sw.last(); n != 1 {
		t.Error("a too large file changed the list")
	}
	writeFile(t, sw.path, listOf(4, 8004)+listOf(1, 8005))
	if err := sw.poll(); err != nil {
		t.Fatalf("good version after a too large one: %v", err)
	}
}

// TestNamingFileLogsBoundedBadLines: a version of many bad lines logs a
// few of them and a count of the rest.
func TestNamingFileLogsBoundedBadLines(t *testing.T) {
	sw := newSafetyWatcher(t, listOf(4, 8004), DefaultNamingMaxRemovedPercent)
	writeInPlace(t, sw.path, []byte(listOf(4, 8004)+strings.Repeat("bad\n", 5000)))
	if err := sw.poll(); err != nil {
		t.Fatal(err)
	}
	if n := sw.logs.FilterMessage("skipping naming file line").Len(); n != maxLoggedLines {
		t.Errorf("%d bad lines logged one by one; want %d", n, maxLoggedLines)
	}
	more := sw.logs.FilterMessage("skipping more naming file lines").All()
	if len(more) != 1 || more[0].ContextMap()["lines"] != int64(5000-maxLoggedLines) {
		t.Errorf("summary %v", more)
	}
}

// TestNamingFileEditsDuringApplyCoalesce: versions written while an apply
// runs are not lost: the latest is applied after it, the ones in between
// are skipped.
func TestNamingFileEditsDuringApplyCoalesce(t *testing.T) {
	sw := newSafetyWatcher(t, listOf(4, 8004), 100)
	inApply, release := make(chan struct{}), make(chan struct{})
	apply := sw.apply
	var once sync.Once
	sw.apply = func(es []Entry) error {
		once.Do(func() {
			close(inApply)
			<-release
		})
		return apply(es)
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		sw.run(done)
	}()
	defer func() {
		close(done)
		<-stopped
	}()

	writeFile(t, sw.path, listOf(4, 8005))
	select {
	case <-inApply:
	case <-time.After(10 * time.Second):
		t.Fatal("the edit was not picked up")
	}
	// While it applies: two more versions.
	writeFile(t, sw.path, listOf(4, 8006))
	writeFile(t, sw.path, listOf(4, 8007))
	close(release)
	waitFor(t, 10*time.Second, "the latest version", func() (bool, string) {
		es, n := sw.last()
		return es[0].Dial == "127.0.0.1:8007", fmt.Sprintf("%d versions, last %v", n, es[0].Dial)
	})
	sw.mu.Lock()
	defer sw.mu.Unlock()
	for _, es := range sw.applied {
		if es[0].Dial == "127.0.0.1:8006" {
			t.Errorf("a version superseded during the apply was applied")
		}
	}
}

// TestInstallDropsAddressesThatLeft: as a naming file's list churns, the
// handler holds references only on the addresses it lists, and addresses
// that stay keep their state.
func TestInstallDropsAddressesThatLeft(t *testing.T) {
	h := &Handler{hosts: hoststate.NewTable(hoststate.Config{})}
	defer h.hosts.Release()
	stable := Entry{Dial: "127.0.0.1:1", Tag: Tag{0, 1}}
	if err := h.install([]Entry{stable}); err != nil {
		t.Fatal(err)
	}
	st := h.current.Load().byAddr[stable.Dial].stats
	for round := range 20 {
		es := []Entry{stable}
		for i := range 50 {
			es = append(es, Entry{Dial: fmt.Sprintf("127.0.%d.%d:2", round, i), Tag: Tag{0, 1}})
		}
		if err := h.install(es); err != nil {
			t.Fatal(err)
		}
		if n := h.hosts.Len(); n != 51 {
			t.Fatalf("round %d: the handler holds %d addresses; want the 51 listed", round, n)
		}
	}
	if n := hoststate.References("127.0.0.0:2"); n != 0 {
		t.Errorf("an address that left the list has %d references", n)
	}
	if got := h.current.Load().byAddr[stable.Dial].stats; got != st || hoststate.References(stable.Dial) != 1 {
		t.Error("the address that stayed lost its state")
	}
}

func TestNamingMaxRemovedPercentOption(t *testing.T) {
	for in, want := range map[string]float64{"30": 30, "30%": 30, "100": 100, "0.5%": 0.5} {
		h := new(Handler)
		d := caddyfile.NewTestDispenser("partition {\n\tnaming_file list\n\tnaming_max_removed_percent " + in + "\n}")
		if err := h.UnmarshalCaddyfile(d); err != nil || h.NamingMaxRemovedPercent != want {
			t.Errorf("%q: %v, %v; want %v", in, h.NamingMaxRemovedPercent, err, want)
		}
	}
	for in, want := range map[string]string{
		"naming_file list\n\tnaming_max_removed_percent 0":                                   "naming_max_removed_percent 0 is out of range: want a percentage above 0 and at most 100, at Testfile:3",
		"naming_file list\n\tnaming_max_removed_percent -1":                                  "naming_max_removed_percent -1 is out of range",
		"naming_file list\n\tnaming_max_removed_percent 101%":                                "naming_max_removed_percent 101 is out of range",
		"naming_file list\n\tnaming_max_removed_percent NaN":                                 "naming_max_removed_percent NaN is out of range",
		"naming_file list\n\tnaming_max_removed_percent half":                                `partition: naming_max_removed_percent "half": want a percentage such as 50%, at Testfile:3`,
		"naming_file list\n\tnaming_max_removed_percent":                                     "naming_max_removed_percent: missing value",
		"naming_file list\n\tnaming_max_removed_percent 10 20":                               `partition: naming_max_removed_percent: one value expected, got another: "20", at Testfile:3`,
		"naming_file list\n\tnaming_max_removed_percent 10\n\tnaming_max_removed_percent 20": "naming_max_removed_percent specified more than once, at Testfile:4",
		"to 127.0.0.1:1 0/1\n\tnaming_max_removed_percent 10":                                "naming_max_removed_percent is set without a naming_file",
	} {
		d := caddyfile.NewTestDispenser("partition {\n\t" + in + "\n}")
		if err := new(Handler).UnmarshalCaddyfile(d); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v; want %q", in, err, want)
		}
	}
	// JSON: the same rules, checked before the watcher starts.
	for _, tc := range []struct {
		h    *Handler
		want string
	}{
		{&Handler{NamingFile: "list", NamingMaxRemovedPercent: math.NaN()}, "naming_max_removed_percent NaN is out of range"},
		{&Handler{NamingFile: "list", NamingMaxRemovedPercent: math.Inf(1)}, "naming_max_removed_percent +Inf is out of range"},
		{&Handler{NamingFile: "list", NamingMaxRemovedPercent: -5}, "naming_max_removed_percent -5 is out of range"},
		{&Handler{NamingFile: "list", NamingMaxRemovedPercent: 100.5}, "naming_max_removed_percent 100.5 is out of range"},
		{&Handler{NamingMaxRemovedPercent: 20}, "naming_max_removed_percent 20 is set without a naming_file"},
		{&Handler{NamingFile: "list", NamingMaxRemovedPercent: 20}, ""},
		{&Handler{NamingFile: "list"}, ""},
	} {
		err := tc.h.checkNaming()
		if (tc.want == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v; want %q", tc.h.NamingMaxRemovedPercent, err, tc.want)
		}
	}
}
