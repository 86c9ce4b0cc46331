package rediscluster

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// ForTest returns the test binary's shared cluster (Shared), skipping the
// test where redis-server is not installed unless RequireEnv is set (then
// it fails). The package's TestMain is Main.
func ForTest(t testing.TB) *Cluster {
	t.Helper()
	c, err := Shared()
	if errors.Is(err, ErrNoRedis) && !Required() {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Main runs the tests of a package that uses the shared cluster: go-redis
// logs quietened, the cluster stopped once the tests are done, and no
// goroutine left behind. It returns the exit code for os.Exit.
func Main(m *testing.M) int {
	QuietLogs()
	code := m.Run()
	if err := CloseShared(); err != nil {
		fmt.Fprintln(os.Stderr, "stopping the redis cluster:", err)
		code = 1
	}
	if code == 0 {
		if err := leakcheck.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "leaked goroutines:", err)
			code = 1
		}
	}
	return code
}
