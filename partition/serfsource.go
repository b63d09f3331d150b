package partition

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/cluster"
)

// DefaultSerfPartitionTag is the member tag SerfNaming reads by default.
const DefaultSerfPartitionTag = "partition"

// SerfNaming takes tagged upstreams from the members of this node's
// cluster (the `cluster` app, which must be in the config): each alive
// member whose tag PartitionTag holds partition tags, e.g.
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
	// The member tag that holds the partition tags.
	// Default: "partition".
	PartitionTag string `json:"partition_tag,omitempty"`

	// The member selection, inlined: `tags`, `port`, `port_tag`, `exclude_self`,
	// `allow_networks` and `allow_ports` pick the members, and the dial policy applies.
	cluster.Selector
}

// validate checks the configuration.
func (s *SerfNaming) validate() error {
	if err := s.Selector.Validate(); err != nil {
		return fmt.Errorf("serf: %v", err)
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
// the members left out (one string each, sorted).
func SerfEntries(members []cluster.Member, cfg *SerfNaming) ([]Entry, []string) {
	var entries []Entry
	key := cfg.partitionTag()
	picked, problems := cfg.Select(members, func(m cluster.Member) bool {
		_, ok := m.Tags[key]
		return ok
	})
	for _, p := range picked {
		raw := p.Tags[key]
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
			problems = append(problems, fmt.Sprintf("member %s: tag %s=%q: %s", p.Name, key, raw, strings.Join(bad, "; ")))
			continue
		}
		for _, t := range tags {
			entries = append(entries, Entry{Dial: p.Dial, Tag: t})
		}
	}
	slices.Sort(problems) // the same problems read the same
	slices.SortFunc(entries, func(a, b Entry) int {
		return cmp.Or(strings.Compare(a.Dial, b.Dial), cmp.Compare(a.Tag.Count, b.Tag.Count), cmp.Compare(a.Tag.Index, b.Tag.Index))
	})
	return slices.Compact(entries), problems
}

// serfWatcher turns the cluster's member lists into entries and hands
// every changed list to apply. It runs in one goroutine (cluster.App.Poll);
// its state is not shared.
type serfWatcher struct {
	cfg    *SerfNaming
	app    *cluster.App
	every  time.Duration
	logger *zap.Logger
	apply  func([]Entry) error

	last     []Entry
	problems string // the last problems logged
	rejected string // why apply refused the last list
}

// newSerfWatcher finds the config's cluster app.
func newSerfWatcher(ctx caddy.Context, cfg *SerfNaming, every time.Duration, logger *zap.Logger, apply func([]Entry) error) (*serfWatcher, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	app, err := cluster.Lookup(ctx, "serf")
	if err != nil {
		return nil, err
	}
	if err := cfg.Use(app); err != nil {
		return nil, fmt.Errorf("serf: %v", err)
	}
	return &serfWatcher{cfg: cfg, app: app, every: every, logger: logger, apply: apply}, nil
}

// load applies the entries members give, if they changed.
func (w *serfWatcher) load(members []cluster.Member) error {
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

// run polls until done is closed (see cluster.App.Poll).
func (w *serfWatcher) run(done <-chan struct{}) {
	w.app.Poll(done, w.every, w.logger, func(ms []cluster.Member) { _ = w.load(ms) })
}
