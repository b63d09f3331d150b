package partition

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

// BenchmarkNamingApply measures applying a naming file version of n
// upstreams that are all new (and dropping the n of the version before):
// reading the file, parsing, the safety checks, merging with the other
// sources, building the layout and taking (and releasing) references on
// the shared per-address state, as the watcher does on a poll. The file
// is written outside the timer. ns/op and allocs/op are per apply;
// ns/addr is ns/op over n, and stays flat when applying is linear.
//
//	go test ./partition -run '^$' -bench NamingApply -benchmem
func BenchmarkNamingApply(b *testing.B) {
	for _, n := range []int{5000, 50000, 200000} {
		b.Run(fmt.Sprintf("addrs=%d", n), func(b *testing.B) {
			path := filepath.Join(b.TempDir(), "server_list")
			version := func(port int) []byte {
				var sb strings.Builder
				sb.Grow(n * 28)
				for i := range n {
					fmt.Fprintf(&sb, "10.%d.%d.%d:%d %d/4\n", i>>16, (i>>8)&255, i&255, port, i%4)
				}
				return []byte(sb.String())
			}
			h := &Handler{hosts: hoststate.NewTable(hoststate.Config{})}
			defer h.hosts.Release()
			w := &namingWatcher{path: path, logger: zap.NewNop(), maxRemoved: 100, apply: h.install}
			stamp := time.Now()
			write := func(port int) {
				if err := os.WriteFile(path, version(port), 0o644); err != nil {
					b.Fatal(err)
				}
				stamp = stamp.Add(time.Second)
				if err := os.Chtimes(path, stamp, stamp); err != nil {
					b.Fatal(err)
				}
			}
			write(1)
			if err := w.load(); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				b.StopTimer()
				write(2 + i%60000)
				b.StartTimer()
				_ = w.load()                     // the change is seen
				if err := w.load(); err != nil { // and read once stable
					b.Fatal(err)
				}
			}
			b.StopTimer()
			if got := len(h.current.Load().entries); got != n || h.hosts.Len() != n {
				b.Fatalf("applied %d upstreams, %d referenced; want %d", got, h.hosts.Len(), n)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/addr")
		})
	}
}
