package fleetsim

// reconnect hands c clients to live nodes through the outer balancer,
// counting those that land on a node that shed in this interval.
func (s *sim) reconnect(c int) {
	if c == 0 || len(s.live) == 0 {
		return
	}
	if s.cfg.Balancer == Random {
		for range c {
			s.land(s.live[s.rng.IntN(len(s.live))])
		}
		return
	}
	// Least connections: the live nodes grouped by count; the emptiest
	// group gives a node at random, which moves up one group.
	for k := range s.byCount {
		s.byCount[k] = s.byCount[k][:0]
	}
	least := -1
	for _, i := range s.live {
		k := s.nodes[i].conns
		for len(s.byCount) <= k+1 {
			s.byCount = append(s.byCount, nil)
		}
		s.byCount[k] = append(s.byCount[k], i)
		if least < 0 || k < least {
			least = k
		}
	}
	for range c {
		for len(s.byCount[least]) == 0 {
			least++
		}
		g := s.byCount[least]
		j := s.rng.IntN(len(g))
		i := g[j]
		g[j] = g[len(g)-1]
		s.byCount[least] = g[:len(g)-1]
		s.land(i)
		if len(s.byCount) <= least+1 {
			s.byCount = append(s.byCount, nil)
		}
		s.byCount[least+1] = append(s.byCount[least+1], i)
	}
}

// land gives node i one client.
func (s *sim) land(i int) {
	n := s.nodes[i]
	n.conns++
	if n.shed > 0 {
		s.res.Relanded++
	}
}
