package e2e

import (
	"slices"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestStoresTakeCleanCopies: with write-back, the cleaner writes stored
// blocks to disk ahead of their eviction, keeping their CPU copies; a burst
// of stores that finds no free CPU slot while the disk is slow (its writes
// held) drops those clean copies (their blocks stay on disk, and load from
// there) instead of failing NO_SPACE. A store is refused only once no idle
// clean copy is left (issue 11).
func TestStoresTakeCleanCopies(t *testing.T) {
	gate := testenv.NewDiskGate()
	// 4 MiB arena of 256 KiB blocks: 16 slots, 2 of them the write-back
	// reserve.
	d := testenv.Start(t, testenv.Options{CPUBytes: 4 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{t.TempDir()}, DiskFS: gate, Quiet: true})
	e := register(t, d, small, "m")
	first := e.hashes(1, 14)
	e.lookup(t, first)
	if res := e.store(t, 1, first, seq(0, 14)); !res.Ok {
		t.Fatalf("first store into an empty tier: %+v", res)
	}
	// One Store of 14 blocks: the cleaner aims for half the tier's blocks.
	waitFor(t, "the cleaner to write blocks ahead", func() bool { c, _ := d.Svc.CPUCopies(); return c >= 7 })
	clean, _ := d.Svc.CPUCopies()

	gate.Hold()
	burst := e.hashes(2, 12)
	e.lookup(t, burst)
	res := e.store(t, 2, burst, seq(20, 12))
	noSpace := 0
	for _, f := range res.Failures {
		if f.Status == pb.BlockStatus_BLOCK_STATUS_NO_SPACE {
			noSpace++
		}
	}
	left, _ := d.Svc.CPUCopies()
	stored := 12 - len(res.Failures)
	t.Logf("%d clean copies before the burst; burst of 12: %d stored, %d NO_SPACE, %d clean copies left", clean, stored, noSpace, left)
	if noSpace > 0 && left > 0 {
		t.Errorf("%d blocks refused NO_SPACE while %d clean copies could have given up their slots", noSpace, left)
	}
	// Two free slots less the one kept for disk reads (staging), and every
	// clean copy: with the disk held, the blocks the policy evicts that are
	// not clean keep their slots.
	if stored < 1+clean-left {
		t.Errorf("%d blocks stored; 1 free slot and %d clean copies given up", stored, clean-left)
	}
	gate.Release()
	flush(t, d)

	// Every block reported stored, and every first one, loads intact,
	// from whichever tier holds it now.
	ok := append(storedOK(res, burst), first...)
	lr := e.lookup(t, ok)
	if int(lr.Ready) != len(ok) {
		t.Fatalf("%d of %d stored blocks ready", lr.Ready, len(ok))
	}
	if failed := loadAll(t, e, ok); len(failed) != 0 {
		t.Fatalf("loads failed: %v", failed)
	}
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestInvalidateWhileDemotionsWaitForRoom: the demoter feeds the disk on
// demand, waiting while a file's queue of writes is full. It used to wait
// holding the lock that orders its writes with Invalidate, so with the disk
// slow an Invalidate (and every Lookup taking a lease after it) waited for
// the disk's backlog to drain: here, forever.
func TestInvalidateWhileDemotionsWaitForRoom(t *testing.T) {
	gate := testenv.NewDiskGate()
	// 16 CPU slots of 256 KiB; one I/O in flight on the one slot file, so
	// two queued writes fill its queue.
	d := testenv.Start(t, testenv.Options{CPUBytes: 4 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{t.TempDir()}, DiskFS: gate, DiskQueueDepth: 1, Quiet: true})
	t.Cleanup(gate.Release) // before the daemon's stop, should the test fail
	e := register(t, d, small, "m")
	gate.Hold()
	for i := range 4 {
		hs := e.hashes(uint64(10+i), 12)
		e.lookup(t, hs)
		e.store(t, uint64(1+i), hs, seq(0, 12))
	}
	// The worker holds one write, two wait in the queue: the demoter (or
	// the cleaner) has more to feed in than there is room for.
	gate.Waiting(1)
	waitFor(t, "the write queue to fill", func() bool { return d.Svc.Disk().QueuedWrites() >= 2 })

	done := make(chan error, 1)
	go func() {
		_, err := e.c.Invalidate(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(e.hashes(10, 12)...))
		done <- err
	}()
	if err := <-done; err != nil {
		t.Fatalf("Invalidate with the disk's writes held: %v", err)
	}
	if lr := e.lookup(t, e.hashes(10, 12)); lr.Ready != 0 {
		t.Fatalf("%d invalidated blocks still offered", lr.Ready)
	}
	gate.Release()
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestStoreLooksAtPinnedCleanCopiesOnce: with every clean CPU copy pinned
// by a lease, a Store of many blocks used to look at all of them again for
// each block (an index lock per copy: with a million leased blocks, seconds
// per Store). Now the first block that finds them all pinned ends the
// search for the rest of the call; the blocks are refused NO_SPACE as
// before, and once the lease goes a store takes the clean copies again.
func TestStoreLooksAtPinnedCleanCopiesOnce(t *testing.T) {
	o := testenv.Options{CPUBytes: 4 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{t.TempDir()}, WriteThrough: true, Quiet: true}
	d := testenv.Start(t, o)
	e := register(t, d, small, "m")
	first := e.hashes(1, 14)
	e.lookup(t, first)
	if res := e.store(t, 1, first, seq(0, 14)); !res.Ok {
		t.Fatalf("first store into an empty tier: %+v", res)
	}
	waitFor(t, "every stored block to be written through", func() bool { c, _ := d.Svc.CPUCopies(); return c == 14 })
	lease, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(first...), 30000)
	if err != nil || lease.Ready != 14 || lease.LeaseId == 0 {
		t.Fatalf("lease over the clean copies: %+v %v", lease, err)
	}
	before := metric(t, d, "kvoffload_cpu_clean_looked_at_total")
	burst := e.hashes(2, 12)
	e.lookup(t, burst)
	res := e.store(t, 2, burst, seq(20, 12))
	looked := metric(t, d, "kvoffload_cpu_clean_looked_at_total") - before
	t.Logf("burst of 12 with 14 pinned clean copies: %d failures, %v clean copies looked at", len(res.Failures), looked)
	if len(res.Failures) == 0 {
		t.Fatal("every block of the burst stored: the pinned clean copies gave up their slots")
	}
	for _, f := range res.Failures {
		if f.Status != pb.BlockStatus_BLOCK_STATUS_NO_SPACE {
			t.Fatalf("burst block failed %v, want NO_SPACE", f.Status)
		}
	}
	if looked > 14 {
		t.Errorf("%v clean copies looked at for one Store with 14 of them pinned: each refused block looked at all of them again", looked)
	}
	// The lease goes (a Load with it releases its pins): the next Store takes
	// the clean copies again.
	job := testenv.Job(3, first, seq(40, 14))
	job.LeaseId = lease.LeaseId
	if r, err := e.c.Load(ctx(t), e.reg.RegistrationId, []*pb.Job{job}, true); err != nil || !r[0].Ok {
		t.Fatalf("load with the lease: %+v %v", r, err)
	}
	again := e.hashes(3, 4)
	e.lookup(t, again)
	if r := e.store(t, 4, again, seq(60, 4)); !r.Ok {
		t.Fatalf("store after the lease ended: %+v", r)
	}
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestDiskReadStagesWhileStoresFillTheTier: stores take every free CPU slot
// and every clean copy's, and leases pin what they stored, so the tier has
// nothing left to give. A Load of a block only the disk holds still finds a
// slot to read it into: the staging slots stores may not take
// (slots.Config.Staging). It used to fail NO_SPACE once the stager had
// waited 50 ms for a slot (issue 11: disk reads stage through their own
// pool).
func TestDiskReadStagesWhileStoresFillTheTier(t *testing.T) {
	// 4 MiB arena of 256 KiB blocks: 16 slots, 1 kept for staging.
	d := testenv.Start(t, testenv.Options{CPUBytes: 4 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{t.TempDir()}, Quiet: true})
	e := register(t, d, small, "m")
	x := e.hashes(1, 1)
	e.lookup(t, x)
	if res := e.store(t, 1, x, seq(0, 1)); !res.Ok {
		t.Fatalf("store of x: %+v", res)
	}
	// Seven more: the cleaner writes the oldest half ahead, x among them.
	more := e.hashes(2, 7)
	e.lookup(t, more)
	if res := e.store(t, 2, more, seq(1, 7)); !res.Ok {
		t.Fatalf("store: %+v", res)
	}
	waitFor(t, "the cleaner to write x to disk", func() bool {
		lr, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(x...), 0)
		return err == nil && lr.Ready == 1 && lr.Tiers[0] == pb.Tier_TIER_CPU_AND_DISK
	})
	// lease pins hs, each block in the CPU tier.
	lease := func(hs [][]byte) {
		t.Helper()
		lr, err := e.c.Lookup(ctx(t), []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), 30000)
		if err != nil {
			t.Fatal(err)
		}
		if int(lr.Ready) != len(hs) || slices.Contains(lr.Tiers, pb.Tier_TIER_DISK) {
			t.Fatalf("lease of %d blocks stored: %+v, want each in the CPU tier", len(hs), lr)
		}
	}
	lease(more)
	// Stores of one block until one stores nothing, each block leased as
	// soon as it is stored, each store after the previous one's disk
	// writes landed (flush). A store of several blocks could make room for
	// its later ones by demoting its own first ones to disk, which then
	// escaped their lease, and the bursts went on as long as the daemon's
	// scheduling let them (issue 26). A block stored alone is in the CPU
	// tier when its lease comes, so each store that finds room pins one
	// more of the tier's 16 slots for good: at most 16 can.
	next := uint64(10)
	for i := 0; ; i++ {
		if i > 16 {
			t.Fatalf("stores still found room after %d blocks stored and leased in a 16-slot tier", i)
		}
		flush(t, d)
		b := e.hashes(next, 1)
		e.lookup(t, b)
		res := e.store(t, next, b, seq(8+i, 1))
		next++
		if !res.Ok {
			if res.Failures[0].Status != pb.BlockStatus_BLOCK_STATUS_NO_SPACE {
				t.Fatalf("store with the tier full: %+v, want NO_SPACE", res)
			}
			break
		}
		lease(b)
	}
	if lr := e.lookup(t, x); lr.Ready != 1 || lr.Tiers[0] != pb.Tier_TIER_DISK {
		t.Fatalf("x after the bursts: %+v, want it on disk only", lr)
	}
	res := e.load(t, next, x, seq(60, 1))
	if !res.Ok {
		t.Fatalf("load of a disk-only block with every other CPU slot taken and pinned: %+v", res)
	}
	e.verify(t, res, x, seq(60, 1))
	flush(t, d)
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}
