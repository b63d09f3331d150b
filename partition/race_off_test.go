//go:build !race

package partition

// raceEnabled is true when the test binary runs under the race detector.
const raceEnabled = false
