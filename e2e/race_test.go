//go:build race

package e2e

// raceEnabled: under the race detector sync.Pool drops a quarter of the
// buffers put back, on purpose, and ristretto records accesses through
// pooled buffers, so its frequency estimate sees almost nothing. Tests of
// the admission policy skip there; `make test` runs them without -race.
const raceEnabled = true
