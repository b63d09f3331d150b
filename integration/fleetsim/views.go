package fleetsim

import (
	"math"
	"time"

	"github.com/caddy-lbx/lbx/internal/shed"
)

// gossip runs one gossipavg tick at now: every live node, in a random
// order, makes its request; the requests are delivered in a random
// order, each answered at once, and every message is lost with
// probability Config.Loss.
func (s *sim) gossip(now time.Time) error {
	s.queue = s.queue[:0]
	order := s.order()
	for _, i := range order {
		if m, ok := s.nodes[i].gossip.Tick(now, s.names, s.rng); ok {
			s.queue = append(s.queue, m)
		}
	}
	s.rng.Shuffle(len(s.queue), func(a, b int) { s.queue[a], s.queue[b] = s.queue[b], s.queue[a] })
	for k := range s.queue {
		m := &s.queue[k]
		if s.lost() {
			continue
		}
		to := s.nodes[s.byName[m.To]]
		if !to.live {
			continue
		}
		r, ok, err := to.gossip.Receive(now, *m)
		if err != nil {
			return err
		}
		if !ok || s.lost() {
			continue
		}
		if from := s.nodes[s.byName[r.To]]; from.live {
			if _, _, err := from.gossip.Receive(now, r); err != nil {
				return err
			}
		}
	}
	return nil
}

// order returns the live slots in a random order.
func (s *sim) order() []int {
	s.perm = append(s.perm[:0], s.live...)
	s.rng.Shuffle(len(s.perm), func(a, b int) { s.perm[a], s.perm[b] = s.perm[b], s.perm[a] })
	return s.perm
}

// lost draws whether a message is lost.
func (s *sim) lost() bool { return s.cfg.Loss > 0 && s.rng.Float64() < s.cfg.Loss }

// drawLags draws the tag lag of every (observer, member) pair of size
// slots: a lognormal with the configured median and 99th percentile, in
// intervals, rounded up (a report published at interval t is first seen
// at t + lag), at least 1 and at most maxLag. A pair keeps its lag for
// the run.
func (s *sim) drawLags(size int) {
	mu := math.Log(s.cfg.LagMedian)
	sigma := (math.Log(s.cfg.LagP99) - mu) / 2.3263478740408408 // z of 0.99
	s.lag = make([]uint8, size*size)
	rows := 1
	for k := range s.lag {
		l := math.Ceil(math.Exp(mu + sigma*s.rng.NormFloat64()))
		s.lag[k] = uint8(min(max(l, 1), maxLag))
		rows = max(rows, int(s.lag[k])+1)
	}
	s.pub = make([]float64, rows*size)
	for k := range s.pub {
		s.pub[k] = math.NaN()
	}
}

// size returns the number of slots the tag tables hold.
func (s *sim) size() int { return s.cfg.maxSize() }

// row returns the tag table row of interval t.
func (s *sim) row(t int) int {
	rows := len(s.pub) / s.size()
	return ((t % rows) + rows) % rows
}

// publish records every slot's tag of this interval: its smoothed load,
// or NaN when it is out of the fleet.
func (s *sim) publish() {
	size := s.size()
	base := s.row(s.t) * size
	for i := range size {
		v := math.NaN()
		if i < len(s.nodes) && s.nodes[i].live {
			v = s.nodes[i].local
		}
		s.pub[base+i] = v
	}
}

// tagView returns the View of observer o: its own load, and every other
// member's tag as published lag(o, m) intervals ago. The members it sees
// are alive, their reports fresh (a tag changes every interval, and At is
// when the observer saw it) and valid in the same metric, so the summary
// rule of rebalance (Params.standing) counts every one, and the View is
// their mean and the lowest of them (the first in name order on a tie,
// this node first).
func (s *sim) tagView(o int) shed.View {
	size := s.size()
	rows := len(s.pub) / size
	var base [maxLag + 1]int
	for k := 1; k < rows; k++ {
		base[k] = s.row(s.t-k) * size
	}
	self := s.nodes[o]
	v := shed.View{Counted: 1, Lowest: self.local, LowestName: self.name}
	sum := self.local
	lags := s.lag[o*size : (o+1)*size]
	lowest := -1
	for m := range len(s.nodes) {
		if m == o {
			continue
		}
		x := s.pub[base[lags[m]]+m]
		if x != x { // NaN: out of the fleet when published
			continue
		}
		sum += x
		v.Counted++
		if x < v.Lowest {
			v.Lowest, lowest = x, m
		}
	}
	if lowest >= 0 {
		v.LowestName = s.nodes[lowest].name
	}
	v.Average = sum / float64(v.Counted)
	return v
}
