package main

import (
	"os"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
)

// run starts os.Executable() as the segment copy baseline's helper: in
// tests, the test binary, which serves it as kvbench's main does.
func TestMain(m *testing.M) {
	baseline.ServeIfHelper()
	serveSnapshotReader()
	os.Exit(m.Run())
}
