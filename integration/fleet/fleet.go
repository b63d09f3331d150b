package fleet

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Fleet is a set of Caddy nodes in one serf cluster behind one Front,
// with a Timeline of every node's connections.
type Fleet struct {
	bin, dir string
	settings Settings
	// Key is the fleet's gossip key.
	Key string
	// Front is the outer load balancer.
	Front Front
	// Timeline records every node's held connections over time.
	Timeline *Timeline

	mu    sync.Mutex
	nodes []*Node // behind the balancer, in start order; killed ones stay, marked in dead
	all   []*Node // every node started, for Close
	dead  map[string]bool

	stopSampling chan struct{}
	sampling     sync.WaitGroup
}

// New starts the front named front (one of FrontNames; empty is
// FrontRandom) and the timeline's sampler (every sampleEvery); nodes are
// added with AddNode. bin is a cmd/caddy binary, dir a directory for the
// nodes' and the front's files.
func New(bin, dir, front string, s Settings, sampleEvery time.Duration) (*Fleet, error) {
	fr, err := StartFront(front, dir)
	if err != nil {
		return nil, err
	}
	f := &Fleet{
		bin: bin, dir: dir, settings: s, Key: NewKey(), Front: fr,
		Timeline: NewTimeline(), dead: map[string]bool{}, stopSampling: make(chan struct{}),
	}
	f.sampling.Add(1)
	go f.sample(sampleEvery)
	return f, nil
}

// NewKey returns a random 32-byte gossip key, base64-encoded.
func NewKey() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}

// Close stops the sampler, the balancer and every node still running.
func (f *Fleet) Close() error {
	close(f.stopSampling)
	f.sampling.Wait()
	errs := []error{f.Front.Close()}
	f.mu.Lock()
	all := slices.Clone(f.all)
	f.mu.Unlock()
	for _, n := range all {
		errs = append(errs, n.Proc.Kill())
	}
	return errors.Join(errs...)
}

// Spec returns the spec a node named name gets: the fleet's settings and
// key, joined to the first node.
func (f *Fleet) Spec(name string) NodeSpec {
	spec := NodeSpec{Name: name, Key: f.Key, Settings: f.settings}
	f.mu.Lock()
	if len(f.nodes) > 0 {
		spec.Join = f.nodes[0].Serf
	}
	f.mu.Unlock()
	return spec
}

// AddNode starts a node named name from Spec(name), or from spec when
// given, and, when behind is true, puts it behind the balancer (on an
// error from the front the node runs on, out of Nodes, until Close).
func (f *Fleet) AddNode(name string, behind bool, spec ...NodeSpec) (*Node, error) {
	s := f.Spec(name)
	if len(spec) > 0 {
		s = spec[0]
	}
	n, err := StartNode(f.bin, filepath.Join(f.dir, name), s)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.all = append(f.all, n)
	f.mu.Unlock()
	if !behind {
		return n, nil
	}
	if err := f.Front.Add(n.HTTP); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.nodes = append(f.nodes, n)
	f.mu.Unlock()
	return n, nil
}

// Nodes returns the nodes behind the balancer that have not been killed,
// in start order.
func (f *Fleet) Nodes() []*Node {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(f.nodes), func(n *Node) bool { return f.dead[n.Name] })
}

// Kill takes n out of the balancer and sends it SIGKILL, even when the
// front failed to take it out.
func (f *Fleet) Kill(n *Node) error {
	rmErr := f.Front.Remove(n.HTTP)
	f.mu.Lock()
	f.dead[n.Name] = true
	f.mu.Unlock()
	return errors.Join(rmErr, n.Proc.Kill())
}

// Stop drains n as the operations guide's recipe has it: the balancer
// takes it out first (no new connection reaches it), then SIGTERM lets
// Caddy finish the requests in flight and close its connections, whose
// clients reconnect through the balancer. It waits up to timeout for the
// process to exit. n is out of Nodes until Restart. If the front fails
// to take n out, n is not stopped: new connections would still reach it
// while it shuts down.
func (f *Fleet) Stop(n *Node, timeout time.Duration) error {
	if err := f.Front.Remove(n.HTTP); err != nil {
		return err
	}
	f.mu.Lock()
	f.dead[n.Name] = true
	f.mu.Unlock()
	if err := n.Proc.Signal(syscall.SIGTERM); err != nil {
		return err
	}
	select {
	case <-n.Proc.Done():
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("%s still running %v after SIGTERM", n.Name, timeout)
	}
}

// Restart starts n again, a new process with its spec on its own ports,
// joining the cluster through the first other live node (the first node
// of a fleet has nobody to join when it first starts), and puts it back
// behind the balancer once its admin API answers.
func (f *Fleet) Restart(n *Node) error {
	for _, o := range f.Nodes() {
		if o != n {
			n.Spec.Join = o.Serf
			break
		}
	}
	if err := n.start(f.bin, filepath.Join(f.dir, n.Name)); err != nil {
		return err
	}
	f.mu.Lock()
	delete(f.dead, n.Name) // already in f.all: Close kills its new process
	f.mu.Unlock()
	return f.Front.Add(n.HTTP)
}

// Snapshot is every live node's view at one moment.
type Snapshot struct {
	Nodes []*Node
	Views []View
	Errs  []error
}

// Snapshot reads every live node's admin view, concurrently.
func (f *Fleet) Snapshot() Snapshot {
	ns := f.Nodes()
	s := Snapshot{Nodes: ns, Views: make([]View, len(ns)), Errs: make([]error, len(ns))}
	var wg sync.WaitGroup
	for i, n := range ns {
		wg.Go(func() { s.Views[i], s.Errs[i] = n.View() })
	}
	wg.Wait()
	return s
}

// Err returns the first node's error, if any.
func (s Snapshot) Err() error {
	for _, err := range s.Errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// Held returns each node's held connections (-1 for a node that did not
// answer).
func (s Snapshot) Held() []int {
	out := make([]int, len(s.Views))
	for i, v := range s.Views {
		out[i] = v.Held()
		if s.Errs[i] != nil {
			out[i] = -1
		}
	}
	return out
}

// Total returns the connections all nodes hold.
func (s Snapshot) Total() int {
	t := 0
	for _, h := range s.Held() {
		t += max(h, 0)
	}
	return t
}

// Shed returns the connections all nodes have shed.
func (s Snapshot) Shed() int {
	t := 0
	for _, v := range s.Views {
		t += v.Shed()
	}
	return t
}

// Active reports whether any node is in a shedding phase.
func (s Snapshot) Active() bool {
	for _, v := range s.Views {
		if v.Decision.Shedding || v.Decision.Lifting {
			return true
		}
	}
	return false
}

// Within reports whether every node holds within ±band (0.2 = 20%) of the
// average of total over the nodes, one connection of rounding allowed.
func (s Snapshot) Within(total int, band float64) bool {
	avg := float64(total) / float64(len(s.Views))
	for _, h := range s.Held() {
		if float64(h) > avg*(1+band)+1 || float64(h) < avg*(1-band)-1 {
			return false
		}
	}
	return true
}

// String describes the snapshot in one line.
func (s Snapshot) String() string {
	var b strings.Builder
	for i, n := range s.Nodes {
		if s.Errs[i] != nil {
			fmt.Fprintf(&b, "%s: %v; ", n.Name, s.Errs[i])
			continue
		}
		v := s.Views[i]
		state := ""
		switch {
		case v.Decision.Lifting:
			state = " lifting"
		case v.Decision.Shedding:
			state = " shedding"
		}
		fmt.Fprintf(&b, "%s=%d%s ", n.Name, v.Held(), state)
	}
	return strings.TrimSpace(b.String())
}

// WaitFor polls Snapshot every 50 ms until cond holds, or returns an
// error naming what once timeout has passed.
func (f *Fleet) WaitFor(timeout time.Duration, what string, cond func(Snapshot) (bool, string)) (Snapshot, error) {
	deadline := time.Now().Add(timeout)
	for {
		s := f.Snapshot()
		ok, why := false, ""
		if err := s.Err(); err != nil {
			why = err.Error()
		} else {
			ok, why = cond(s)
		}
		if ok {
			return s, nil
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("timed out after %v waiting for %s; last: %s (%s)", timeout, what, why, s)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// sample records the live nodes' held connections every period.
func (f *Fleet) sample(every time.Duration) {
	defer f.sampling.Done()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-f.stopSampling:
			return
		case <-tick.C:
		}
		s := f.Snapshot()
		held := map[string]int{}
		for i, n := range s.Nodes {
			if s.Errs[i] == nil {
				held[n.Name] = s.Views[i].Held()
			}
		}
		f.Timeline.Add(held)
	}
}
