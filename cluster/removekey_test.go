package cluster

import (
	"bytes"
	"sync"
	"testing"

	"github.com/hashicorp/memberlist"
)

// TestRemoveKeyKeepsReadersSafe: removeKey drops a key from the middle of
// the keyring, keeps the others in their order and the primary, while
// readers iterate over the keys as memberlist's packet goroutines do.
// Under -race, memberlist's own RemoveKey of a middle key is reported here
// (it shifts the later keys within the array readers hold).
func TestRemoveKeyKeepsReadersSafe(t *testing.T) {
	key := func(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }
	kr, err := memberlist.NewKeyring([][]byte{key(2), key(3), key(4), key(5)}, key(1))
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				n := 0
				for _, k := range kr.GetKeys() {
					n += int(k[0])
				}
				if n == 0 {
					t.Error("no keys")
				}
			}
		}()
	}
	for _, b := range []byte{3, 2} { // 3 is in the middle, then 2
		if err := removeKey(kr, key(b)); err != nil {
			t.Fatal(err)
		}
		if err := kr.AddKey(key(b)); err != nil { // and back, at the end
			t.Fatal(err)
		}
		if err := removeKey(kr, key(b)); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	want := [][]byte{key(1), key(4), key(5)}
	got := kr.GetKeys()
	if len(got) != len(want) {
		t.Fatalf("keys %x; want %x", got, want)
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("keys %x; want %x (primary first, the others in their order)", got, want)
		}
	}
	if err := removeKey(kr, key(9)); err != nil {
		t.Errorf("removing a key not installed: %v", err)
	}
}
