package rebalance

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"os"
	"strconv"
	"strings"
	"sync"
)

// procStatPath is the file the node's CPU is read from (metric cpu with
// cpu node). App.procStat overrides it in tests.
var procStatPath = "/proc/stat"

// procStatColumns are the columns of /proc/stat's cpu line that count,
// in their order: user, nice, system, idle, iowait, irq, softirq, steal.
// guest and guest_nice, which follow, are already in user and nice.
const procStatColumns = 8

// minProcStatColumns is the fewest columns a cpu line may have: user,
// nice, system and idle, which every kernel writes.
const minProcStatColumns = 4

// parseProcStat returns the time the node's CPUs spent busy, and in all,
// in jiffies since boot, from the aggregate `cpu` line of r, /proc/stat's
// content: busy = user + nice + system + irq + softirq + steal, total =
// busy + idle + iowait. A line with fewer columns (an old kernel has at
// least user, nice, system and idle) counts the missing ones 0. It fails
// when r has no such line, or the line's columns are not numbers.
func parseProcStat(r io.Reader) (busy, total uint64, err error) {
	sc := bufio.NewScanner(r)
	// The cpu line comes first; a long line before it (the intr line,
	// with many interrupts) must not stop the search.
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || f[0] != "cpu" {
			continue
		}
		cols := f[1:]
		if len(cols) < minProcStatColumns {
			return 0, 0, fmt.Errorf("the cpu line has %d columns, want at least %d (user nice system idle)", len(cols), minProcStatColumns)
		}
		var v [procStatColumns]uint64
		for i := range min(len(cols), procStatColumns) {
			if v[i], err = strconv.ParseUint(cols[i], 10, 64); err != nil {
				return 0, 0, fmt.Errorf("the cpu line's column %d, %q, is not a count of jiffies", i+1, cols[i])
			}
		}
		user, nice, system, idle, iowait, irq, softirq, steal := v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
		var carry, c uint64
		busy = user
		for _, x := range []uint64{nice, system, irq, softirq, steal} {
			busy, c = bits.Add64(busy, x, 0)
			carry |= c
		}
		total = busy
		for _, x := range []uint64{idle, iowait} {
			total, c = bits.Add64(total, x, 0)
			carry |= c
		}
		if carry != 0 {
			return 0, 0, errors.New("the cpu line's counts overflow")
		}
		return busy, total, nil
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	return 0, 0, errors.New("no aggregate cpu line")
}

// nodeCPUSampler measures the node's CPU utilisation (metric cpu with cpu
// node) from consecutive readings of /proc/stat.
type nodeCPUSampler struct {
	path string

	mu          sync.Mutex
	primed      bool // busy and total hold a reading
	busy, total uint64
}

// newNodeCPUSampler returns a sampler of the /proc/stat file at path,
// whose first sample is 0.
func newNodeCPUSampler(path string) *nodeCPUSampler {
	return &nodeCPUSampler{path: path}
}

// sample reads the file and returns the node's CPU utilisation since the
// previous sample, in percent of all its CPUs (0 to 100): 0 at the first
// sample, and 0, with the error, when the file cannot be read or parsed
// (the next good reading is then a first one).
func (s *nodeCPUSampler) sample() (float64, error) {
	busy, total, err := readProcStat(s.path)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.primed = false
		return 0, err
	}
	return s.next(busy, total), nil
}

// next returns the utilisation between the previous reading and this one
// (busy and total jiffies), in percent, and keeps this one as the
// baseline: 0 at the first reading, and 0 when a counter went backwards
// (a container restart, a wrap), from which this reading is the new
// baseline. The caller holds s.mu.
func (s *nodeCPUSampler) next(busy, total uint64) float64 {
	prevBusy, prevTotal, primed := s.busy, s.total, s.primed
	s.busy, s.total, s.primed = busy, total, true
	if !primed || busy < prevBusy || total < prevTotal || total == prevTotal {
		return 0
	}
	// busy is part of total, so this is at most 100 unless idle went
	// backwards while busy went forward.
	return min(100, 100*float64(busy-prevBusy)/float64(total-prevTotal))
}

// readProcStat reads and parses the /proc/stat file at path.
func readProcStat(path string) (busy, total uint64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	busy, total, err = parseProcStat(f)
	if err != nil {
		return 0, 0, fmt.Errorf("%s: %v", path, err)
	}
	return busy, total, nil
}
