package partition

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/metricsreg"
)

// LineError is a line of a naming file that was skipped.
type LineError struct {
	File string
	Line int
	Err  error
}

func (e LineError) Error() string { return fmt.Sprintf("%s:%d: %v", e.File, e.Line, e.Err) }

// Naming file limits and markers.
const (
	// DefaultNamingMaxRemovedPercent is the default of
	// Handler.NamingMaxRemovedPercent.
	DefaultNamingMaxRemovedPercent = 50.0
	// maxNamingFileSize bounds what is read of a naming file (some two
	// million lines), so a runaway writer cannot exhaust memory.
	maxNamingFileSize = 64 << 20
	// maxNamingLine is the longest line parsed; a valid one is far
	// shorter, so a longer one is an error for that line alone.
	maxNamingLine = 64 << 10
	// emptyMarker, as the text of a comment on its own line ("# lbx:empty"),
	// says that a version without upstreams is meant to be empty.
	emptyMarker = "lbx:empty"
	// maxLoggedLines bounds the bad lines logged per version; the rest
	// are counted in one line.
	maxLoggedLines = 10
)

// ParseNamingFile parses a naming file in brpc's format: one upstream per
// line, "address tag", where the tag is "N/M"; everything from '#' to the
// end of a line is a comment, and blank lines are ignored:
//
//	# partition scheme of 3
//	10.0.0.1:8004  0/3   # first of three
//	10.0.0.2:8004  1/3
//
// Lines that cannot be parsed, or are longer than 64 KiB, are returned as
// LineErrors (name is used only in their messages) and left out; the
// lines after them are still parsed. Duplicate (address, tag) pairs
// collapse into one, keeping the first.
func ParseNamingFile(name string, data []byte) ([]Entry, []LineError) {
	v := parseNaming(name, data)
	return v.entries, v.bad
}

// namingVersion is one parsed version of a naming file.
type namingVersion struct {
	entries []Entry
	set     map[Entry]bool // entries, for look-ups
	bad     []LineError
	lines   int
	// empty: a line "# lbx:empty" says an empty list is meant.
	empty bool
}

// parseNaming parses data in one pass, in time linear in its size.
func parseNaming(name string, data []byte) namingVersion {
	v := namingVersion{set: make(map[Entry]bool)}
	for len(data) > 0 {
		raw := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			raw, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		v.lines++
		if len(raw) > maxNamingLine {
			v.bad = append(v.bad, LineError{File: name, Line: v.lines,
				Err: fmt.Errorf("line of %d bytes, longer than the limit of %d; skipped", len(raw), maxNamingLine)})
			continue
		}
		text := raw
		if i := bytes.IndexByte(text, '#'); i >= 0 {
			if string(bytes.TrimSpace(text[:i])) == "" && string(bytes.TrimSpace(text[i+1:])) == emptyMarker {
				v.empty = true
			}
			text = text[:i]
		}
		fields := strings.Fields(string(text))
		if len(fields) == 0 {
			continue
		}
		e, err := parseEntry(fields)
		if err != nil {
			v.bad = append(v.bad, LineError{File: name, Line: v.lines, Err: err})
			continue
		}
		if !v.set[e] {
			v.set[e] = true
			v.entries = append(v.entries, e)
		}
	}
	return v
}

// maxNamingField is the longest address or tag accepted (a DNS name has at
// most 253 bytes); it also keeps error messages short.
const maxNamingField = 256

func parseEntry(fields []string) (Entry, error) {
	for _, f := range fields {
		if len(f) > maxNamingField {
			return Entry{}, fmt.Errorf("a field of %d bytes, longer than any address or tag (at most %d)", len(f), maxNamingField)
		}
	}
	switch len(fields) {
	case 1:
		return Entry{}, fmt.Errorf("upstream %q has no partition tag; want \"address N/M\"", fields[0])
	case 2:
	default:
		text := strings.Join(fields, " ")
		if len(text) > 80 {
			text = text[:80] + "..."
		}
		return Entry{}, fmt.Errorf("want \"address N/M\", got %d fields: %q", len(fields), text)
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

// Why a naming file version is not used: the reason label of
// caddy_lbx_partition_naming_rejected_total.
const (
	rejectUnreadable     = "unreadable"       // missing, not a regular file, no permission, I/O error
	rejectTooLarge       = "too_large"        // over maxNamingFileSize
	rejectIncomplete     = "incomplete"       // the last line has no newline
	rejectNoValidLine    = "no_valid_line"    // no upstream, and no "# lbx:empty"
	rejectRemovesTooMany = "removes_too_many" // over NamingMaxRemovedPercent
	rejectInvalid        = "invalid"          // the upstream list as a whole (e.g. too many schemes)
)

// namingRejected counts naming file versions not used, once per version
// and reason. It is package-level so counts survive reloads; every config
// registers it in its metrics registry.
var namingRejected = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "caddy_lbx_partition_naming_rejected_total",
	Help: "Naming file versions not applied (the last good upstream list stayed), by reason.",
}, []string{"reason"})

// registerNamingMetrics adds the naming file metrics to the config's
// metrics registry (the one Caddy's /metrics endpoints serve); registering
// again (another handler, a reload) is harmless.
func registerNamingMetrics(ctx caddy.Context) error { return metricsreg.Register(ctx, namingRejected) }

// checkNaming checks the naming file options.
func (h *Handler) checkNaming() error {
	p := h.NamingMaxRemovedPercent
	if p == 0 {
		return nil
	}
	if err := checkMaxRemovedPercent(p); err != nil {
		return err
	}
	if h.NamingFile == "" {
		return fmt.Errorf("naming_max_removed_percent %v is set without a naming_file", p)
	}
	return nil
}

// checkMaxRemovedPercent checks a value given for NamingMaxRemovedPercent.
func checkMaxRemovedPercent(p float64) error {
	if !(p > 0 && p <= 100) { // NaN too
		return fmt.Errorf("naming_max_removed_percent %v is out of range: want a percentage above 0 and at most 100", p)
	}
	return nil
}

// maxRemovedPercent is NamingMaxRemovedPercent with its default.
func (h *Handler) maxRemovedPercent() float64 {
	if h.NamingMaxRemovedPercent == 0 {
		return DefaultNamingMaxRemovedPercent
	}
	return h.NamingMaxRemovedPercent
}

// fileStamp is what tells a naming file changed without reading it.
type fileStamp struct {
	mod  time.Time
	size int64
}

// namingWatcher polls a naming file and hands every new, usable version of
// its entries to apply. A change is picked up within two poll intervals.
// It runs in one goroutine; its state is not shared. An apply blocks the
// polls, so edits made meanwhile are coalesced: the next poll after it
// reads the file as it is then, and the latest version wins.
type namingWatcher struct {
	path   string
	every  time.Duration
	logger *zap.Logger
	// maxRemoved is the largest share (percent) of the applied entries a
	// new version may remove.
	maxRemoved float64
	// apply installs a new version of the file's entries; an error means
	// the version was rejected and the previous one stays.
	apply func([]Entry) error

	stamp   fileStamp // of the last version read
	pending fileStamp // of a change seen but not read yet
	read    bool      // a version was read (or found too large)
	content []byte    // the last version read; nil if it was too large
	version int       // counts the distinct versions read
	// applied holds the entries of the last version applied; nil before
	// the first.
	applied []Entry
	// rejected is why the last version read was not applied (reason ""
	// if it was).
	rejected refusal
	// problem is the last refusal logged, with the version it was about:
	// logged and counted once, and cleared (with a log line) when the
	// file is good again.
	problem        refusal
	problemVersion int
}

// refusal is why a version of the file is not used.
type refusal struct {
	reason string // a reject* label
	why    string // the detail, for the log and the error
}

// load reads the file if it changed since the last load. It returns an
// error only when the file could not be used (unreadable, refused, or
// rejected by apply); the previous entries then stay in effect. A version
// is parsed (and its bad lines logged) once.
func (w *namingWatcher) load() error {
	info, err := os.Stat(w.path)
	if err != nil {
		return w.fail(refusal{rejectUnreadable, describeFileError(err)})
	}
	if !info.Mode().IsRegular() {
		return w.fail(refusal{rejectUnreadable, "not a regular file"})
	}
	stamp := fileStamp{mod: info.ModTime(), size: info.Size()}
	if w.read {
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
	data, err := readNamingFile(w.path, info.Size())
	if errors.Is(err, errNamingTooLarge) {
		w.stamp, w.read, w.content = stamp, true, nil
		w.version++
		return w.refuse(refusal{rejectTooLarge, fmt.Sprintf("%s: more than %d bytes; not read", err, maxNamingFileSize)})
	}
	if err != nil {
		return w.fail(refusal{rejectUnreadable, describeFileError(err)})
	}
	w.stamp, w.read = stamp, true
	if w.content != nil && bytes.Equal(data, w.content) {
		return w.same()
	}
	w.content = data
	w.version++
	v := parseNaming(w.path, data)
	w.logBadLines(v.bad)
	if r := w.check(data, v); r.reason != "" {
		return w.refuse(r, zap.Int("lines", v.lines), zap.Int("upstreams", len(v.entries)),
			zap.Int("skipped_lines", len(v.bad)), zap.Int("applied_upstreams", len(w.applied)))
	}
	if err := w.apply(v.entries); err != nil {
		return w.refuse(refusal{rejectInvalid, err.Error()}, zap.Int("upstreams", len(v.entries)))
	}
	w.applied = v.entries
	if w.applied == nil {
		w.applied = []Entry{}
	}
	w.rejected = refusal{}
	w.recovered()
	w.logger.Info("loaded naming file",
		zap.String("file", w.path),
		zap.Int("upstreams", len(v.entries)),
		zap.Int("skipped_lines", len(v.bad)))
	return nil
}

var errNamingTooLarge = errors.New("naming file too large")

// readNamingFile reads at most maxNamingFileSize bytes of path, whose size
// was size when stat'ed (it may grow meanwhile).
func readNamingFile(path string, size int64) ([]byte, error) {
	if size > maxNamingFileSize {
		return nil, fmt.Errorf("%w: %d bytes", errNamingTooLarge, size)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxNamingFileSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxNamingFileSize {
		return nil, fmt.Errorf("%w: grew while read", errNamingTooLarge)
	}
	return data, nil
}

// check decides whether a parsed version may replace the applied one.
// Rules, in order: the file must end with a newline (a file truncated
// mid-line, or still being written, is not used); it must have an
// upstream, unless a line "# lbx:empty" says it is meant to be empty; and
// it may remove at most maxRemoved percent of the applied entries.
func (w *namingWatcher) check(data []byte, v namingVersion) refusal {
	switch {
	case len(data) > 0 && data[len(data)-1] != '\n':
		return refusal{rejectIncomplete, fmt.Sprintf("line %d, the last, does not end with a newline: the file may be truncated or still being written (write a complete file elsewhere and rename it over this one)", v.lines)}
	case len(v.entries) > 0:
	case v.empty:
		return refusal{} // explicitly empty: no share to keep
	case len(data) == 0:
		return refusal{rejectNoValidLine, "the file is empty (0 bytes); to mean an empty upstream list, write a line \"# " + emptyMarker + "\""}
	default:
		return refusal{rejectNoValidLine, fmt.Sprintf("no valid upstream line (%d of %d lines invalid); to mean an empty upstream list, write a line \"# %s\"", len(v.bad), v.lines, emptyMarker)}
	}
	if len(w.applied) == 0 || w.maxRemoved >= 100 {
		return refusal{}
	}
	removed := 0
	for _, e := range w.applied {
		if !v.set[e] {
			removed++
		}
	}
	if pct := 100 * float64(removed) / float64(len(w.applied)); pct > w.maxRemoved {
		return refusal{rejectRemovesTooMany, fmt.Sprintf("it would remove %d of the %d upstreams applied (%.1f%%), more than naming_max_removed_percent %v%%: remove them in steps, or raise naming_max_removed_percent", removed, len(w.applied), pct, w.maxRemoved)}
	}
	return refusal{}
}

// logBadLines logs a version's bad lines, the first maxLoggedLines of them
// one by one.
func (w *namingWatcher) logBadLines(bad []LineError) {
	for i, le := range bad {
		if i == maxLoggedLines {
			w.logger.Warn("skipping more naming file lines", zap.String("file", w.path), zap.Int("lines", len(bad)-i))
			return
		}
		w.logger.Warn("skipping naming file line", zap.String("file", w.path), zap.Int("line", le.Line), zap.Error(le.Err))
	}
}

// same handles a file whose content did not change since the last load.
func (w *namingWatcher) same() error {
	if w.rejected.reason != "" {
		return w.fail(w.rejected)
	}
	w.recovered()
	return nil
}

func (w *namingWatcher) recovered() {
	if w.problem.reason != "" {
		w.logger.Info("naming file usable again", zap.String("file", w.path))
		w.problem = refusal{}
	}
}

// refuse records that the version just read is not applied.
func (w *namingWatcher) refuse(r refusal, counts ...zap.Field) error {
	w.rejected = r
	return w.fail(r, counts...)
}

// fail logs and counts why the file is not used, once per distinct reason
// and version.
func (w *namingWatcher) fail(r refusal, counts ...zap.Field) error {
	if r != w.problem || w.version != w.problemVersion {
		fields := append([]zap.Field{zap.String("file", w.path), zap.String("reason", r.why), zap.String("kind", r.reason)}, counts...)
		w.logger.Error("naming file not used; keeping the last good upstream list", fields...)
		namingRejected.WithLabelValues(r.reason).Inc()
		w.problem, w.problemVersion = r, w.version
	}
	return fmt.Errorf("naming file %s: %s", w.path, r.why)
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
