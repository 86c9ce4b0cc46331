package remote_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

// TestRecordsWaitForReplicas: with --remote-wait-replicas 1 on a cluster
// whose masters each have a replica, an Invalidate answers OK once the
// replicas hold its generation records (a failover would not bring the
// old ones back), and UNAVAILABLE while a replica does not acknowledge
// them (paused): the records are counted unreplicated
// (kvoffload_remote_errors_total{op="invalidate",kind="replicas"}), tried
// again, and go through once the replica answers. Without the wait the
// master's acknowledgement was enough, and the call answered OK.
func TestRecordsWaitForReplicas(t *testing.T) {
	if err := rediscluster.Available(); err != nil && !rediscluster.Required() {
		t.Skip(err)
	}
	c, err := rediscluster.Start(ctx(t), rediscluster.Options{Replicas: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	a := startNode(t, c, nodeOpts{timeout: time.Second, waitReplicas: 1})
	b := startNode(t, c, nodeOpts{timeout: time.Second})
	ea, eb, hs := sharedBlocks(t, c, a, b, 231, 12)
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(hs[:6]...)); err != nil {
		t.Fatalf("Invalidate with every replica answering: %v", err)
	}
	// Every record on its master's replica.
	for _, h := range hs[:6] {
		k, _ := a.Svc.RemoteKey(ea.reg.NamespaceId, 0, h)
		m, err := c.NodeFor(ctx(t), k)
		if err != nil {
			t.Fatal(err)
		}
		rc := c.Replicas()[m.Index()].Client()
		rc.ReadOnly(ctx(t))
		n, err := rc.Exists(ctx(t), k+":gen").Result()
		rc.Close()
		if err != nil || n != 1 {
			t.Fatalf("the generation record of %s is not on its master's replica: %d, %v", k, n, err)
		}
	}
	// The replica of hs[6]'s master stops answering.
	victim := victimOf(t, c, ea, hs[6])
	replica := c.Replicas()[victim.Index()]
	if err := replica.Pause(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { replica.Resume() })
	invalidateMissed(t, ea, testenv.Keys(hs[6:]...))
	if n := metric(t, a, "kvoffload_remote_errors_total", "op", "invalidate", "kind", "replicas"); n == 0 {
		t.Fatal("no invalidate error of kind replicas counted")
	}
	if lr := ea.lookup(t, hs[6:7]); lr.Ready != 0 {
		t.Fatalf("A offers a block it invalidated: %v", lr.Tiers)
	}
	if err := replica.Resume(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() error {
		if k, n := a.Svc.RemotePendingDeletes(); k+n != 0 {
			return fmt.Errorf("%d keys and %d namespaces still to record", k, n)
		}
		return nil
	})
	if st := eb.load(t, hs, seq(0, 12)); count(st)[missingSt] != 12 {
		t.Fatalf("B loading blocks A invalidated: %v, want all MISSING", count(st))
	}
}
