//go:build race

package gossipavg

// raceEnabled is true when the test binary runs under the race detector.
const raceEnabled = true
