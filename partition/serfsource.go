package partition

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/rebalance"
)

// DefaultSerfPartitionTag is the member tag SerfNaming reads by default.
const DefaultSerfPartitionTag = "partition"

// SerfNaming takes tagged upstreams from the members of this node's
// rebalance cluster (the `rebalance` app, which must be in the config):
// each alive member whose tag PartitionTag holds partition tags, e.g.
// `partition=0/3` or `partition=0/3,1/4` (a comma-separated list), is an
// upstream for each of them, dialed at its advertised IP and the port in
// its tag PortTag, or Port. Members without the tag are not partition
// servers and are ignored; a member whose tag or port cannot be used is
// left out and logged once per distinct problem.
//
// The member list is read every poll interval; a changed list replaces
// the previous one atomically (requests in flight finish on the list they
// started with), merged with the static upstreams and the naming file's.
type SerfNaming struct {
	// PartitionTag is the member tag that holds the partition tags.
	// Default: "partition".
	PartitionTag string `json:"partition_tag,omitempty"`

	// Tags the members must also carry, with these values (e.g.
	// {"role": "search"}). Default: none.
	Tags map[string]string `json:"tags,omitempty"`

	// Port is the port to dial on every member, unless its PortTag tag
	// gives one. One of Port and PortTag is required.
	Port string `json:"port,omitempty"`

	// PortTag names the member tag that holds the port to dial (e.g.
	// "http_port"). Default: none.
	PortTag string `json:"port_tag,omitempty"`
}

// validate checks the configuration.
func (s *SerfNaming) validate() error {
	if s.Port == "" && s.PortTag == "" {
		return errors.New("serf: give a port or a port_tag (the member tag that holds the port to dial)")
	}
	if s.Port != "" {
		if _, err := rebalance.ParsePort(s.Port); err != nil {
			return fmt.Errorf("serf: %v", err)
		}
	}
	for k, v := range s.Tags {
		if k == "" || v == "" {
			return fmt.Errorf("serf: tag %q=%q: key and value must not be empty", k, v)
		}
	}
	return nil
}

func (s *SerfNaming) partitionTag() string {
	if s.PartitionTag == "" {
		return DefaultSerfPartitionTag
	}
	return s.PartitionTag
}

// SerfEntries returns the tagged upstreams that members give under cfg,
// sorted by address then tag and free of duplicates, and the problems of
// the members left out (one string each).
func SerfEntries(members []rebalance.Member, cfg *SerfNaming) ([]Entry, []string) {
	var (
		entries  []Entry
		problems []string
	)
	key := cfg.partitionTag()
	for _, m := range members {
		raw, ok := m.Tags[key]
		if !ok || m.Status != rebalance.StatusAlive || !m.HasTags(cfg.Tags) {
			continue
		}
		dial, err := m.DialAddr(cfg.Port, cfg.PortTag)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		var bad []string
		var tags []Tag
		for _, v := range strings.Split(raw, ",") {
			t, err := ParseTag(strings.TrimSpace(v))
			if err != nil {
				bad = append(bad, err.Error())
				continue
			}
			tags = append(tags, t)
		}
		if len(bad) > 0 {
			// A member with a bad tag is left out as a whole: serving
			// some of its partitions would hide the mistake.
			problems = append(problems, fmt.Sprintf("member %s: tag %s=%q: %s", m.Name, key, raw, strings.Join(bad, "; ")))
			continue
		}
		for _, t := range tags {
			entries = append(entries, Entry{Dial: dial, Tag: t})
		}
	}
	slices.SortFunc(entries, func(a, b Entry) int {
		return cmp.Or(strings.Compare(a.Dial, b.Dial), cmp.Compare(a.Tag.Count, b.Tag.Count), cmp.Compare(a.Tag.Index, b.Tag.Index))
	})
	return slices.Compact(entries), problems
}

// serfWatcher polls the cluster's member list and hands every changed
// list of entries to apply. It runs in one goroutine; its state is not
// shared.
type serfWatcher struct {
	cfg    *SerfNaming
	app    *rebalance.App
	every  time.Duration
	logger *zap.Logger
	apply  func([]Entry) error

	last     []Entry
	started  bool   // a member list has been read
	problems string // the last problems logged
	rejected string // why apply refused the last list
}

// newSerfWatcher finds the config's rebalance app.
func newSerfWatcher(ctx caddy.Context, cfg *SerfNaming, every time.Duration, logger *zap.Logger, apply func([]Entry) error) (*serfWatcher, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	app, err := ctx.AppIfConfigured("rebalance")
	if err != nil {
		if errors.Is(err, caddy.ErrNotConfigured) {
			return nil, errors.New("serf: no rebalance app in this config; the upstreams come from the members of this node's rebalance cluster, so add the `rebalance` global option (or the \"rebalance\" app in JSON)")
		}
		return nil, fmt.Errorf("serf: %v", err)
	}
	return &serfWatcher{cfg: cfg, app: app.(*rebalance.App), every: every, logger: logger, apply: apply}, nil
}

// load reads the member list and applies it if it changed. It returns
// rebalance.ErrNotRunning before the app has started.
func (w *serfWatcher) load() error {
	members, err := w.app.Members()
	if err != nil {
		return err
	}
	w.started = true
	entries, problems := SerfEntries(members, w.cfg)
	if p := strings.Join(problems, "\n"); p != w.problems {
		if p != "" {
			w.logger.Warn("members left out of the partition upstreams", zap.Strings("reasons", problems))
		}
		w.problems = p
	}
	if w.last != nil && slices.Equal(entries, w.last) && w.rejected == "" {
		return nil
	}
	if entries == nil {
		entries = []Entry{}
	}
	if err := w.apply(entries); err != nil {
		if err.Error() != w.rejected {
			w.logger.Error("serf member list not used; keeping the last good upstream list", zap.Error(err))
			w.rejected = err.Error()
		}
		w.last = entries
		return err
	}
	w.rejected = ""
	w.last = entries
	w.logger.Info("partition upstreams from serf members", zap.Int("upstreams", len(entries)))
	return nil
}

// run polls until done is closed: every 50ms until the rebalance app's
// member runs (it starts after every module is provisioned), then every
// poll interval. It recovers from panics; the last good list then stays.
func (w *serfWatcher) run(done <-chan struct{}) {
	defer func() {
		if r := recover(); r != nil {
			w.logger.Error("serf member watcher panicked; the upstream list will no longer be updated",
				zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	wait := 50 * time.Millisecond
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		_ = w.load()
		if w.started {
			wait = w.every
		}
		t.Reset(wait)
	}
}
