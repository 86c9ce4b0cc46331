package rediscluster

import (
	"context"
	"os"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// RequireEnv names the environment variable that makes a missing
// redis-server a test failure instead of a skip (.ci/run sets it).
const RequireEnv = "KVOFFLOADD_REQUIRE_REDIS"

var shared struct {
	mu  sync.Mutex
	c   *Cluster
	err error
}

// Shared returns the test binary's one cluster, starting it on first use:
// starting a cluster costs seconds, so a package's tests share one and
// keep their keys apart (each test its own namespace). A test that breaks
// it (kills, hangs, reconfigures a node) must leave it whole again.
// CloseShared, from TestMain, stops it.
func Shared() (*Cluster, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.c != nil || shared.err != nil {
		return shared.c, shared.err
	}
	if err := Available(); err != nil {
		shared.err = err
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// A port taken between choosing it and binding it fails the start;
	// another try picks other ports.
	for try := 0; try < 3; try++ {
		shared.c, shared.err = Start(ctx, Options{})
		if shared.err == nil {
			break
		}
	}
	return shared.c, shared.err
}

// CloseShared stops the shared cluster if one was started.
func CloseShared() error {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.c == nil {
		return nil
	}
	err := shared.c.Close()
	shared.c = nil
	return err
}

// QuietLogs drops go-redis's own log lines (a refused dial while a test
// has a node down is expected) for the rest of the process.
func QuietLogs() { redis.SetLogger(quiet{}) }

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// Required reports whether tests must fail rather than skip without Redis.
func Required() bool { return os.Getenv(RequireEnv) != "" }
