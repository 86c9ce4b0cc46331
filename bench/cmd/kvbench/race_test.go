//go:build race

package main

// raceDetector: the test binary runs under the race detector, which makes
// kvbench's own byte-for-byte checks and copies several times slower.
const raceDetector = true
