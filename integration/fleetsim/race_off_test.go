//go:build !race

package fleetsim

// raceEnabled is true when the test binary runs under the race detector.
const raceEnabled = false
