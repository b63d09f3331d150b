package partition

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"
)

// LineError is a line of a naming file that was skipped.
type LineError struct {
	File string
	Line int
	Err  error
}

func (e LineError) Error() string { return fmt.Sprintf("%s:%d: %v", e.File, e.Line, e.Err) }

// ParseNamingFile parses a naming file in brpc's format: one upstream per
// line, "address tag", where the tag is "N/M"; everything from '#' to the
// end of a line is a comment, and blank lines are ignored:
//
//	# partition scheme of 3
//	10.0.0.1:8004  0/3   # first of three
//	10.0.0.2:8004  1/3
//
// Lines that cannot be parsed are returned as LineErrors (name is used
// only in their messages) and left out; duplicate (address, tag) pairs
// collapse into one, keeping the first.
func ParseNamingFile(name string, data []byte) ([]Entry, []LineError) {
	var (
		entries []Entry
		bad     []LineError
		seen    = make(map[Entry]bool)
	)
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), 64*1024)
	line := 0
	for sc.Scan() {
		line++
		text := sc.Text()
		if i := strings.IndexByte(text, '#'); i >= 0 {
			text = text[:i]
		}
		fields := strings.Fields(text)
		if len(fields) == 0 {
			continue
		}
		e, err := parseEntry(fields)
		if err != nil {
			bad = append(bad, LineError{File: name, Line: line, Err: err})
			continue
		}
		if !seen[e] {
			seen[e] = true
			entries = append(entries, e)
		}
	}
	if err := sc.Err(); err != nil {
		bad = append(bad, LineError{File: name, Line: line + 1, Err: err})
	}
	return entries, bad
}

func parseEntry(fields []string) (Entry, error) {
	switch len(fields) {
	case 1:
		return Entry{}, fmt.Errorf("upstream %q has no partition tag; want \"address N/M\"", fields[0])
	case 2:
	default:
		return Entry{}, fmt.Errorf("want \"address N/M\", got %d fields: %q", len(fields), strings.Join(fields, " "))
	}
	if _, err := checkDial(fields[0]); err != nil {
		return Entry{}, err
	}
	tag, err := ParseTag(fields[1])
	if err != nil {
		return Entry{}, err
	}
	return Entry{Dial: fields[0], Tag: tag}, nil
}

// fileStamp is what tells a naming file changed without reading it.
type fileStamp struct {
	mod  time.Time
	size int64
}

// namingWatcher polls a naming file and hands every new, valid version of
// its entries to apply. A change is picked up within two poll intervals.
// It runs in one goroutine; its state is not shared.
type namingWatcher struct {
	path   string
	every  time.Duration
	logger *zap.Logger
	// apply installs a new version of the file's entries; an error means
	// the version was rejected and the previous one stays.
	apply func([]Entry) error

	stamp   fileStamp // of the last version read
	pending fileStamp // of a change seen but not read yet
	content []byte    // the last version parsed
	// rejected is why apply refused the last version parsed ("" if not).
	rejected string
	// problem is the last reason the file could not be used, logged once
	// when it appears and cleared (with a log line) when the file is good.
	problem string
}

// load reads the file if it changed since the last load. It returns an
// error only when the file could not be used (unreadable, or rejected by
// apply); the previous entries then stay in effect. A version is parsed
// (and its bad lines logged) once.
func (w *namingWatcher) load() error {
	info, err := os.Stat(w.path)
	if err != nil {
		return w.fail(describeFileError(err))
	}
	if !info.Mode().IsRegular() {
		return w.fail("not a regular file")
	}
	stamp := fileStamp{mod: info.ModTime(), size: info.Size()}
	if w.content != nil {
		if stamp == w.stamp {
			return w.same()
		}
		// A changed file is read once it has kept the same modification
		// time and size for one poll interval, so a file being written in
		// place (truncated, then filled) is not read half-written.
		if stamp != w.pending {
			w.pending = stamp
			return nil
		}
	}
	data, err := os.ReadFile(w.path)
	if err != nil {
		return w.fail(describeFileError(err))
	}
	w.stamp = stamp
	if w.content != nil && bytes.Equal(data, w.content) {
		return w.same()
	}
	w.content = data
	entries, bad := ParseNamingFile(w.path, data)
	for _, le := range bad {
		w.logger.Warn("skipping naming file line", zap.String("file", le.File), zap.Int("line", le.Line), zap.Error(le.Err))
	}
	if err := w.apply(entries); err != nil {
		w.rejected = err.Error()
		return w.fail(w.rejected)
	}
	w.rejected = ""
	w.recovered()
	w.logger.Info("loaded naming file",
		zap.String("file", w.path),
		zap.Int("upstreams", len(entries)),
		zap.Int("skipped_lines", len(bad)))
	return nil
}

// same handles a file whose content did not change since the last load.
func (w *namingWatcher) same() error {
	if w.rejected != "" {
		return w.fail(w.rejected)
	}
	w.recovered()
	return nil
}

func (w *namingWatcher) recovered() {
	if w.problem != "" {
		w.logger.Info("naming file usable again", zap.String("file", w.path))
		w.problem = ""
	}
}

// fail logs why the file is not used, once per distinct reason.
func (w *namingWatcher) fail(why string) error {
	if why != w.problem {
		w.logger.Error("naming file not used; keeping the last good upstream list",
			zap.String("file", w.path), zap.String("reason", why))
		w.problem = why
	}
	return fmt.Errorf("naming file %s: %s", w.path, why)
}

func describeFileError(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "file does not exist (deleted?)"
	case errors.Is(err, fs.ErrPermission):
		return "permission denied"
	}
	return err.Error()
}

// run polls until done is closed. It recovers from panics so a bug here
// cannot take the server down; the last good list then stays in effect.
func (w *namingWatcher) run(done <-chan struct{}) {
	defer func() {
		if r := recover(); r != nil {
			w.logger.Error("naming file watcher panicked; the upstream list will no longer be updated",
				zap.String("file", w.path), zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	t := time.NewTicker(w.every)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			_ = w.load()
		}
	}
}
