package remote_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// TestInvalidateReachesTheCluster: keys invalidated on node A are gone
// from the cluster for every node when Invalidate returns (B no longer
// finds them), and no node loads their old values again; what B computes
// and publishes afterwards is its own, shared with A too. A namespace
// invalidated whole is invalid for every node when Invalidate returns,
// before its garbage is swept; blocks published afterwards are shared
// again. A's fences are gone once the records are written.
func TestInvalidateReachesTheCluster(t *testing.T) {
	c := rediscluster.ForTest(t)
	a, b := startNode(t, c, nodeOpts{}), startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(21, 8)
	ea.store(t, hs, seq(0, 8))
	flush(t, a)
	if n := inCluster(t, c, ea, hs); n != 8 {
		t.Fatalf("%d of 8 blocks in the cluster after A's publish", n)
	}

	// Keys: gone from A and from the cluster when Invalidate returns.
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(hs[:4]...)); err != nil {
		t.Fatal(err)
	}
	if n := inCluster(t, c, ea, hs[:4]); n != 0 {
		t.Fatalf("%d invalidated blocks still in the cluster", n)
	}
	if keys, whole := a.Svc.RemoteFences(); keys != 0 || whole != 0 {
		t.Fatalf("A fences %d keys, %d namespaces once the records are written, want none", keys, whole)
	}
	if lr := ea.lookup(t, hs); lr.Ready != 0 {
		t.Fatalf("A offers %d blocks of an invalidated prefix (tiers %v)", lr.Ready, lr.Tiers)
	}
	if lr := eb.lookup(t, hs); lr.Ready != 0 {
		t.Fatalf("B offers %d blocks of a prefix A invalidated", lr.Ready)
	}
	if lr := eb.lookup(t, hs[4:]); lr.Ready != 4 || lr.Tiers[0] != pb.Tier_TIER_REMOTE {
		t.Fatalf("B: %d of the blocks A kept, first in %v; want 4 REMOTE", lr.Ready, lr.Tiers)
	}
	// B publishes two of them again (its engine computed them): they
	// are stamped with the new generations, and every node shares them.
	eb.store(t, hs[:2], seq(10, 2))
	flush(t, b)
	if n := inCluster(t, c, ea, hs[:2]); n != 2 {
		t.Fatalf("%d of B's 2 blocks in the cluster", n)
	}
	if lr := ea.lookup(t, hs[:2]); lr.Ready != 2 || lr.Tiers[0] != pb.Tier_TIER_REMOTE {
		t.Fatalf("A: %d of the blocks B computed again, first in %v; want 2 REMOTE", lr.Ready, lr.Tiers)
	}
	if st := ea.load(t, hs[:2], seq(20, 2)); count(st)[okSt] != 2 {
		t.Fatalf("A loading blocks B computed again: %v, want both OK", count(st))
	}

	// The namespace whole: no node is offered anything of it once
	// Invalidate returns, the sweep aside (it is garbage collection).
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, nil); err != nil {
		t.Fatal(err)
	}
	if lr := ea.lookup(t, hs[4:]); lr.Ready != 0 {
		t.Fatalf("A offers %d blocks of a namespace it invalidated whole", lr.Ready)
	}
	if lr := eb.lookup(t, hs[4:]); lr.Ready != 0 {
		t.Fatalf("B offers %d blocks of a namespace A invalidated whole", lr.Ready)
	}
	eb2 := register(t, startNode(t, c, nodeOpts{}), model, fp) // a fresh node: nothing local
	if st := eb2.load(t, hs[2:], seq(0, 6)); count(st)[missingSt] != 6 {
		t.Fatalf("a fresh node loading a namespace A invalidated whole: %v, want all MISSING", count(st))
	}
	waitFor(t, func() error {
		if n := a.Svc.RemoteSweeps(); n != 0 {
			return errors.New("the namespace's sweep has not gone through")
		}
		return nil
	})
	if keys, whole := a.Svc.RemoteFences(); keys != 0 || whole != 0 {
		t.Fatalf("A still fences %d keys, %d namespaces", keys, whole)
	}
	if n := inCluster(t, c, ea, hs); n != 0 {
		t.Fatalf("%d blocks of a namespace invalidated whole still in the cluster after its sweep", n)
	}
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "sweep", "result", "deleted"); n < 6 {
		t.Fatalf("A's sweep deleted %v keys, want at least the 6 values (4 A kept, 2 B published)", n)
	}
	// Published after the invalidation: shared again, A included.
	eb.store(t, hs[4:], seq(40, 4))
	flush(t, b)
	if lr := ea.lookup(t, hs[4:]); lr.Ready != 4 || lr.Tiers[0] != pb.Tier_TIER_REMOTE {
		t.Fatalf("A after the sweep: %d ready, first in %v; want 4 REMOTE", lr.Ready, lr.Tiers)
	}
	if st := ea.load(t, hs[4:], seq(50, 4)); count(st)[okSt] != 4 {
		t.Fatalf("A loading blocks published after the sweep: %v", count(st))
	}
	for _, d := range []*testenv.Daemon{a, b} {
		if err := d.Svc.CheckAccounting(); err != nil {
			t.Fatal(err)
		}
	}
}

// gatedStore holds every Get that reads headers (a Lookup's, a load's, a
// publisher's look), once armed, until release is closed, telling entered
// when one begins. The reads of a Store's stamps go through.
type gatedStore struct {
	remote.Store
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (g *gatedStore) Get(ctx context.Context, fs []remote.Fetch) error {
	if g.armed.Load() && len(fs) > 0 && len(fs[0].Head) > 0 {
		g.entered <- struct{}{}
		<-g.release
	}
	return g.Store.Get(ctx, fs)
}

// TestInvalidateNeverWaitsForTheCluster: a Lookup with a lease asks the
// cluster about the keys past its local prefix after it has filed its
// lease, not while it holds what Invalidate takes: an Invalidate (and the
// leasing Lookups that would queue behind it) never waits for a round trip
// to the cluster.
func TestInvalidateNeverWaitsForTheCluster(t *testing.T) {
	c := rediscluster.ForTest(t)
	store, err := remote.NewRedis(remote.RedisConfig{Addrs: c.Addrs()[:1], Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedStore{Store: store, entered: make(chan struct{}, 1), release: make(chan struct{})}
	d := testenv.Start(t, testenv.Options{Quiet: true, CPUBytes: 64 << 20, ChunkBytes: 64 << 20, Remote: &offload.RemoteConfig{
		Store: g, Timeout: 2 * time.Second, Write: offload.WriteNone,
	}})
	e := register(t, d, model, fingerprint(t))
	hs := e.hashes(31, 3)
	e.store(t, hs[:1], seq(0, 1))
	g.armed.Store(true)
	looked := make(chan error, 1)
	go func() {
		_, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), 5000)
		looked <- err
	}()
	<-g.entered // the Lookup waits on the cluster
	invalidated := make(chan error, 1)
	go func() {
		_, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs[:1]...))
		invalidated <- err
	}()
	var ierr error
	select {
	case ierr = <-invalidated:
	case <-time.After(30 * time.Second):
		t.Error("Invalidate waited for a Lookup's round trip to the cluster")
		close(g.release)
		ierr = <-invalidated
	}
	select {
	case <-g.release:
	default:
		close(g.release)
	}
	if ierr != nil {
		t.Fatal(ierr)
	}
	if err := <-looked; err != nil {
		t.Fatal(err)
	}
}
