package remote_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// down takes master n down, having it keep what it holds (a snapshot),
// until the returned func brings it back with it: the values whose deletes
// it missed are there again. (A stalled master is no test of this: the
// delete waits in its socket and runs when it wakes up.)
func down(t *testing.T, n *rediscluster.Node) func() {
	t.Helper()
	if err := n.Snapshot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	n.Kill()
	back := false
	up := func() {
		if back {
			return
		}
		back = true
		if err := n.Restart(ctx(t)); err != nil {
			t.Error(err)
		}
		// Later restarts (other tests) start empty, as usual.
		if err := n.DropSnapshot(); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(up)
	return up
}

// victimOf is the master that holds h's key.
func victimOf(t *testing.T, c *rediscluster.Cluster, e *engine, h []byte) *rediscluster.Node {
	t.Helper()
	k, ok := e.d.Svc.RemoteKey(e.reg.NamespaceId, 0, h)
	if !ok {
		t.Fatal("no remote key")
	}
	n, err := c.NodeFor(ctx(t), k)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// onSome is the number of hashes on a master.
func onSome(t *testing.T, on []bool) int {
	t.Helper()
	n := 0
	for _, v := range on {
		if v {
			n++
		}
	}
	if n == 0 || n == len(on) {
		t.Fatalf("%d of %d blocks on the victim; want some, not all", n, len(on))
	}
	return n
}

// inCluster counts the hashes of e's namespace the cluster holds.
func inCluster(t *testing.T, c *rediscluster.Cluster, e *engine, hs [][]byte) int {
	t.Helper()
	cc := c.ClusterClient()
	defer cc.Close()
	n := 0
	for _, h := range hs {
		k, ok := e.d.Svc.RemoteKey(e.reg.NamespaceId, 0, h)
		if !ok {
			t.Fatal("no remote key")
		}
		m, err := cc.Exists(ctx(t), k).Result()
		if err != nil {
			t.Fatal(err)
		}
		n += int(m)
	}
	return n
}

func waitPending(t *testing.T, d *testenv.Daemon, keys, namespaces int) {
	t.Helper()
	waitFor(t, func() error {
		if k, n := d.Svc.RemotePendingDeletes(); k != keys || n != namespaces {
			return fmt.Errorf("%d keys and %d namespaces still to delete from the cluster, want %d and %d", k, n, keys, namespaces)
		}
		return nil
	})
}

// TestFailedDeleteIsRetried: a master that is down when node A
// invalidates keys, and comes back with its data, keeps its copies and
// their old generation records; A writes the records again until they go
// through once the master is back, and then node B (a second daemon, empty
// local cache) gets MISSING for every key, never the old bytes. A never
// offers them meanwhile; a key A stores again meanwhile stays fenced and
// local: its stamp predates the record still to be written, so it is not
// published, then or after (a store once the record is written is). The
// fences of the keys whose records went through at once are gone at once.
func TestFailedDeleteIsRetried(t *testing.T) {
	c := rediscluster.ForTest(t)
	a := startNode(t, c, nodeOpts{timeout: 300 * time.Millisecond})
	b := startNode(t, c, nodeOpts{timeout: 300 * time.Millisecond})
	ea, eb, hs := sharedBlocks(t, c, a, b, 61, 24)
	victim := victimOf(t, c, ea, hs[0])
	on := onNode(t, c, ea, hs, victim)
	nOn := onSome(t, on)

	up := down(t, victim)
	// Not OK: B could load the dead master's blocks until their records
	// are written. It used to answer OK.
	invalidateMissed(t, ea, testenv.Keys(hs...))
	if keys, _ := a.Svc.RemotePendingDeletes(); keys != nOn {
		t.Fatalf("%d deletes pending after the invalidation, want %d (the dead master's)", keys, nOn)
	}
	if n := metric(t, a, "kvoffload_remote_pending_deletes", "kind", "key"); n != float64(nOn) {
		t.Fatalf("kvoffload_remote_pending_deletes{kind=key} %v, want %d", n, nOn)
	}
	if lr := ea.lookup(t, hs); lr.Ready != 0 {
		t.Fatalf("A offers %d blocks it invalidated", lr.Ready)
	}
	// A's engine stores one of the dead master's blocks again: it stays
	// fenced (the master still has the old value) and is not published.
	j := firstOn(on)
	again := hs[j : j+1]
	ea.store(t, again, seq(30, 1))
	if keys, _ := a.Svc.RemoteFences(); keys != nOn {
		t.Fatalf("A fences %d keys after storing one whose record is pending, want %d (the dead master's)", keys, nOn)
	}
	up()

	waitPending(t, a, 0, 0)
	flush(t, a)
	rest := append(append([][]byte{}, hs[:j]...), hs[j+1:]...)
	if n := inCluster(t, c, ea, rest); n != 0 {
		t.Fatalf("%d invalidated blocks still in the cluster after the deletes went through", n)
	}
	if n := inCluster(t, c, ea, again); n != 0 {
		t.Fatal("the block stored again while its record write was pending was published")
	}
	if keys, _ := a.Svc.RemoteFences(); keys != 0 {
		t.Fatalf("A fences %d keys once their records went through, want 0", keys)
	}
	if st := eb.load(t, rest, seq(0, 23)); count(st)[missingSt] != 23 {
		t.Fatalf("B loading blocks A invalidated: %v, want all MISSING", count(st))
	}
	if st := eb.load(t, again, seq(40, 1)); count(st)[missingSt] != 1 {
		t.Fatalf("B loading the block A stored again while its record was pending: %v, want MISSING", count(st))
	}
	if st := ea.load(t, rest, seq(0, 23)); count(st)[missingSt] != 23 {
		t.Fatalf("A loading blocks it invalidated: %v, want all MISSING", count(st))
	}
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "invalidate", "result", "deleted"); n != 24 {
		t.Fatalf("invalidate deleted %v, want 24", n)
	}
	if n := metric(t, a, "kvoffload_remote_blocks_total", "op", "invalidate", "result", "error"); n != float64(nOn) {
		t.Fatalf("invalidate error %v, want %d (each failed once)", n, nOn)
	}
	// Stored again by A once the deletes went through: shared again.
	more := rest[:4]
	ea.store(t, more, seq(0, 4))
	flush(t, a)
	if st := eb.load(t, more, seq(0, 4)); count(st)[okSt] != 4 {
		t.Fatalf("B loading blocks A stored again: %v", count(st))
	}
}

// TestFencesSurviveRestart: node A (with a disk tier) invalidates keys and
// a namespace whole while a master is down, so their deletes and the sweep
// cannot go through, and stops (SIGTERM), or is killed (kill -9: its files
// as they are when Invalidate returned). Restarted before the master is
// back, A fences them again: once the master is back with its data, A
// never loads the old bytes it kept; the deletes and the sweep are resumed
// and go through, and B finds nothing of them either. Without a disk tier,
// --remote-state-dir keeps them the same way (they used to be forgotten).
func TestFencesSurviveRestart(t *testing.T) {
	for _, tc := range []struct {
		name        string
		kill, state bool
	}{{"SIGTERM", false, false}, {"kill-9", true, false}, {"state-dir-kill-9", true, true}} {
		kill := tc.kill
		t.Run(tc.name, func(t *testing.T) {
			c := rediscluster.ForTest(t)
			dir := t.TempDir()
			o := nodeOpts{timeout: 300 * time.Millisecond, diskDir: dir}
			if tc.state {
				o = nodeOpts{timeout: 300 * time.Millisecond, stateDir: dir}
			}
			a := startNode(t, c, o)
			b := startNode(t, c, nodeOpts{timeout: 300 * time.Millisecond})
			fp, fpWhole := fingerprint(t), fingerprint(t)
			ea, eb := register(t, a, model, fp), register(t, b, model, fp)
			ew := register(t, a, model, fpWhole)
			hs := ea.hashes(71, 16)
			victim := victimOf(t, c, ea, hs[0])
			hw := ew.hashes(72, 8)
			for seed := uint64(73); firstOn(onNode(t, c, ew, hw, victim)) < 0; seed++ {
				hw = ew.hashes(seed, 8) // some of them on the victim too
			}
			ea.store(t, hs, seq(0, 16))
			ew.store(t, hw, seq(0, 8))
			flush(t, a)
			on := onNode(t, c, ea, hs, victim)
			nOn := onSome(t, on)

			up := down(t, victim)
			invalidateMissed(t, ea, testenv.Keys(hs...))
			invalidateMissed(t, ew, nil)
			if k, n := a.Svc.RemotePendingDeletes(); k != nOn || n != 1 {
				t.Fatalf("pending before the restart: %d keys, %d namespaces; want %d and 1", k, n, nOn)
			}
			restartDir := dir
			if kill {
				restartDir = testenv.CopyDir(t, dir)
			}
			a.Stop(t)

			if tc.state {
				o.stateDir = restartDir
			} else {
				o.diskDir = restartDir
			}
			a2 := startNode(t, c, o)
			if k, n := a2.Svc.RemotePendingDeletes(); k != nOn || n != 1 {
				t.Fatalf("pending after the restart: %d keys, %d namespaces; want %d and 1", k, n, nOn)
			}
			if k, n := a2.Svc.RemoteFences(); k != nOn || n != 1 {
				t.Fatalf("fences after the restart: %d keys, %d namespaces; want %d and 1", k, n, nOn)
			}
			ea2, ew2 := register(t, a2, model, fp), register(t, a2, model, fpWhole)
			up()
			// The master is back with the old values: A does not read
			// them, whether or not its deletes have gone through yet.
			if lr := ea2.lookup(t, hs); lr.Ready != 0 {
				t.Fatalf("restarted A offers %d blocks it invalidated (tiers %v)", lr.Ready, lr.Tiers)
			}
			if st := ea2.load(t, hs, seq(0, 16)); count(st)[missingSt] != 16 {
				t.Fatalf("restarted A loading keys it invalidated: %v, want all MISSING", count(st))
			}
			if st := ew2.load(t, hw, seq(0, 8)); count(st)[missingSt] != 8 {
				t.Fatalf("restarted A loading a namespace it invalidated whole: %v, want all MISSING", count(st))
			}
			waitPending(t, a2, 0, 0)
			waitFor(t, func() error {
				if n := a2.Svc.RemoteSweeps(); n != 0 {
					return fmt.Errorf("%d namespaces still to sweep", n)
				}
				return nil
			})
			if n := inCluster(t, c, ea2, hs) + inCluster(t, c, ew2, hw); n != 0 {
				t.Fatalf("%d invalidated blocks still in the cluster after the resumed deletes and sweep", n)
			}
			if st := eb.load(t, hs, seq(0, 16)); count(st)[missingSt] != 16 {
				t.Fatalf("B loading keys A invalidated: %v, want all MISSING", count(st))
			}
			if st := eb.load(t, hw, seq(0, 8)); count(st)[missingSt] != 8 {
				t.Fatalf("B loading a namespace A invalidated whole: %v, want all MISSING", count(st))
			}
			// Done: the records are in the cluster, the fences have
			// done their work and are gone, and so is the file's list.
			if k, n := a2.Svc.RemoteFences(); k != 0 || n != 0 {
				t.Fatalf("fences once the records went through: %d keys, %d namespaces; want none", k, n)
			}
			a2.Stop(t)
			a3 := startNode(t, c, o)
			if k, n := a3.Svc.RemotePendingDeletes(); k != 0 || n != 0 {
				t.Fatalf("a third start finds %d keys and %d namespaces pending, want none", k, n)
			}
		})
	}
}

// TestUnreadableFencesRefuseToStart: a fences file that exists but cannot
// be read makes the daemon refuse to start, naming the file, rather than
// forget deletes that may not have gone through.
func TestUnreadableFencesRefuseToStart(t *testing.T) {
	c := rediscluster.ForTest(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "kvoffload-0.remote-fences")
	for _, tc := range []struct{ name, data string }{
		{"garbage", "not a fences file at all, not at all"},
		{"checksum", "KVOFRFNC\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := os.WriteFile(path, []byte(tc.data), 0o600); err != nil {
				t.Fatal(err)
			}
			store, err := remote.NewRedis(remote.RedisConfig{Addrs: c.Addrs()[:1], Timeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			_, err = testenv.TryStart(t, testenv.Options{Quiet: true, DiskDirs: []string{dir}, Remote: &offload.RemoteConfig{Store: store, Timeout: time.Second}})
			if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "refusing to start") {
				t.Fatalf("start with an unreadable fences file: %v", err)
			}
		})
	}
}

// TestRestoredWhileCancelledIsPublished: a block queued for publishing,
// invalidated (its publish cancelled while still queued) and stored again
// before the cancelled publish left the queue is published: the cluster
// holds it afterwards and B loads it. It used to count as a duplicate of
// the cancelled one and wait for a later store that never comes (a store
// of a ready block does nothing).
func TestRestoredWhileCancelledIsPublished(t *testing.T) {
	c := rediscluster.ForTest(t)
	g := &gatedStore{entered: make(chan struct{}, 1), release: make(chan struct{})}
	a := startNode(t, c, nodeOpts{publishers: 1, wrapStore: func(s remote.Store) remote.Store { g.Store = s; return g }})
	b := startNode(t, c, nodeOpts{})
	fp := fingerprint(t)
	ea, eb := register(t, a, model, fp), register(t, b, model, fp)
	hs := ea.hashes(81, 2)
	x, k := hs[:1], hs[1:]
	var open sync.Once
	release := func() {
		g.armed.Store(false)
		open.Do(func() { close(g.release) })
	}
	t.Cleanup(release) // a failure must not leave A's publisher held at its Stop

	g.armed.Store(true)
	ea.store(t, x, seq(0, 1))
	<-g.entered // the one publisher is in x's batch
	ea.store(t, k, seq(1, 1))
	// Invalidated while its publish is queued: cancelled. The Invalidate
	// does not wait for x's batch (what it would send is stamped with the
	// generations before).
	if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(k...)); err != nil {
		t.Fatal(err)
	}
	ea.store(t, k, seq(1, 1)) // its engine computed it again
	release()
	flush(t, a)
	if n := inCluster(t, c, ea, k); n != 1 {
		t.Fatal("the block stored again after its invalidation was not published")
	}
	if st := eb.load(t, k, seq(5, 1)); count(st)[okSt] != 1 {
		t.Fatalf("B loading the block A stored again: %v", count(st))
	}
	if keys, _ := a.Svc.RemoteFences(); keys != 0 {
		t.Fatalf("A still fences %d keys after storing the block again", keys)
	}
}

// TestStoreRejectedByInvalidateKeepsFence: a Store whose copy was still
// running when the key was invalidated does not make the block ready
// (REJECTED), and the old value written into the cluster again after the
// invalidation (a late SET: a publish that timed out and still lands, or
// another node's publish queued before it) is served to no node: A does
// not load it, and neither does B, which never invalidated anything.
// The generation record, not a fence on A, refuses it: B used to load it.
func TestStoreRejectedByInvalidateKeepsFence(t *testing.T) {
	c := rediscluster.ForTest(t)
	gate := testenv.NewGate()
	a := startNode(t, c, nodeOpts{wrap: gate.Wrap})
	b := startNode(t, c, nodeOpts{})
	t.Cleanup(gate.Release) // a failure must not leave A's copies held at its Stop
	ea, eb, k := sharedBlocks(t, c, a, b, 91, 1)
	gate.Arrived(1) // the store's copy
	cc := c.ClusterClient()
	defer cc.Close()
	key, _ := a.Svc.RemoteKey(ea.reg.NamespaceId, 0, k[0])
	old, err := cc.Get(ctx(t), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	invalidate := func() {
		t.Helper()
		if _, err := ea.c.Invalidate(ctx(t), []uint32{ea.reg.NamespaceId}, testenv.Keys(k...)); err != nil {
			t.Fatal(err)
		}
	}
	invalidate()

	// Stored again, and invalidated again while its copy is held.
	gate.Hold()
	stored := make(chan *pb.JobResult, 1)
	go func() {
		ea.m.Fill(ea.r, 0, k[0])
		res, err := ea.c.Store(context.Background(), ea.reg.RegistrationId, []*pb.Job{testenv.Job(jobSeq.Add(1), k, seq(0, 1))}, true)
		if err != nil {
			t.Error(err)
			stored <- nil
			return
		}
		stored <- res[0]
	}()
	gate.Arrived(1) // copy held: the entry is being written
	invalidate()
	gate.Release()
	if res := <-stored; res == nil || res.Ok {
		t.Fatalf("a store invalidated while written: %+v, want REJECTED", res)
	}
	// The old value lands again after the invalidation: nobody reads it.
	if err := cc.Set(ctx(t), key, old, 0).Err(); err != nil {
		t.Fatal(err)
	}
	if lr := ea.lookup(t, k); lr.Ready != 0 {
		t.Fatalf("A offers a block it invalidated: %v", lr.Tiers)
	}
	if st := ea.load(t, k, seq(3, 1)); count(st)[missingSt] != 1 {
		t.Fatalf("A loading a block it invalidated: %v, want MISSING", count(st))
	}
	if lr := eb.lookup(t, k); lr.Ready != 0 {
		t.Fatalf("B offers a block A invalidated, its old value set again after: %v", lr.Tiers)
	}
	if err := cc.Set(ctx(t), key, old, 0).Err(); err != nil { // A's load deleted it as garbage
		t.Fatal(err)
	}
	if st := eb.load(t, k, seq(4, 1)); count(st)[missingSt] != 1 {
		t.Fatalf("B loading a block A invalidated, its old value set again after: %v, want MISSING", count(st))
	}
}
