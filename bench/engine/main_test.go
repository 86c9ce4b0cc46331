package engine

import (
	"os"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
)

// The test binary is the ProcessCopier helper of TestRunBaselines.
func TestMain(m *testing.M) {
	baseline.ServeIfHelper()
	os.Exit(m.Run())
}
