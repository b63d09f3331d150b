package fleet

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/caddy-lbx/lbx/integration/shedsim"
	"github.com/caddy-lbx/lbx/lbxtest/tcplb"
)

// Front is the outer load balancer in front of a fleet: the one address
// the clients connect to, which gives each new connection to one of the
// nodes it was told of. A shed client reconnects through it, so how it
// chooses decides what a rebalancer must shed (integration/shedsim).
type Front interface {
	// Addr is the address clients connect to.
	Addr() string
	// Add makes target (host:port) one of the nodes new connections go
	// to.
	Add(target string) error
	// Remove stops new connections to target; those it holds stay, for
	// the node to close (a graceful stop) or to die with it (a kill).
	Remove(target string) error
	// Close stops the balancer and every connection through it.
	Close() error
}

// The fronts StartFront knows.
const (
	// FrontRandom is lbxtest/tcplb, a Go TCP balancer that gives
	// each new connection to a random node (HAProxy's balance random).
	FrontRandom = "random"
	// FrontRoundRobin is HAProxy with balance roundrobin.
	FrontRoundRobin = "haproxy-roundrobin"
	// FrontLeastConn is HAProxy with balance leastconn, which counts its
	// own connections to each node.
	FrontLeastConn = "haproxy-leastconn"
)

// FrontNames lists the fronts StartFront knows, the default first.
var FrontNames = []string{FrontRandom, FrontRoundRobin, FrontLeastConn}

// frontBalancers is the shedsim balancer that places a reconnecting
// client as each front does.
var frontBalancers = map[string]shedsim.Balancer{
	FrontRandom:     shedsim.Random,
	FrontRoundRobin: shedsim.RoundRobin,
	FrontLeastConn:  shedsim.LeastConn,
}

// CheckFront returns an error naming name and the fronts there are when
// name is not one of FrontNames; empty is FrontRandom.
func CheckFront(name string) error {
	if _, ok := frontBalancers[frontOrDefault(name)]; !ok {
		return fmt.Errorf("front %q: want one of %s", name, strings.Join(FrontNames, ", "))
	}
	return nil
}

// IdealBalancer returns the shedsim balancer a perfect rebalancer behind
// the front named name is simulated with (Random for an unknown name,
// which StartFront refuses anyway).
func IdealBalancer(name string) shedsim.Balancer {
	return frontBalancers[frontOrDefault(name)]
}

// frontOrDefault returns name, or FrontRandom when it is empty.
func frontOrDefault(name string) string {
	if name == "" {
		return FrontRandom
	}
	return name
}

// FrontAvailable returns an error wrapping ErrNoHAProxy when the front
// named name runs haproxy and haproxy is not installed, so that a caller
// can say so before it starts anything.
func FrontAvailable(name string) error {
	if err := CheckFront(name); err != nil {
		return err
	}
	if !strings.HasPrefix(name, "haproxy-") {
		return nil
	}
	_, err := haproxyBinary()
	return err
}

// StartFront starts the front named name (one of FrontNames; empty is
// FrontRandom) on loopback, with no nodes; an HAProxy front keeps its
// files in dir. Without haproxy installed the error wraps ErrNoHAProxy.
func StartFront(name, dir string) (Front, error) {
	if err := CheckFront(name); err != nil {
		return nil, err
	}
	switch frontOrDefault(name) {
	case FrontRoundRobin:
		return StartHAProxy(filepath.Join(dir, "haproxy"), "roundrobin")
	case FrontLeastConn:
		return StartHAProxy(filepath.Join(dir, "haproxy"), "leastconn")
	}
	lb, err := tcplb.Start()
	if err != nil {
		return nil, err
	}
	return randomFront{lb}, nil
}

// randomFront is tcplb.Balancer as a Front.
type randomFront struct{ lb *tcplb.Balancer }

// Addr implements Front.
func (r randomFront) Addr() string { return r.lb.Addr }

// Add implements Front; tcplb cannot fail to add.
func (r randomFront) Add(target string) error {
	r.lb.Add(target)
	return nil
}

// Remove implements Front.
func (r randomFront) Remove(target string) error {
	r.lb.Remove(target)
	return nil
}

// Close implements Front.
func (r randomFront) Close() error {
	r.lb.Close()
	return nil
}
