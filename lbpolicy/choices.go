package lbpolicy

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// Choices is how many upstreams the least_time policy compares per request. In
// JSON it is a number of random candidates (2 or more; 2 is "power of two
// choices") or the string "all" for a full scan ("least response time").
// Zero or absent means automatic: a full scan for pools of up to 32
// upstreams (autoScanLimit), two random choices above.
type Choices int

const (
	// choicesAuto picks the mode from the pool size.
	choicesAuto Choices = 0
	// choicesAll scans the whole pool.
	choicesAll Choices = -1
)

// autoScanLimit is the largest pool that choicesAuto scans fully. A scan
// costs some 20 ns per upstream, well under 1 µs up to this size next to
// the tens of microseconds a proxied request costs, and it has no sampling
// floor: with best of two out of four upstreams of which two are slow, one
// request in six necessarily lands on a slow one, which sets the tail, and
// in pools of 24 with three degraded two choices left the median some 10%
// above a least-connections scan (simulated, lbpolicy's sim tests). Above
// this size the O(1) two-choice mode keeps selection cheap.
const autoScanLimit = 32

// forPool returns how many candidates to compare in a pool of n, 0 meaning
// all of them.
func (c Choices) forPool(n int) int {
	switch {
	case c == choicesAll, c == choicesAuto && n <= autoScanLimit:
		return 0
	case c == choicesAuto:
		return 2
	default:
		return int(c)
	}
}

func (c Choices) String() string {
	switch c {
	case choicesAll:
		return "all"
	case choicesAuto:
		return "auto"
	}
	return strconv.Itoa(int(c))
}

// choicesWant describes the valid values of choices, for error messages.
const choicesWant = `must be a number of 2 or more, "all" or "auto"`

// parseChoices parses the text form of Choices: a number of 2 or more,
// "all" or "auto". Unlike the internal values, "0" and "-1" are not
// accepted: they would silently mean "auto" and "all".
func parseChoices(s string) (Choices, error) {
	switch s {
	case "all":
		return choicesAll, nil
	case "auto":
		return choicesAuto, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 2 {
		return 0, errors.New(choicesWant)
	}
	return Choices(n), nil
}

func (c Choices) validate() error {
	if c == choicesAll || c == choicesAuto || c >= 2 {
		return nil
	}
	return fmt.Errorf("choices %s; got %d", choicesWant, int(c))
}

// MarshalJSON encodes choicesAll and choicesAuto as "all" and "auto", and
// counts as numbers.
func (c Choices) MarshalJSON() ([]byte, error) {
	switch c {
	case choicesAll, choicesAuto:
		return json.Marshal(c.String())
	}
	return json.Marshal(int(c))
}

// UnmarshalJSON accepts a number of 2 or more, "all" or "auto". 0, the
// value of an absent field, also means "auto"; null leaves c unchanged.
func (c *Choices) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		v, err := parseChoices(s)
		if err != nil {
			return fmt.Errorf("choices %q: %v", s, err)
		}
		*c = v
		return nil
	}
	var n int
	if err := json.Unmarshal(b, &n); err != nil || (n != 0 && n < 2) {
		return fmt.Errorf("choices %s: %s", b, choicesWant)
	}
	*c = Choices(n)
	return nil
}
