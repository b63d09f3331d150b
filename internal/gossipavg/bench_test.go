package gossipavg

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// benchNode returns a node that has exchanged with peers partners, its
// entries table full, and the partners.
func benchNode(b *testing.B, peers int) (*Node, []*Node) {
	a := newNode(b, "node-a", 1, 500, 1)
	var partners []*Node
	for i := range peers {
		p := newNode(b, fmt.Sprintf("node-%03d", i), uint64(i+2), float64(i*10), 0)
		exchange(b, p, a, t0)
		partners = append(partners, p)
	}
	return a, partners
}

func BenchmarkTick(b *testing.B) {
	for _, peers := range []int{4, 16} {
		b.Run(fmt.Sprintf("pairs=%d", peers), func(b *testing.B) {
			a, partners := benchNode(b, peers)
			names := make([]string, 1000)
			for i := range names {
				names[i] = fmt.Sprintf("member-%04d", i)
			}
			rng := rand.New(rand.NewPCG(1, 1))
			now := t0
			b.ReportAllocs()
			for b.Loop() {
				now = now.Add(time.Millisecond)
				m, ok := a.Tick(now, names, rng)
				if !ok {
					b.Fatal("no request")
				}
				// As if the reply came: the pair is heard from, nothing is
				// pending, and the tick after does the same work.
				p := a.lookup(m.To)
				p.pending, p.heard = 0, now
			}
			_ = partners
		})
	}
}

func BenchmarkReceive(b *testing.B) {
	b.Run("request", func(b *testing.B) {
		a, partners := benchNode(b, 16)
		m := requestTo(b, partners[0], a.cfg.Name, t0)
		now := t0
		b.ReportAllocs()
		for b.Loop() {
			now = now.Add(time.Millisecond)
			m.Seq++
			if _, ok, err := a.Receive(now, m); err != nil || !ok {
				b.Fatal(err)
			}
		}
	})
	b.Run("reply", func(b *testing.B) {
		a, partners := benchNode(b, 16)
		m := requestTo(b, a, partners[0].cfg.Name, t0)
		r, _ := receive(b, partners[0], m, t0)
		now := t0
		b.ReportAllocs()
		for b.Loop() {
			now = now.Add(time.Millisecond)
			r.Version += 2
			if _, _, err := a.Receive(now, r); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkCodec(b *testing.B) {
	a, partners := benchNode(b, 16)
	m := requestTo(b, a, partners[0].cfg.Name, t0)
	buf, err := m.AppendBinary(nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("a request of dimension %d with %d entries: %d bytes", m.Dim, m.NumEntries, len(buf))
	b.Run("AppendBinary", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			buf, _ = m.AppendBinary(buf[:0])
		}
	})
	b.Run("Decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Decode(buf); err != nil {
				b.Fatal(err)
			}
		}
	})
}
