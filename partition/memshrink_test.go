package partition

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/caddy-lbx/lbx/internal/hoststate"
	"github.com/caddy-lbx/lbx/internal/monoclock"
)

// TestMemoryReturnsAfterShrink installs 3 upstreams, then 200,000, then
// the 3 again, as naming file versions, and checks that the heap in use
// after the shrink is back within a bound of where it started: nothing
// of the handler (layout, audit, per-address state) keeps the large list.
// Then it checks that the memory is handed back to the operating system
// (see returnMemorySoon).
func TestMemoryReturnsAfterShrink(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's shadow memory skews the heap")
	}
	list := func(n int) []Entry {
		es := make([]Entry, n)
		for i := range es {
			es[i] = Entry{Dial: fmt.Sprintf("10.%d.%d.%d:80", i>>16, (i>>8)&255, i&255), Tag: Tag{Index: i % 3, Count: 3}}
		}
		return es
	}
	h := &Handler{hosts: hoststate.NewTable(hoststate.Config{})}
	defer h.hosts.Release()
	if err := h.install(list(3)); err != nil {
		t.Fatal(err)
	}
	base := heapAfterGC()
	debug.FreeOSMemory() // a baseline without the earlier tests' garbage
	baseHeld := heldFromOS()
	if err := h.install(list(200000)); err != nil {
		t.Fatal(err)
	}
	h.current.Load().choose(rand.IntN, monoclock.Now())
	peak := heapAfterGC()
	peakHeld := heldFromOS()
	if err := h.install(list(3)); err != nil {
		t.Fatal(err)
	}
	after := heapAfterGC()
	t.Logf("heap: %d MB with 3, %d MB with 200,000, %d MB after going back to 3", base>>20, peak>>20, after>>20)
	if peak < base+20<<20 {
		t.Fatalf("200,000 upstreams took %d MB; the test no longer measures anything", (peak-base)>>20)
	}
	if after > base+(peak-base)/10 {
		t.Errorf("after the shrink the heap holds %d MB more than before (of %d MB at 200,000); want at most a tenth", (after-base)>>20, (peak-base)>>20)
	}

	// What the process keeps from the operating system (what RSS shows
	// of the heap) comes back down too, within a deadline, well before
	// the runtime's background scavenger alone would get there.
	deadline := time.Now().Add(returnDelay + 2*time.Second)
	for {
		held := heldFromOS()
		if held <= baseHeld+(peakHeld-baseHeld)/10 {
			t.Logf("held from the OS: %d MB with 3, %d MB with 200,000, %d MB after going back to 3", baseHeld>>20, peakHeld>>20, held>>20)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v after the shrink the heap holds %d MB from the OS (%d MB with 3, %d MB with 200,000); want at most a tenth of the difference above the start",
				returnDelay+2*time.Second, held>>20, baseHeld>>20, peakHeld>>20)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// heldFromOS is the heap memory the runtime holds from the operating
// system and has not returned: about what the heap adds to RSS.
func heldFromOS() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapSys - ms.HeapReleased
}
