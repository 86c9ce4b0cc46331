package rediscluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// TestNodesOutliveTheStartingThread: a cluster started from a goroutine
// locked to its thread, which then exits (the runtime ends the thread, as
// the daemon does with the threads it lends a client's credentials to),
// keeps serving: its nodes' parent-death signal is tied to the spawner's
// thread, not the caller's.
func TestNodesOutliveTheStartingThread(t *testing.T) {
	if err := Available(); err != nil {
		if Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	QuietLogs()
	defer leakcheck.VerifyNone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var c *Cluster
	threadGone(t, onDyingThread(func() {
		var err error
		if c, err = Start(ctx, Options{}); err != nil {
			t.Error(err)
		}
	}))
	if c == nil {
		t.FailNow()
	}
	defer c.Close()
	// Kill and restart a node from another such thread: Restart starts
	// it again.
	var rerr error
	threadGone(t, onDyingThread(func() {
		c.Node(0).Kill()
		rerr = c.Node(0).Restart(ctx)
	}))
	if rerr != nil {
		t.Fatal(rerr)
	}
	// A node tied to either thread got its SIGKILL when the thread
	// ended; every node must still answer, over several round trips.
	for _, n := range c.Nodes() {
		cl := n.Client()
		err := cl.Ping(ctx).Err()
		cl.Close()
		if err != nil {
			t.Fatalf("node %s died with the thread that started it: %v", n.Addr(), err)
		}
	}
	if err := c.WaitOK(ctx); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes() {
		select {
		case <-n.exitedChan():
			t.Fatalf("node %s exited", n.Addr())
		default:
		}
	}
}

// onDyingThread runs f on a goroutine locked to a thread that ends when f
// returns, and returns the thread's id. The main thread is never ended
// (the runtime parks it instead), so a goroutine that lands there runs
// nothing and another is started.
func onDyingThread(f func()) int {
	for {
		tid := make(chan int, 1)
		go func() {
			runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
			if id := unix.Gettid(); id == os.Getpid() {
				tid <- 0
				return
			}
			f()
			tid <- unix.Gettid()
		}()
		if id := <-tid; id != 0 {
			return id
		}
	}
}

// threadGone waits until thread tid of this process has exited.
func threadGone(t *testing.T, tid int) {
	t.Helper()
	path := fmt.Sprintf("/proc/self/task/%d", tid)
	for {
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return
		}
		runtime.Gosched()
	}
}

// TestMovedSlotOutranksItsOldMaster: a slot moved away from a master whose
// config epoch is the greatest of the cluster (it just bumped it, before
// the new master heard) ends on a new master whose epoch every master sees
// above the old one's. Otherwise a claim the old master sent while it
// still owned the slot wins it back on whichever node reads it last, and
// nothing corrects that: one node keeps the slot on the old master.
func TestMovedSlotOutranksItsOldMaster(t *testing.T) {
	if err := Available(); err != nil {
		if Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	QuietLogs()
	defer leakcheck.VerifyNone(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	from, to := c.Node(0), c.Node(1)
	ids := map[*Node]string{}
	for _, n := range []*Node{from, to} {
		cl := n.Client()
		id, err := cl.Do(ctx, "cluster", "myid").Text()
		cl.Close()
		if err != nil {
			t.Fatal(err)
		}
		ids[n] = id
	}
	for _, slot := range []int{0, 1} {
		if owner, err := c.slotOwner(ctx, slot); err != nil || owner != from {
			t.Fatalf("slot %d: on %v (%v), want node 0", slot, owner, err)
		}
	}
	if err := c.MoveSlot(ctx, 0, to); err != nil {
		t.Fatal(err)
	}
	// from outranks to now, as far as from knows.
	if err := from.do(ctx, "cluster", "bumpepoch"); err != nil {
		t.Fatal(err)
	}
	if err := c.MoveSlot(ctx, 1, to); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes() {
		e, err := n.configEpochs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if e[ids[to]] <= e[ids[from]] {
			t.Errorf("node %s sees config epoch %d on slot 1's new master, %d on its old one", n.Addr(), e[ids[to]], e[ids[from]])
		}
	}
}
