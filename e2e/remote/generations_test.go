package remote_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// The invalidation contract on the network's terms (docs/remote.md,
// Invalidate): once Invalidate returns, no node is served the bytes it
// invalidated, whatever lands in the cluster afterwards (a publish queued
// before it, a SET whose reply timed out), and whatever the cluster does
// (a resharding moving keys under a sweep).

// TestInvalidateRacingStore: an Invalidate racing a Store of the same key.
// Whenever the Invalidate won (A no longer holds the block), no node is
// offered it from the cluster afterwards. The publish used to be queued
// after the entry's lock was released: an Invalidate in between cancelled
// nothing, and the old bytes were SET after its delete, for every node.
func TestInvalidateRacingStore(t *testing.T) {
	c := rediscluster.ForTest(t)
	a, b := startNode(t, c, nodeOpts{}), startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	won := 0
	const rounds = 1500
	for i := 0; i < rounds; i++ {
		h := ea.hashes(uint64(5000+i), 1)
		ea.m.Fill(ea.r, 0, h[0])
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if _, err := ea.c.Store(context.Background(), ea.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), h, seq(0, 1))}, true); err != nil {
				t.Error(err)
			}
		}()
		go func() {
			defer wg.Done()
			if _, err := ea.c.Invalidate(context.Background(), []uint32{ea.reg.NamespaceId}, testenv.Keys(h...)); err != nil {
				t.Error(err)
			}
		}()
		wg.Wait()
		if t.Failed() {
			return
		}
		flush(t, a) // whatever A queued has landed, or never will
		if lr := ea.lookup(t, h); lr.Ready == 1 && lr.Tiers[0] != pb.Tier_TIER_REMOTE {
			continue // the Store came after: A holds it again, and may share it
		}
		won++
		if lr := eb.lookup(t, h); lr.Ready != 0 {
			t.Fatalf("round %d: B is offered a block A invalidated (A does not hold it): %v", i, lr.Tiers)
		}
		if lr := ea.lookup(t, h); lr.Ready != 0 {
			t.Fatalf("round %d: A is offered a block it invalidated: %v", i, lr.Tiers)
		}
	}
	t.Logf("%d of %d rounds ended with the block invalidated", won, rounds)
}

// lateStore reports every SET, once armed, failed with a timeout at once,
// and holds it: the test sends it later, as a slow link delivers a write
// whose reply came too late.
type lateStore struct {
	remote.Store
	armed atomic.Bool
	held  chan func()
}

func (l *lateStore) Set(ctx context.Context, items []remote.Item) []error {
	if !l.armed.Load() {
		return l.Store.Set(ctx, items)
	}
	cp := make([]remote.Item, len(items))
	for i, it := range items {
		cp[i] = it
		cp[i].Value = bytes.Clone(it.Value) // the publisher reuses its buffers
	}
	l.held <- func() {
		for i, err := range l.Store.Set(context.Background(), cp) {
			if err != nil {
				panic(fmt.Sprintf("the late SET of %s: %v", cp[i].Key, err))
			}
		}
	}
	errs := make([]error, len(items))
	for i := range errs {
		errs[i] = fmt.Errorf("%w: i/o timeout (held)", remote.ErrUnavailable)
	}
	return errs
}

// TestLateSetIsNeverServed: A's publish of a block times out but its SET
// still lands, after A invalidated the block and its Invalidate returned.
// The bytes are in the cluster, and no node is served them: not B, not a
// node started afterwards, not A. A block computed again afterwards (by
// B) replaces them and is shared. It used to be loaded by every node.
func TestLateSetIsNeverServed(t *testing.T) {
	c := rediscluster.ForTest(t)
	late := &lateStore{held: make(chan func(), 1)}
	a := startNode(t, c, nodeOpts{publishers: 1, wrapStore: func(s remote.Store) remote.Store { late.Store = s; return late }})
	b := startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	k := ea.hashes(101, 1)
	late.armed.Store(true)
	ea.store(t, k, seq(0, 1))
	send := <-late.held // A's SET, reported timed out
	late.armed.Store(false)
	flush(t, a)
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(k...)); err != nil {
		t.Fatal(err)
	}
	send() // it lands now
	if n := inCluster(t, c, ea, k); n != 1 {
		t.Fatal("the late SET is not in the cluster")
	}
	ec := register(t, startNode(t, c, nodeOpts{}), model, fp)
	for name, e := range map[string]*engine{"A": ea, "B": eb, "a node started after": ec} {
		if lr := e.lookup(t, k); lr.Ready != 0 {
			t.Fatalf("%s is offered a block invalidated before its SET landed: %v", name, lr.Tiers)
		}
	}
	for name, e := range map[string]*engine{"B": eb, "a node started after": ec, "A": ea} {
		if st := e.load(t, k, seq(5, 1)); st[0] == okSt {
			t.Fatalf("%s loaded a block invalidated before its SET landed", name)
		}
		send() // deleted as garbage by the load that met it: land it again
	}
	eb.store(t, k, seq(0, 1))
	flush(t, b)
	if st := ea.load(t, k, seq(7, 1)); st[0] != okSt {
		t.Fatalf("A loading the block B computed again: %v", st[0])
	}
}

// sweepGate holds every DeletePrefix, once armed, until release is closed.
type sweepGate struct {
	remote.Store
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (g *sweepGate) DeletePrefix(ctx context.Context, prefix string, done *remote.Swept) (int, error) {
	if g.armed.Load() {
		select {
		case g.entered <- struct{}{}:
		default:
		}
		select {
		case <-g.release:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return g.Store.DeletePrefix(ctx, prefix, done)
}

// TestReshardMidSweep: A invalidates a namespace whole while slots holding
// its blocks are resharded to another master, page by page, under A's
// sweep. No node is served the namespace's old blocks at any point: not
// while the slots are split between two masters, not once they moved,
// not after the sweep, and not when an old value the sweep did not see
// (one a resharding hid from it) is still there afterwards. Blocks
// computed again afterwards are shared. The sweep used to be what made
// the invalidation hold for the fleet, and a key it missed came back for
// every node once its fence lifted.
func TestReshardMidSweep(t *testing.T) {
	c := rediscluster.ForTest(t)
	g := &sweepGate{entered: make(chan struct{}, 1), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(release)
	a := startNode(t, c, nodeOpts{wrapStore: func(s remote.Store) remote.Store { g.Store = s; return g }})
	b := startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(111, 24)
	ea.store(t, hs, seq(0, 24))
	flush(t, a)
	cc := c.ClusterClient()
	defer cc.Close()
	old := make([][]byte, len(hs))
	keys := make([]string, len(hs))
	for i, h := range hs {
		keys[i], _ = a.Svc.RemoteKey(ea.reg.NamespaceId, 0, h)
		v, err := cc.Get(ctx(t), keys[i]).Bytes()
		if err != nil {
			t.Fatal(err)
		}
		old[i] = v
	}

	g.armed.Store(true)
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, nil); err != nil {
		t.Fatal(err)
	}
	<-g.entered // A's sweep has begun, and waits
	ec := register(t, startNode(t, c, nodeOpts{}), model, fp)
	nodes := map[string]*engine{"A": ea, "B": eb, "a node started after": ec}
	neverServed := func(when string) {
		t.Helper()
		for name, e := range nodes {
			if lr := e.lookup(t, hs); lr.Ready != 0 {
				t.Fatalf("%s: %s is offered %d blocks of a namespace invalidated whole", when, name, lr.Ready)
			}
			for i, st := range e.load(t, hs, seq(0, 24)) {
				if st == okSt {
					t.Fatalf("%s: %s loaded block %d of a namespace invalidated whole", when, name, i)
				}
			}
		}
	}
	neverServed("before the sweep")
	// Reshard the slots of three blocks to the next master, checking
	// between the pages of keys each move takes.
	moved := map[int]bool{}
	for i := 0; i < len(keys) && len(moved) < 3; i++ {
		slot, err := c.KeySlot(ctx(t), keys[i])
		if err != nil {
			t.Fatal(err)
		}
		if moved[slot] {
			continue
		}
		moved[slot] = true
		from, err := c.NodeFor(ctx(t), keys[i])
		if err != nil {
			t.Fatal(err)
		}
		to := c.Node((from.Index() + 1) % len(c.Nodes()))
		if err := c.MoveSlotPaged(ctx(t), slot, to, func(int) { neverServed(fmt.Sprintf("slot %d moving", slot)) }); err != nil {
			t.Fatal(err)
		}
	}
	neverServed("after the resharding")
	release()
	waitFor(t, func() error {
		if n := a.Svc.RemoteSweeps(); n != 0 {
			return fmt.Errorf("%d namespaces still to sweep", n)
		}
		return nil
	})
	neverServed("after the sweep")
	// Old values the sweep did not see: the namespace's records still
	// make them stale for every node.
	for i, k := range keys {
		if err := cc.Set(ctx(t), k, old[i], 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	neverServed("with old values the sweep missed")
	// B's client follows the resharding: a batch that met MOVED failed
	// and the slot map reloads behind it. Once B's loads are answered,
	// its publishes reach the slots' new masters.
	waitFor(t, func() error {
		if st := eb.load(t, hs[:4], seq(0, 4)); count(st)[missingSt] != 4 {
			return fmt.Errorf("B's loads of the moved slots: %v", count(st))
		}
		return nil
	})
	eb.store(t, hs[:4], seq(0, 4))
	flush(t, b)
	if st := ea.load(t, hs[:4], seq(30, 4)); count(st)[okSt] != 4 {
		t.Fatalf("A loading blocks B computed again after the invalidation: %v (B published %v, exists %v, error %v)", count(st),
			metric(t, b, "kvoffload_remote_blocks_total", "op", "publish", "result", "published"),
			metric(t, b, "kvoffload_remote_blocks_total", "op", "publish", "result", "exists"),
			metric(t, b, "kvoffload_remote_blocks_total", "op", "publish", "result", "error"))
	}
}

// recordGate holds every SetGens (an Invalidate's writes of generation
// records), once armed, until release is closed.
type recordGate struct {
	remote.Store
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (g *recordGate) SetGens(ctx context.Context, gs []remote.GenWrite) []error {
	if g.armed.Load() {
		g.entered <- struct{}{}
		<-g.release
	}
	return g.Store.SetGens(context.Background(), gs)
}

// TestInvalidateWaitingOnTheClusterKeepsThePolicy: blocks stored again
// while an Invalidate of them waits on the cluster are tracked by the CPU
// tier's policy afterwards (and so can be evicted): the policy forgets the
// invalidated keys together with the index change. It used to forget them
// after the round trips, untracking the new copies for good: the CPU tier
// filled up and stores failed NO_SPACE.
func TestInvalidateWaitingOnTheClusterKeepsThePolicy(t *testing.T) {
	c := rediscluster.ForTest(t)
	g := &recordGate{entered: make(chan struct{}, 1), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(release)
	a := startNode(t, c, nodeOpts{wrapStore: func(s remote.Store) remote.Store { g.Store = s; return g }})
	ea := register(t, a, model, fingerprint(t))
	hs := ea.hashes(121, 16)
	ea.store(t, hs, seq(0, 16))
	flush(t, a)
	g.armed.Store(true)
	invalidated := make(chan error, 1)
	go func() {
		_, err := ea.c.Invalidate(context.Background(), []uint32{ea.reg.NamespaceId}, testenv.Keys(hs...))
		invalidated <- err
	}()
	<-g.entered // the index has let go of them; the records' round trip waits
	g.armed.Store(false)
	ea.store(t, hs, seq(16, 16)) // the engine computes them again meanwhile
	release()
	if err := <-invalidated; err != nil {
		t.Fatal(err)
	}
	if lr := ea.lookup(t, hs); lr.Ready != 16 || lr.Tiers[0] != pb.Tier_TIER_CPU {
		t.Fatalf("the blocks stored again: %d ready, first in %v; want 16 in the CPU tier", lr.Ready, lr.Tiers)
	}
	flush(t, a) // they are published once their records are written
	if err := a.Svc.CheckInvariants(); err != nil {
		t.Fatal(err) // an entry whose slot its policy does not count
	}
}

// TestFencesAreBoundedPerNamespace: a node that invalidated more keys of
// one namespace than the old fence bound (65,536, one by one) keeps no fence
// once their records are written, and an Invalidate of one key of another
// namespace invalidates that key only: the other blocks of that namespace
// stay shared. The bound used to count the fences of every namespace, and
// fences stayed after their deletes: with 65,536 of an old namespace, one
// key's Invalidate swept the other namespace whole, for every node.
func TestFencesAreBoundedPerNamespace(t *testing.T) {
	c := rediscluster.ForTest(t)
	a, b := startNode(t, c, nodeOpts{}), startNode(t, c, nodeOpts{})
	old := register(t, a, model, fingerprint(t))
	for i := 0; i < 8; i++ {
		if _, err := old.c.Invalidate(ctx(t), []uint32{old.reg.NamespaceId}, testenv.Keys(old.hashes(uint64(1000+i), 8192)...)); err != nil {
			t.Fatal(err)
		}
	}
	if keys, whole := a.Svc.RemoteFences(); keys != 0 || whole != 0 {
		t.Fatalf("A fences %d keys and %d namespaces once the records are written, want none", keys, whole)
	}
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(131, 8)
	ea.store(t, hs, seq(0, 8))
	flush(t, a)
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(hs[0])); err != nil {
		t.Fatal(err)
	}
	if lr := eb.lookup(t, hs[1:]); lr.Ready != 7 || lr.Tiers[0] != pb.Tier_TIER_REMOTE {
		t.Fatalf("B after one key of the namespace was invalidated: %d of the 7 others ready, first in %v", lr.Ready, lr.Tiers)
	}
	if st := eb.load(t, hs[1:], seq(0, 7)); count(st)[okSt] != 7 {
		t.Fatalf("B loading the 7 blocks not invalidated: %v", count(st))
	}
	if lr := eb.lookup(t, hs[:1]); lr.Ready != 0 {
		t.Fatal("B is offered the block invalidated")
	}
}

// TestPendingBoundIsPerNamespace: with a master down, more keys of one
// namespace wait for their records than its bound (4096): that namespace
// is invalidated whole, and another namespace's pending keys stay keys
// (its other blocks still served once the master is back).
func TestPendingBoundIsPerNamespace(t *testing.T) {
	c := rediscluster.ForTest(t)
	a := startNode(t, c, nodeOpts{timeout: 300 * time.Millisecond})
	b := startNode(t, c, nodeOpts{timeout: 300 * time.Millisecond})
	busy := register(t, a, model, fingerprint(t))
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(151, 8)
	ea.store(t, hs, seq(0, 8))
	flush(t, a)
	victim := victimOf(t, c, ea, hs[0])
	up := down(t, victim)
	invalidateMissed(t, ea, testenv.Keys(hs[0]))
	// About a third of these are on the dead master: past 4096 pending.
	for i := 0; i < 2; i++ {
		invalidateMissed(t, busy, testenv.Keys(busy.hashes(uint64(2000+i), 8192)...))
	}
	keys, whole := a.Svc.RemotePendingDeletes()
	if whole != 1 || keys < 1 || keys > 4096 {
		t.Fatalf("pending: %d keys, %d namespaces; want the busy namespace whole and the other's key", keys, whole)
	}
	up()
	waitPending(t, a, 0, 0)
	if st := eb.load(t, hs, seq(0, 8)); st[0] == okSt || count(st)[okSt] != 7 {
		t.Fatalf("B loading the other namespace: %v, want the 7 not invalidated", count(st))
	}
}
