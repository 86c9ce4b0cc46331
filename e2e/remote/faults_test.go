package remote_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// onNode reports, for each hash, whether the cluster node n holds its key.
func onNode(t *testing.T, c *rediscluster.Cluster, e *engine, hs [][]byte, n *rediscluster.Node) []bool {
	t.Helper()
	out := make([]bool, len(hs))
	for i, h := range hs {
		key, ok := e.d.Svc.RemoteKey(e.reg.NamespaceId, 0, h)
		if !ok {
			t.Fatal("no remote key")
		}
		holder, err := c.NodeFor(ctx(t), key)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = holder == n
	}
	return out
}

// firstOn is the position of the first hash n holds, -1 if none.
func firstOn(on []bool) int {
	for i, v := range on {
		if v {
			return i
		}
	}
	return -1
}

// sharedBlocks has A store n blocks and publish them, and returns B's
// engine in the same namespace with the hashes.
func sharedBlocks(t *testing.T, c *rediscluster.Cluster, a, b *testenv.Daemon, seed uint64, n int) (*engine, *engine, [][]byte) {
	t.Helper()
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(seed, n)
	ea.store(t, hs, seq(0, n))
	flush(t, a)
	return ea, eb, hs
}

// TestKilledMaster: with one master dead, B's Lookup stops at the first
// block that master held, a Load gets IO_ERROR for exactly its blocks and
// the others byte-exact, B keeps serving its local tier, and once the
// master is back (empty) B loads new blocks through it without a restart.
func TestKilledMaster(t *testing.T) {
	c := rediscluster.ForTest(t)
	// The default --remote-timeout (2 s): the dead master refuses at
	// once, and the live ones need not answer within less on a loaded
	// machine (500 ms here made their blocks' OK a race; issue 26).
	a := startNode(t, c, nodeOpts{})
	b := startNode(t, c, nodeOpts{})
	ea, eb, hs := sharedBlocks(t, c, a, b, 3, 30)
	victim := c.Node(0)
	on := onNode(t, c, eb, hs, victim)
	if firstOn(on) < 0 {
		t.Fatal("no block on the victim")
	}
	t.Cleanup(func() { victim.Restart(context.Background()) })
	victim.Kill()

	if lr := eb.lookup(t, hs); int(lr.Ready) != firstOn(on) {
		t.Errorf("lookup with a master dead: %d ready, want %d (the first block it held)", lr.Ready, firstOn(on))
	}
	st := eb.load(t, hs, seq(0, 30))
	for i, s := range st {
		if want := map[bool]pb.BlockStatus{true: ioSt, false: okSt}[on[i]]; s != want {
			t.Errorf("block %d (on the dead master: %v): %v, want %v", i, on[i], s, want)
		}
	}
	if n := metric(t, b, "kvoffload_remote_blocks_total", "op", "load", "result", "io_error"); n == 0 {
		t.Error("no remote io_error counted")
	}
	// B's local tier serves on: it stores and loads its own blocks.
	mine := eb.hashes(4, 4)
	eb.store(t, mine, seq(40, 4))
	if st := eb.load(t, mine, seq(50, 4)); count(st)[okSt] != 4 {
		t.Errorf("local load with a master dead: %v", count(st))
	}

	if err := victim.Restart(ctx(t)); err != nil {
		t.Fatal(err)
	}
	// The restarted master is empty: its blocks are MISSING now, and new
	// blocks A stores reach it and B loads them, all without a restart.
	more := ea.hashes(5, 30)
	onMore := onNode(t, c, eb, more, victim)
	waitFor(t, func() error {
		st := eb.load(t, hs, seq(0, 30))
		for i, s := range st {
			if want := map[bool]pb.BlockStatus{true: missingSt, false: okSt}[on[i]]; s != want {
				return fmt.Errorf("block %d: %v, want %v", i, s, want)
			}
		}
		return nil
	})
	ea.store(t, more, seq(30, 30))
	flush(t, a)
	st = eb.load(t, more, seq(0, 30))
	for i, s := range st {
		if s != okSt {
			t.Errorf("new block %d (on the restarted master: %v): %v", i, onMore[i], s)
		}
	}
}

// TestHungMaster: a master that stops answering (paused) costs IO_ERROR
// for its blocks within --remote-timeout: the load completes without
// waiting for the master, the other blocks load byte-exact, and after it
// answers again everything loads again.
func TestHungMaster(t *testing.T) {
	c := rediscluster.ForTest(t)
	// The timeout that fails the paused master's blocks gives the live
	// masters as long: five times what they take on a loaded machine. (A
	// master hung for 1.5 s and 200 ms for the live ones made the test a
	// race against the machine's load; issue 26.)
	a := startNode(t, c, nodeOpts{timeout: time.Second})
	b := startNode(t, c, nodeOpts{timeout: time.Second})
	_, eb, hs := sharedBlocks(t, c, a, b, 6, 30)
	victim := c.Node(1)
	on := onNode(t, c, eb, hs, victim)
	// Resumed well before cluster-node-timeout (15 s): the cluster sees a
	// slow node, not a failed one.
	if err := victim.Pause(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { victim.Resume() })
	waitHung(t, victim)
	st := eb.load(t, hs, seq(0, 30))
	for i, s := range st {
		if want := map[bool]pb.BlockStatus{true: ioSt, false: okSt}[on[i]]; s != want {
			t.Errorf("block %d (on the hung master: %v): %v, want %v", i, on[i], s, want)
		}
	}
	// The hung master is in its back-off now: Lookups do not wait on it
	// (a scheduler calls Lookup for many requests per step).
	for i := 0; i < 5; i++ {
		if lr := eb.lookup(t, hs); lr.Ready != 30 && !on[lr.Ready] {
			t.Errorf("lookup with the master hung: prefix ends at %d, a block of a live master", lr.Ready)
		}
	}
	if err := victim.Resume(); err != nil {
		t.Fatal(err)
	}
	// Loaded blocks were promoted to B's CPU tier; the others come from
	// the cluster again.
	waitFor(t, func() error {
		if st := eb.load(t, hs, seq(0, 30)); count(st)[okSt] != 30 {
			return fmt.Errorf("%v", count(st))
		}
		return nil
	})
}

// waitHung waits until n stops answering PING within 50 ms.
func waitHung(t *testing.T, n *rediscluster.Node) {
	t.Helper()
	cl := n.Client()
	defer cl.Close()
	waitFor(t, func() error {
		pctx, cancel := context.WithTimeout(ctx(t), 50*time.Millisecond)
		defer cancel()
		if cl.Ping(pctx).Err() == nil {
			return errors.New("still answering")
		}
		return nil
	})
}

// TestValueCorruptedInCluster: bytes changed inside the cluster (SETRANGE
// on a payload byte, a header byte, a truncation) are CORRUPT for exactly
// those blocks, the values are deleted, nothing wrong reaches the engine,
// and the other blocks load.
func TestValueCorruptedInCluster(t *testing.T) {
	c := rediscluster.ForTest(t)
	a, b := startNode(t, c, nodeOpts{}), startNode(t, c, nodeOpts{})
	_, eb, hs := sharedBlocks(t, c, a, b, 7, 12)
	cc := c.ClusterClient()
	defer cc.Close()
	key := func(i int) string {
		k, _ := b.Svc.RemoteKey(eb.reg.NamespaceId, 0, hs[i])
		return k
	}
	if err := cc.SetRange(ctx(t), key(2), 128+5000, "\x00\x01").Err(); err != nil { // payload
		t.Fatal(err)
	}
	if err := cc.SetRange(ctx(t), key(5), 70, "\xff").Err(); err != nil { // key hash in the header
		t.Fatal(err)
	}
	if err := cc.Set(ctx(t), key(9), "short", 0).Err(); err != nil { // not a value at all
		t.Fatal(err)
	}
	st := eb.load(t, hs, seq(0, 12))
	for i, s := range st {
		want := okSt
		if i == 2 || i == 5 || i == 9 {
			want = corruptSt
		}
		if s != want {
			t.Errorf("block %d: %v, want %v", i, s, want)
		}
	}
	for _, i := range []int{2, 5, 9} {
		if n, _ := cc.Exists(ctx(t), key(i)).Result(); n != 0 {
			t.Errorf("corrupt value %d not deleted", i)
		}
	}
	for kind, want := range map[string]float64{"checksum": 1, "key": 1, "length": 1} {
		if n := metric(t, b, "kvoffload_remote_errors_total", "op", "verify", "kind", kind); n != want {
			t.Errorf("verify errors of kind %s: %v, want %v", kind, n, want)
		}
	}
}

// TestEvictedValuesAreMissing: under maxmemory with allkeys-lru the cluster
// drops values; those blocks are MISSING (never IO_ERROR or CORRUPT), the
// rest load byte-exact.
func TestEvictedValuesAreMissing(t *testing.T) {
	c := rediscluster.ForTest(t)
	if err := c.FlushAll(ctx(t)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.ConfigSet(context.Background(), "maxmemory", "0")
		c.ConfigSet(context.Background(), "maxmemory-policy", "noeviction")
	})
	if err := c.ConfigSet(ctx(t), "maxmemory-policy", "allkeys-lru"); err != nil {
		t.Fatal(err)
	}
	if err := c.ConfigSet(ctx(t), "maxmemory", "8mb"); err != nil {
		t.Fatal(err)
	}
	a, b := startNode(t, c, nodeOpts{}), startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	var hs [][]byte
	for r := 0; r < 8; r++ { // 512 blocks of 64 KiB: 32 MiB into 3 x 8 MiB
		part := ea.hashes(uint64(100+r), 64)
		ea.store(t, part, seq(0, 64))
		flush(t, a)
		hs = append(hs, part...)
	}
	got := map[pb.BlockStatus]int{}
	for i := 0; i < len(hs); i += 64 {
		for s, n := range count(eb.load(t, hs[i:i+64], seq(0, 64))) {
			got[s] += n
		}
	}
	if got[okSt] == 0 || got[missingSt] == 0 || got[okSt]+got[missingSt] != len(hs) {
		t.Fatalf("loads under eviction: %v; want only OK and MISSING, some of each", got)
	}
	t.Logf("under maxmemory: %v", got)
}

// TestClusterDownAtStart: a daemon whose cluster is down starts anyway and
// serves its local tiers; when the cluster comes back it publishes and
// loads through it without a restart.
func TestClusterDownAtStart(t *testing.T) {
	c := rediscluster.ForTest(t)
	for _, n := range c.Nodes() {
		n.Kill()
	}
	t.Cleanup(func() {
		for _, n := range c.Nodes() {
			n.Start(context.Background())
		}
		c.WaitOK(context.Background())
	})
	// The default --remote-timeout (2 s), as in TestKilledMaster.
	a := startNode(t, c, nodeOpts{})
	b := startNode(t, c, nodeOpts{})
	if up := metric(t, a, "kvoffload_remote_up"); up != 0 {
		t.Fatalf("remote_up %v with the cluster down", up)
	}
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(8, 8)
	ea.store(t, hs, seq(0, 8))
	if st := ea.load(t, hs, seq(10, 8)); count(st)[okSt] != 8 {
		t.Fatalf("local load with the cluster down: %v", count(st))
	}
	flush(t, a)
	if lr := eb.lookup(t, hs); lr.Ready != 0 {
		t.Fatalf("B offered %d blocks with the cluster down", lr.Ready)
	}
	for _, n := range c.Nodes() {
		if err := n.Start(ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.WaitOK(ctx(t)); err != nil {
		t.Fatal(err)
	}
	more := ea.hashes(9, 8)
	waitFor(t, func() error {
		ea.store(t, more, seq(20, 8))
		flush(t, a)
		if lr := eb.lookup(t, more); lr.Ready != 8 {
			more = ea.hashes(uint64(time.Now().UnixNano()), 8) // a store of ready blocks publishes nothing
			return fmt.Errorf("B sees %d of A's blocks", lr.Ready)
		}
		return nil
	})
	if st := eb.load(t, more, seq(0, 8)); count(st)[okSt] != 8 {
		t.Fatalf("load after the cluster came back: %v", count(st))
	}
	waitFor(t, func() error {
		if up := metric(t, a, "kvoffload_remote_up"); up != 1 {
			return fmt.Errorf("remote_up %v", up)
		}
		return nil
	})
}

// TestPublishNeverBlocksStores: with the publisher held (its look at the
// cluster does not answer), stores complete (none waits on a publish), the
// publish queue fills, and what does not fit is dropped and counted. With
// every master hung, stores complete within --remote-timeout: their
// stamps (the generation records read while the copies run) are not read,
// and the blocks stay local (counted publish errors).
func TestPublishNeverBlocksStores(t *testing.T) {
	c := rediscluster.ForTest(t)
	g := &gatedStore{entered: make(chan struct{}, 1), release: make(chan struct{})}
	a := startNode(t, c, nodeOpts{timeout: time.Second, queue: 8, publishers: 1, wrapStore: func(s remote.Store) remote.Store { g.Store = s; return g }})
	var open sync.Once
	release := func() {
		g.armed.Store(false)
		open.Do(func() { close(g.release) })
	}
	t.Cleanup(release) // before the daemon's Close, which waits for the publisher
	e := register(t, a, model, fingerprint(t))
	g.armed.Store(true)
	for r := 0; r < 4; r++ {
		// A store that waited on a publish would wait for the release:
		// past the test's deadline.
		e.store(t, e.hashes(uint64(200+r), 16), seq(16*r, 16))
	}
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "publish", "result", "dropped"); n == 0 {
		t.Fatal("a full publish queue dropped nothing")
	}
	release()
	flush(t, a)

	// Resumed well before cluster-node-timeout (15 s): no failover.
	for _, n := range c.Nodes() {
		if err := n.Pause(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Resume() })
	}
	for _, n := range c.Nodes() {
		waitHung(t, n)
	}
	before := metric(t, a, "kvoffload_remote_blocks_total", "op", "publish", "result", "error")
	hs := e.hashes(300, 16)
	e.store(t, hs, seq(0, 16))
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "publish", "result", "error") - before; n != 16 {
		t.Fatalf("%v blocks stored with the cluster hung counted publish errors, want 16 (no stamp read)", n)
	}
	for _, n := range c.Nodes() {
		if err := n.Resume(); err != nil {
			t.Fatal(err)
		}
	}
	flush(t, a)
	if n := inCluster(t, c, e, hs); n != 0 {
		t.Fatalf("%d blocks stored with the cluster hung (no stamps) were published", n)
	}
	if err := a.Svc.CheckAccounting(); err != nil {
		t.Fatal(err)
	}
}

// waitFor polls f until it succeeds (bounded by a generous deadline).
func waitFor(t *testing.T, f func() error) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still failing after 60s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
