package partition

import (
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// MaxPartitions is the largest partition count a tag may name. A scheme
// of M partitions needs a replica for each of its M partitions before it
// takes traffic, so a larger M is almost certainly a typo; the cap also
// bounds what a single line of a naming file can make the handler
// allocate.
const MaxPartitions = 1024

// MaxSchemes is how many partition schemes (distinct partition counts)
// may coexist, as in brpc's DynamicPartitionChannel.
const MaxSchemes = 8

// Tag says which partition an upstream serves: partition Index of a
// scheme of Count partitions, written "Index/Count" (brpc's tag format).
type Tag struct {
	Index int
	Count int
}

// String returns the tag in "N/M" form.
func (t Tag) String() string { return strconv.Itoa(t.Index) + "/" + strconv.Itoa(t.Count) }

// ParseTag parses a partition tag "N/M": two decimal integers with
// 0 ≤ N < M ≤ MaxPartitions. The error names the offending value.
func ParseTag(s string) (Tag, error) {
	idx, cnt, ok := strings.Cut(s, "/")
	if !ok {
		return Tag{}, fmt.Errorf("invalid partition tag %q: want N/M, e.g. 0/3 (partition N of M)", s)
	}
	n, err := parseCount(idx)
	if err != nil {
		return Tag{}, fmt.Errorf("invalid partition tag %q: partition index %q is not a non-negative integer", s, idx)
	}
	m, err := parseCount(cnt)
	if err != nil {
		return Tag{}, fmt.Errorf("invalid partition tag %q: partition count %q is not a positive integer", s, cnt)
	}
	switch {
	case m < 1:
		return Tag{}, fmt.Errorf("invalid partition tag %q: partition count must be at least 1", s)
	case m > MaxPartitions:
		return Tag{}, fmt.Errorf("invalid partition tag %q: partition count %d exceeds the maximum of %d", s, m, MaxPartitions)
	case n >= m:
		return Tag{}, fmt.Errorf("invalid partition tag %q: partition index %d must be less than the partition count %d", s, n, m)
	}
	return Tag{Index: n, Count: m}, nil
}

// parseCount accepts only ASCII digits (no sign, no spaces), at most 9 of
// them so the value always fits an int.
func parseCount(s string) (int, error) {
	if s == "" || len(s) > 9 {
		return 0, strconv.ErrSyntax
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, strconv.ErrSyntax
		}
	}
	return strconv.Atoi(s)
}

// Entry is one tagged upstream: an address to dial and its partition.
type Entry struct {
	Dial string
	Tag  Tag
}

// checkDial validates an upstream dial address: a Caddy network address
// ("host:port", "unix//path", …) that names exactly one socket. The port
// is required: these are dial addresses, not URLs, so there is no scheme
// to default it from, and a port-less address dialed as is would go to
// port 80 without anyone having said so. It
// returns the address reverse_proxy will report for it (its
// {http.reverse_proxy.upstream.hostport}).
func checkDial(dial string) (string, error) {
	if strings.Contains(dial, "://") {
		return "", fmt.Errorf("invalid upstream address %q: give host:port without a scheme (configure TLS with `transport http { tls }`)", dial)
	}
	addr, err := caddy.ParseNetworkAddress(dial)
	if err != nil {
		return "", fmt.Errorf("invalid upstream address %q: %v", dial, err)
	}
	if n := addr.PortRangeSize(); n != 1 {
		return "", fmt.Errorf("invalid upstream address %q: must name exactly one socket, not a port range of %d", dial, n)
	}
	if !addr.IsUnixNetwork() {
		if addr.Host == "" {
			return "", fmt.Errorf("invalid upstream address %q: missing host", dial)
		}
		if addr.StartPort == 0 {
			return "", fmt.Errorf("invalid upstream address %q: missing port; give host:port, e.g. %s", dial, net.JoinHostPort(addr.Host, "80"))
		}
	}
	return addr.JoinHostPort(0), nil
}
