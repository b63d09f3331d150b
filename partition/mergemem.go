package partition

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/dustin/go-humanize"
)

// Bounds of max_merge_memory. One fan-out may reserve up to about
// 2 × max_merged_body (1 GiB at most) plus copies of the request body;
// above 1 TiB the bound bounds nothing.
const (
	defaultMaxMergeMemory = 1 << 30
	minMergeMemory        = 1 << 20
	maxMergeMemory        = 1 << 40
)

// mergeMemory is the process-wide bound on the memory fan-outs hold for
// merging (max_merge_memory), shared by every partition and parallel
// handler of the process, of every config loaded: a fan-out reserves its
// worst case (see FanOut.reservation) before its first sub-request and
// releases it when it has answered, so that the fan-outs in flight never
// hold more than the bound together and none of them ever fails for it.
// A fan-out that does not fit waits, first come first served, until its
// deadline.
var mergeMemory = newMemPool(defaultMaxMergeMemory)

// errNeverFits: the reservation is larger than the whole bound.
var errNeverFits = errors.New("larger than max_merge_memory")

// memPool is a counting semaphore of bytes whose limit may change (a
// config that raises or lowers max_merge_memory), with waiters served in
// order.
type memPool struct {
	mu      sync.Mutex
	limit   int64
	used    int64
	holders int
	waiters []*memWaiter

	waited  atomic.Uint64 // reservations that had to wait
	refused atomic.Uint64 // reservations not granted (deadline, never fits)
}

type memWaiter struct {
	n     int64
	ready chan struct{} // closed when granted or refused
	err   error         // set before ready is closed: refused
}

func newMemPool(limit int64) *memPool { return &memPool{limit: limit} }

// acquire reserves n bytes, waiting while they do not fit until ctx ends.
// It returns errNeverFits when n is above the limit, and ctx's error when
// ctx ended first; nothing is reserved then.
func (p *memPool) acquire(ctx context.Context, n int64) error {
	p.mu.Lock()
	if n > p.limit {
		p.mu.Unlock()
		p.refused.Add(1)
		return errNeverFits
	}
	if len(p.waiters) == 0 && p.used+n <= p.limit {
		p.used += n
		p.holders++
		p.mu.Unlock()
		return nil
	}
	w := &memWaiter{n: n, ready: make(chan struct{})}
	p.waiters = append(p.waiters, w)
	p.mu.Unlock()
	p.waited.Add(1)

	select {
	case <-w.ready:
		if w.err != nil {
			p.refused.Add(1)
		}
		return w.err
	case <-ctx.Done():
	}
	p.mu.Lock()
	select {
	case <-w.ready:
		// Granted (or refused) as ctx ended: give it back.
		p.mu.Unlock()
		if w.err == nil {
			p.release(n)
		}
	default:
		for i, o := range p.waiters {
			if o == w {
				p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
				break
			}
		}
		// The next waiter may fit now that this one, ahead of it, left.
		p.grantLocked()
		p.mu.Unlock()
	}
	p.refused.Add(1)
	return ctx.Err()
}

// release gives back n bytes acquired before.
func (p *memPool) release(n int64) {
	p.mu.Lock()
	p.used -= n
	p.holders--
	p.grantLocked()
	p.mu.Unlock()
}

// setLimit changes the limit; waiters that fit now are served, and those
// that never can any more are refused.
func (p *memPool) setLimit(limit int64) {
	p.mu.Lock()
	p.limit = limit
	p.grantLocked()
	p.mu.Unlock()
}

// grantLocked serves the waiters in order while the first one fits.
func (p *memPool) grantLocked() {
	for len(p.waiters) > 0 {
		w := p.waiters[0]
		switch {
		case w.n > p.limit:
			w.err = errNeverFits
		case p.used+w.n <= p.limit:
			p.used += w.n
			p.holders++
		default:
			return
		}
		p.waiters[0] = nil
		p.waiters = p.waiters[1:]
		close(w.ready)
	}
}

// mergeMemoryView is the bound's state in GET /lbx/partitions.
type mergeMemoryView struct {
	// Limit is max_merge_memory in force: the largest of the running
	// partition and parallel handlers' (each counts as the default when
	// it sets none).
	Limit int64 `json:"limit"`
	// InUse is what the fan-outs in flight have reserved, by FanOuts
	// fan-outs; Waiting fan-outs wait for room.
	InUse   int64 `json:"in_use"`
	FanOuts int   `json:"fan_outs"`
	Waiting int   `json:"waiting"`
	// WaitedTotal counts the fan-outs that had to wait, RefusedTotal
	// those answered 503 because room did not come before their deadline
	// (or never could).
	WaitedTotal  uint64 `json:"waited_total"`
	RefusedTotal uint64 `json:"refused_total"`
}

func (p *memPool) view() mergeMemoryView {
	p.mu.Lock()
	defer p.mu.Unlock()
	return mergeMemoryView{
		Limit: p.limit, InUse: p.used, FanOuts: p.holders, Waiting: len(p.waiters),
		WaitedTotal: p.waited.Load(), RefusedTotal: p.refused.Load(),
	}
}

// updateMergeMemory sets the bound from the running handlers (fanOuts:
// partition's and parallel's): the largest max_merge_memory among them,
// each one without it counting as the default, so that every handler's
// fan-outs fit (Validate checks a handler's reservation against its own
// value). It runs when a handler is provisioned and when one is cleaned
// up; during a reload the old config's handlers count until they are
// cleaned up.
func updateMergeMemory() {
	var limit int64
	for _, h := range fanOuts.All() {
		limit = max(limit, h.mergeMemoryLimit())
	}
	if limit == 0 {
		limit = defaultMaxMergeMemory
	}
	mergeMemory.setLimit(limit)
}

// mergeMemoryLimit is MaxMergeMemory with its default.
func (h *FanOut) mergeMemoryLimit() int64 {
	if h.MaxMergeMemory == 0 {
		return defaultMaxMergeMemory
	}
	return h.MaxMergeMemory
}

// mergeReserve is what a fan-out to n partitions reserves for its
// sub-responses and the merged body, besides the copies of the request
// body: the sub-responses together hold at most max_merged_body, and no
// more than n × max_response_body; the merged body, built while they are
// held, about as much again.
func (h *FanOut) mergeReserve(n int) int64 {
	return 2 * min(h.MaxMergedBody, int64(n)*h.MaxResponseBody)
}

// reservation is what a fan-out to n parts whose request bodies hold
// bodies bytes (see subParent.bodyBytes) reserves of max_merge_memory:
// mergeReserve, and the bodies.
func (h *FanOut) reservation(n int, bodies int64) int64 {
	return h.mergeReserve(n) + bodies
}

// checkMergeMemory checks max_merge_memory against its bounds and against
// what one fan-out of this handler may reserve for its merge.
func (h *FanOut) checkMergeMemory() error {
	m := h.MaxMergeMemory
	if m != 0 && (m < minMergeMemory || m > maxMergeMemory) {
		return fmt.Errorf("max_merge_memory %d is out of range: want %d (1 MiB) to %d (1 TiB)", m, int64(minMergeMemory), int64(maxMergeMemory))
	}
	limit := h.mergeMemoryLimit()
	if need := 2 * h.MaxMergedBody; need > limit {
		return fmt.Errorf("max_merge_memory %d (%s) is below what one fan-out may reserve, 2 × max_merged_body = %d (%s): raise max_merge_memory (default %s) or lower max_merged_body",
			limit, humanize.IBytes(uint64(limit)), need, humanize.IBytes(uint64(need)), humanize.IBytes(defaultMaxMergeMemory))
	}
	return nil
}
