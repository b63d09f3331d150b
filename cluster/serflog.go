package cluster

import (
	"bytes"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// serfLog turns serf's and memberlist's log lines ("[WARN] serf: …")
// into zap entries at the matching level. Warnings and errors go through
// a rate limiter (gossipLogLimit): a peer sending garbage packets makes
// memberlist log one line per packet.
type serfLog struct {
	logger *zap.Logger
	// conflict is told the address of a member that claims this node's
	// name, when serf logs one; conflictOver, when serf's vote on the
	// name keeps it here or cannot run.
	conflict     func(addr string)
	conflictOver func()
	// decryptFailed is told the remote address of a message no key of
	// the keyring decrypts (decrypt.go).
	decryptFailed func(addr string)

	mu    sync.Mutex
	kinds map[string]*logKind
}

// Rate limit of the gossip library's warnings and errors: per kind of
// message, at most gossipLogBurst lines per gossipLogPeriod; the first
// line after a period that suppressed some says how many.
const (
	gossipLogBurst  = 5
	gossipLogPeriod = 10 * time.Second
	// gossipLogKinds bounds the kinds tracked; further kinds share one.
	gossipLogKinds = 64
)

// gossipLogs counts the gossip library's warning and error lines in the
// process, and those suppressed (metrics).
var gossipLogs struct {
	lines, suppressed atomic.Uint64
}

// logKind is the rate limiter's state for one kind of message.
type logKind struct {
	start      time.Time // of the current period
	n          int       // lines written in it
	suppressed int       // lines dropped since the last one written
}

// serfLevels maps the gossip library's level prefixes to zap's.
var serfLevels = []struct {
	prefix string
	level  zapcore.Level
}{
	{"[DEBUG]", zapcore.DebugLevel}, {"[TRACE]", zapcore.DebugLevel}, {"[INFO]", zapcore.InfoLevel},
	{"[WARN]", zapcore.WarnLevel}, {"[ERR]", zapcore.ErrorLevel}, {"[ERROR]", zapcore.ErrorLevel},
}

// conflictPrefix starts serf's line on a member that claims this node's
// name: "serf: Node name conflicts with another node at 10.0.0.1:7946.
// Names must be unique! …".
const conflictPrefix = "serf: Node name conflicts with another node at "

// serf's lines when its vote on the name keeps it here, or cannot start.
const (
	conflictKept   = "serf: majority in name conflict resolution"
	conflictNoVote = "serf: Failed to start name resolution query"
)

func (w *serfLog) Write(p []byte) (int, error) {
	line := string(bytes.TrimSpace(p))
	lvl := zapcore.InfoLevel
	for _, l := range serfLevels {
		if rest, ok := strings.CutPrefix(line, l.prefix); ok {
			lvl, line = l.level, strings.TrimSpace(rest)
			break
		}
	}
	if rest, ok := strings.CutPrefix(line, conflictPrefix); ok && w.conflict != nil {
		addr, _, _ := strings.Cut(rest, " ")
		w.conflict(strings.TrimSuffix(addr, "."))
	}
	if addr, ok := decryptAddr(line); ok && w.decryptFailed != nil {
		w.decryptFailed(addr)
	}
	if w.conflictOver != nil && (strings.HasPrefix(line, conflictKept) || strings.HasPrefix(line, conflictNoVote)) {
		w.conflictOver()
	}
	// Serf logs every member update (every load report of every member,
	// every interval) at INFO: that is debug detail here.
	if lvl == zapcore.InfoLevel && strings.Contains(line, "EventMemberUpdate") {
		lvl = zapcore.DebugLevel
	}
	var suppressed int
	if lvl >= zapcore.WarnLevel {
		gossipLogs.lines.Add(1)
		var ok bool
		if ok, suppressed = w.allow(logKindOf(line), time.Now()); !ok {
			gossipLogs.suppressed.Add(1)
			return len(p), nil
		}
	}
	if c := w.logger.Check(lvl, line); c != nil {
		if suppressed > 0 {
			c.Write(zap.Int("suppressed_similar", suppressed), zap.Stringer("rate_limit_period", gossipLogPeriod))
		} else {
			c.Write()
		}
	}
	return len(p), nil
}

// allow reports whether a line of kind may be written at t, and how many
// of that kind were suppressed before it.
func (w *serfLog) allow(kind string, t time.Time) (ok bool, suppressed int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.kinds == nil {
		w.kinds = make(map[string]*logKind)
	}
	k := w.kinds[kind]
	if k == nil {
		if len(w.kinds) >= gossipLogKinds {
			kind = "other"
			k = w.kinds[kind]
		}
		if k == nil {
			k = &logKind{start: t}
			w.kinds[kind] = k
		}
	}
	if t.Sub(k.start) >= gossipLogPeriod {
		k.start, k.n = t, 0
	}
	if k.n >= gossipLogBurst {
		k.suppressed++
		return false, 0
	}
	k.n++
	suppressed, k.suppressed = k.suppressed, 0
	return true, suppressed
}

// logKindOf returns the kind of a gossip log line: its text up to the
// first colon after the library's name ("memberlist: Failed to decode
// ping: …" is "memberlist: Failed to decode ping"), without the details
// (addresses, errors) that vary from line to line.
func logKindOf(line string) string {
	lib, rest, ok := strings.Cut(line, ": ")
	if !ok {
		lib, rest = "", line
	}
	// Details start at a colon or a quote (memberlist quotes what a
	// packet carried).
	msg := rest
	if i := strings.IndexAny(rest, ":\"'"); i >= 0 {
		msg = rest[:i]
	}
	// Numbers in the message itself vary too.
	msg = strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' {
			return -1
		}
		return r
	}, msg)
	if len(msg) > 80 {
		msg = msg[:80]
	}
	return lib + ": " + msg
}
