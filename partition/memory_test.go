package partition

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// bigJSON returns a JSON document of about size bytes shaped like a
// search answer: {"hits":[{"id":…,"title":…},…],"total":…,"took":{…}}.
func bigJSON(size int) []byte {
	var b bytes.Buffer
	b.Grow(size + 256)
	b.WriteString(`{"hits":[`)
	n := 0
	for b.Len() < size-64 {
		if n > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"id":%d,"title":"document %d of the partition","score":0.%d}`, n, n, n%997)
		n++
	}
	fmt.Fprintf(&b, `],"total":%d,"took":{"p":%d}}`, n, n%13)
	return b.Bytes()
}

// heapPeak samples the heap in use until stopped.
type heapPeak struct {
	peak atomic.Uint64
	stop chan struct{}
	done chan struct{}
}

func startHeapPeak() *heapPeak {
	p := &heapPeak{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		var ms runtime.MemStats
		for {
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > p.peak.Load() {
				p.peak.Store(ms.HeapAlloc)
			}
			select {
			case <-p.stop:
				return
			case <-tick.C:
			}
		}
	}()
	return p
}

func (p *heapPeak) end() uint64 {
	close(p.stop)
	<-p.done
	return p.peak.Load()
}

// heapAfterGC is the heap in use once garbage (and sync.Pool contents,
// which two collections drop) is gone.
func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestMergeMemoryBounded fans out to 4 partitions that each answer 8 MB
// of JSON (under the default max_response_body), 3 requests at a time,
// and checks that the heap in use at its peak stays within 4x the bytes
// the requests in flight receive (4 x 8 MB x 3), and that those bytes are
// let go once the requests are answered. Two partitions send a
// Content-Length, two stream chunks. With the garbage collector's target
// lowered (GOGC=20) for the test, the heap in use tracks the live heap.
// Then, with max_merged_body below what the four answer together, the
// request fails with 502.
func TestMergeMemoryBounded(t *testing.T) {
	const (
		parts    = 4
		partSize = 8_000_000
		inFlight = 3
		rounds   = 2
	)
	e := newEnv(t)
	body := bigJSON(partSize)
	var to []string
	for i := range parts {
		b := e.backend("b" + strconv.Itoa(i))
		withLength := i%2 == 0
		b.setHandler(func(_ *backend, w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			if withLength {
				w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			}
			_, _ = w.Write(body)
		})
		to = append(to, fmt.Sprintf("%s %d/%d", b.addr, i, parts))
	}
	e.load(partitionSite(to))

	// What a correct merge answers: the hits of every partition, in
	// order, and the last partition's scalars.
	hits := body[len(`{"hits":[`):bytes.LastIndex(body, []byte(`],"total"`))]
	wantLen := len(body) + (parts-1)*(len(hits)+1) + 1

	fetch := func() error {
		res, err := e.client.Get(e.url("/search"))
		if err != nil {
			return err
		}
		defer res.Body.Close()
		if res.StatusCode != http.StatusOK {
			msg, _ := io.ReadAll(io.LimitReader(res.Body, 1024))
			return fmt.Errorf("status %d: %s", res.StatusCode, msg)
		}
		n, err := io.Copy(io.Discard, res.Body)
		if err != nil {
			return err
		}
		if n != int64(wantLen) {
			return fmt.Errorf("merged body of %d bytes; want %d", n, wantLen)
		}
		return nil
	}
	if err := fetch(); err != nil { // connections up, pools warm
		t.Fatal(err)
	}

	defer debug.SetGCPercent(debug.SetGCPercent(20))
	base := heapAfterGC()
	peak := startHeapPeak()
	var wg sync.WaitGroup
	errs := make(chan error, inFlight*rounds)
	for range inFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				if err := fetch(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	top := peak.end()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	after := heapAfterGC()

	data := uint64(parts * partSize * inFlight)
	grew := top - min(top, base)
	t.Logf("heap: %d MB at rest, peak %d MB above it for %d MB in flight (%.2fx); %d MB above it after",
		base>>20, grew>>20, data>>20, float64(grew)/float64(data), (after-min(after, base))>>20)
	if grew > 4*data {
		t.Errorf("peak heap %d MB above rest; want at most 4x the %d MB in flight", grew>>20, data>>20)
	}
	if after > base+partSize {
		t.Errorf("heap %d MB after the requests, %d MB at rest: sub-responses are kept", after>>20, base>>20)
	}

	// Over max_merged_body: 502 at once, naming the limit.
	e.load(partitionSite(to, "max_merged_body 20MB"))
	res := e.get("/search")
	if res.status != http.StatusBadGateway || !strings.Contains(res.body, "the sub-responses together are larger than max_merged_body (20000000 bytes)") {
		t.Errorf("over max_merged_body: status %d body %q", res.status, res.body)
	}
	if st := res.header.Get(StatusHeader); !strings.Contains(st, "failed") {
		t.Errorf("%s: %q names no failed partition", StatusHeader, st)
	}
}

// TestRecorder covers how a sub-response body is kept: sized from its
// Content-Length, in chunks without one, dropped when not 2xx, and
// refused over max_response_body or the fan-out's budget.
func TestRecorder(t *testing.T) {
	newRec := func(limit, budgetLimit int64) *recorder {
		return &recorder{header: make(http.Header), limit: limit, budget: &budget{limit: budgetLimit}}
	}
	write := func(r *recorder, data []byte, step int) error {
		for len(data) > 0 {
			k := min(step, len(data))
			if _, err := r.Write(data[:k]); err != nil {
				return err
			}
			data = data[k:]
		}
		return nil
	}
	data := bigJSON(3 * maxChunk)

	r := newRec(1<<30, 1<<30)
	r.header.Set("Content-Length", strconv.Itoa(len(data)))
	if err := write(r, data, 32<<10); err != nil {
		t.Fatal(err)
	}
	if got := r.bytes(); !bytes.Equal(got, data) || cap(got) != len(data) || len(r.chunks) != 0 {
		t.Errorf("with a Content-Length: %d bytes in a slice of %d, %d chunks; want %d in one of that size", len(got), cap(got), len(r.chunks), len(data))
	}

	r = newRec(1<<30, 1<<30)
	if err := write(r, data, 7<<10); err != nil {
		t.Fatal(err)
	}
	if got := r.bytes(); !bytes.Equal(got, data) || cap(got) != len(data) {
		t.Errorf("chunked: %d bytes in a slice of %d; want %d in one of that size", len(got), cap(got), len(data))
	}

	r = newRec(1<<30, 1<<30)
	r.WriteHeader(http.StatusBadGateway)
	if err := write(r, data, 32<<10); err != nil || len(r.bytes()) != 0 {
		t.Errorf("502: kept %d bytes (%v); want none", len(r.bytes()), err)
	}

	for _, tc := range []struct {
		name          string
		limit, budget int64
		length        bool
		want          error
	}{
		{"declared over max_response_body", 1000, 1 << 30, true, errResponseTooLarge},
		{"chunked over max_response_body", 1000, 1 << 30, false, errResponseTooLarge},
		{"declared over the budget", 1 << 30, 1000, true, errMergedTooLarge},
		{"chunked over the budget", 1 << 30, 1000, false, errMergedTooLarge},
	} {
		r := newRec(tc.limit, tc.budget)
		if tc.length {
			r.header.Set("Content-Length", strconv.Itoa(len(data)))
		}
		err := write(r, data, 512)
		if err != tc.want || r.overflow != tc.want || r.body != nil || r.chunks != nil {
			t.Errorf("%s: error %v, overflow %v, %d bytes kept; want %v and nothing kept", tc.name, err, r.overflow, len(r.body), tc.want)
		}
	}
}
