package testenv

import (
	"errors"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
)

// RedisCluster returns the test binary's shared Redis Cluster
// (rediscluster.Shared), skipping the test where redis-server is not
// installed unless KVOFFLOADD_REQUIRE_REDIS is set (then it fails). The
// package's TestMain stops it with rediscluster.CloseShared.
func RedisCluster(t testing.TB) *rediscluster.Cluster {
	t.Helper()
	c, err := rediscluster.Shared()
	if errors.Is(err, rediscluster.ErrNoRedis) && !rediscluster.Required() {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return c
}
