package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// diskOpts is a daemon with an 8 MiB CPU tier (32 slots of 256 KiB blocks)
// in front of a 64 MiB disk tier in dir.
func diskOpts(dir string) testenv.Options {
	return testenv.Options{CPUBytes: 8 << 20, ChunkBytes: 4 << 20, DiskDirs: []string{dir}, Quiet: true}
}

func flush(t testing.TB, d *testenv.Daemon) {
	t.Helper()
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Svc.FlushDisk(c); err != nil {
		t.Fatal(err)
	}
}

// storeMany stores n blocks of chain seed, 4 per step as an engine would,
// each step looked up first, and returns the hashes stored OK.
func storeMany(t testing.TB, e *engine, seed uint64, n int) [][]byte {
	t.Helper()
	var ok [][]byte
	for i := 0; i < n; i += 4 {
		hs := make([][]byte, 0, 4)
		for j := i; j < i+4 && j < n; j++ {
			hs = append(hs, e.m.Hash(seed, j))
		}
		e.lookup(t, hs)
		res := e.store(t, uint64(1_000_000+int(seed)*1000+i), hs, seq(0, len(hs)))
		if e.d.Svc.Disk() != nil {
			// An engine's step takes milliseconds: time for the blocks
			// the CPU tier evicted to reach the disk.
			flush(t, e.d)
		}
		ok = append(ok, storedOK(res, hs)...)
	}
	return ok
}

// storedOK returns the hashes of a store job that did not fail.
func storedOK(res *pb.JobResult, hs [][]byte) [][]byte {
	failed := map[uint32]bool{}
	for _, f := range res.Failures {
		failed[f.Index] = true
	}
	var ok [][]byte
	for j, h := range hs {
		if !failed[uint32(j)] {
			ok = append(ok, h)
		}
	}
	return ok
}

// loadAll loads hs 4 blocks per step and checks every block reported
// loaded; it returns the failures by status. Blocks read from disk need CPU
// slots to land in: the write-back reserve (an eighth of the tier) is what
// one step may use, and between steps the disk writes of evicted blocks
// free more.
func loadAll(t testing.TB, e *engine, hs [][]byte) map[pb.BlockStatus]int {
	t.Helper()
	got := map[pb.BlockStatus]int{}
	for i := 0; i < len(hs); i += 4 {
		part := hs[i:min(i+4, len(hs))]
		blocks := seq(32, len(part))
		for _, b := range blocks {
			clear(e.m.Segment(e.r, 0, int(b)))
		}
		res := e.load(t, uint64(2_000_000+i), part, blocks)
		e.verify(t, res, part, blocks)
		if e.d.Svc.Disk() != nil {
			flush(t, e.d)
		}
		for _, f := range res.Failures {
			got[f.Status]++
		}
	}
	return got
}

func TestDemotedToDiskAndLoadedBack(t *testing.T) {
	d := testenv.Start(t, diskOpts(t.TempDir()))
	e := register(t, d, small, "disk")
	stored := storeMany(t, e, 1, 128) // 4x the CPU tier
	if len(stored) < 112 {
		t.Fatalf("only %d of 128 blocks stored", len(stored))
	}
	flush(t, d)
	lr := e.lookup(t, stored)
	if int(lr.Ready) != len(stored) {
		t.Fatalf("%d of %d stored blocks ready", lr.Ready, len(stored))
	}
	onDisk := 0
	for _, tier := range lr.Tiers {
		if tier == pb.Tier_TIER_DISK {
			onDisk++
		}
	}
	if onDisk < len(stored)-32 {
		t.Fatalf("only %d blocks only on disk with %d stored and 32 CPU slots", onDisk, len(stored))
	}
	if failed := loadAll(t, e, stored); len(failed) != 0 {
		t.Fatalf("loads of blocks on disk failed: %v", failed)
	}
	if _, blocks := d.Svc.Disk().Usage(); blocks == 0 {
		t.Fatal("nothing in the disk tier")
	}
	flush(t, d)
	if err := d.Svc.CheckAccounting(); err != nil {
		t.Fatal(err)
	}
}

// TestCleanRestartKeepsDisk: every block whose disk write landed before a
// clean shutdown is there after the restart, byte-exact.
func TestCleanRestartKeepsDisk(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true
	d := testenv.Start(t, o)
	e := register(t, d, small, "restart")
	stored := storeMany(t, e, 2, 12)
	flush(t, d)
	d.Stop(t)

	d2 := testenv.Start(t, o)
	e2 := register(t, d2, small, "restart")
	if !e2.reg.JoinedExisting {
		t.Fatal("the namespace did not come back from the disk tier's catalog")
	}
	lr := e2.lookup(t, stored)
	if int(lr.Ready) != len(stored) {
		t.Fatalf("after restart %d of %d blocks ready", lr.Ready, len(stored))
	}
	if failed := loadAll(t, e2, stored); len(failed) != 0 {
		t.Fatalf("loads after restart failed: %v", failed)
	}
	// Loaded blocks were promoted to the CPU tier.
	if lr := e2.lookup(t, stored[:4]); lr.Tiers[0] != pb.Tier_TIER_CPU_AND_DISK {
		t.Fatalf("after a disk hit the block is in %v", lr.Tiers[0])
	}
	// --disk-reset starts empty.
	d2.Stop(t)
	o.DiskReset = true
	d3 := testenv.Start(t, o)
	e3 := register(t, d3, small, "restart")
	if lr := e3.lookup(t, stored); lr.Ready != 0 {
		t.Fatalf("after a reset %d blocks are offered", lr.Ready)
	}
}

// TestCorruptionFromOutside flips a byte of a block's payload in the slot
// file: the load reports CORRUPT for exactly that block, and no later Lookup
// offers it.
func TestCorruptionFromOutside(t *testing.T) {
	dir := t.TempDir()
	o := diskOpts(dir)
	o.WriteThrough = true
	d := testenv.Start(t, o)
	e := register(t, d, small, "corrupt")
	stored := storeMany(t, e, 3, 8)
	flush(t, d)
	d.Stop(t)

	// The first block written went to the first slot of the file: a
	// 4 KiB header, then its payload.
	f, err := os.OpenFile(filepath.Join(dir, "kvoffload-0.slots"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	f.ReadAt(b, 4096+12345)
	b[0] ^= 0x40
	f.WriteAt(b, 4096+12345)
	f.Close()

	d2 := testenv.Start(t, o)
	e2 := register(t, d2, small, "corrupt")
	// Recovery verifies payloads: the corrupt slot does not come back.
	if lr := e2.lookup(t, stored); lr.Ready != 0 {
		t.Fatalf("a block with a corrupt payload was recovered and offered (%d ready)", lr.Ready)
	}
	if lr := e2.lookup(t, stored[1:]); int(lr.Ready) != len(stored)-1 {
		t.Fatalf("the intact blocks: %d of %d ready", lr.Ready, len(stored)-1)
	}

	// Corrupt it while the daemon runs: the load must catch it.
	f, _ = os.OpenFile(filepath.Join(dir, "kvoffload-0.slots"), os.O_RDWR, 0)
	defer f.Close()
	slot := int64(256<<10 + 4096) // the second slot holds the second block
	f.ReadAt(b, slot+4096+777)
	b[0] ^= 0x01
	f.WriteAt(b, slot+4096+777)
	res := e2.load(t, 1, stored[1:3], seq(40, 2))
	if res.Ok || len(res.Failures) != 1 || res.Failures[0].BlockId != 40 || res.Failures[0].Status != pb.BlockStatus_BLOCK_STATUS_CORRUPT {
		t.Fatalf("load of a block corrupted on disk: %+v", res)
	}
	e2.verify(t, res, stored[1:3], seq(40, 2))
	if lr := e2.lookup(t, stored[1:2]); lr.Ready != 0 {
		t.Fatal("a block that failed verification is offered again")
	}
	if res := e2.load(t, 2, stored[1:2], seq(40, 1)); res.Failures[0].Status != pb.BlockStatus_BLOCK_STATUS_MISSING {
		t.Fatalf("second load of the corrupt block: %+v", res)
	}
}

// TestInjectedFaults: each fault kind, at rate 1, ends as the right per-block
// status, never as wrong bytes, and a failed block is never offered again.
func TestInjectedFaults(t *testing.T) {
	cases := []struct {
		spec   string
		read   bool // a read fault (else a write fault)
		status pb.BlockStatus
	}{
		{"read-eio=1", true, pb.BlockStatus_BLOCK_STATUS_IO_ERROR},
		{"short-read=1", true, pb.BlockStatus_BLOCK_STATUS_IO_ERROR},
		{"bitflip=1", true, pb.BlockStatus_BLOCK_STATUS_CORRUPT},
		{"write-eio=1", false, 0},
		{"torn-write=1", false, 0},
		{"enospc=1", false, 0},
	}
	for _, tc := range cases {
		t.Run(tc.spec, func(t *testing.T) {
			dir := t.TempDir()
			o := diskOpts(dir)
			o.WriteThrough = true
			fs := faultFS(t, tc.spec)
			fs.Pause() // the files open and recover on a healthy disk
			o.DiskFS = fs
			d := testenv.Start(t, o)
			e := register(t, d, small, "faults")
			if !tc.read {
				fs.Resume()
			}
			stored := storeMany(t, e, 4, 6)
			if len(stored) != 6 {
				t.Fatalf("stored %d of 6", len(stored))
			}
			flush(t, d)
			if !tc.read {
				// Every disk write failed: the blocks stay in the CPU
				// tier, and nothing of them may come back from disk.
				lr := e.lookup(t, stored)
				if lr.Ready != 6 || lr.Tiers[0] != pb.Tier_TIER_CPU {
					t.Fatalf("after failed disk writes: %+v", lr)
				}
				if failed := loadAll(t, e, stored); len(failed) != 0 {
					t.Fatalf("CPU copies failed: %v", failed)
				}
				if sumCounts(fs) == 0 {
					t.Fatal("no fault was injected")
				}
				d.Stop(t)
				o.DiskFS = nil
				d2 := testenv.Start(t, o)
				e2 := register(t, d2, small, "faults")
				if lr := e2.lookup(t, stored); lr.Ready != 0 {
					t.Fatalf("%d blocks whose writes failed came back after restart", lr.Ready)
				}
				return
			}
			d.Stop(t)
			fs = faultFS(t, tc.spec)
			fs.Pause()
			o.DiskFS = fs
			d2 := testenv.Start(t, o)
			e2 := register(t, d2, small, "faults")
			if lr := e2.lookup(t, stored); lr.Ready != 6 {
				t.Fatalf("before the faulty reads: %d ready", lr.Ready)
			}
			fs.Resume()
			failed := loadAll(t, e2, stored)
			if failed[tc.status] != 6 || len(failed) != 1 {
				t.Fatalf("failures %v, want 6 x %v", failed, tc.status)
			}
			if lr := e2.lookup(t, stored); lr.Ready != 0 {
				t.Fatalf("blocks that failed are offered again: %d", lr.Ready)
			}
			if tc.status == pb.BlockStatus_BLOCK_STATUS_IO_ERROR && d2.Svc.Disk().Quarantined() != 6 {
				t.Fatalf("%d slots quarantined, want 6", d2.Svc.Disk().Quarantined())
			}
			if err := d2.Svc.CheckAccounting(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func sumCounts(fs *errorfs.FS) uint64 {
	var n uint64
	for _, c := range fs.Counts() {
		n += c
	}
	return n
}

func faultFS(t testing.TB, spec string) *errorfs.FS {
	t.Helper()
	plan, err := errorfs.ParsePlan(spec + ",seed=1")
	if err != nil {
		t.Fatal(err)
	}
	fs, err := errorfs.New(vfs.Default, errorfs.Options{Plan: plan, Match: slotFiles})
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

func slotFiles(path string) bool { return filepath.Ext(path) == ".slots" }

// TestFaultSweep fails the n-th disk operation of a fixed workload, for
// every n, then restarts on a healthy disk: the daemon never crashes, never
// delivers a wrong block, and its slot accounting matches its index.
func TestFaultSweep(t *testing.T) {
	run := func(t *testing.T, dir string, failAt int64) (ops int64) {
		fs, err := errorfs.New(vfs.Default, errorfs.Options{Match: slotFiles})
		if err != nil {
			t.Fatal(err)
		}
		fs.FailAtIndex(failAt)
		o := diskOpts(dir)
		o.WriteThrough = true
		o.DiskFS = fs
		d, err := testenv.TryStart(t, o)
		if err != nil {
			// Failing to open or preallocate the slot file is a
			// refusal to start, with the reason.
			if failAt > 2 || !strings.Contains(err.Error(), "slot file") {
				t.Fatalf("fail at %d: %v", failAt, err)
			}
			return fs.Ops()
		}
		e := register(t, d, small, "sweep")
		stored := storeMany(t, e, 5, 6)
		flush(t, d)
		// Drop the CPU copies so the loads read the disk.
		loadAll(t, e, stored)
		d.Stop(t)
		ops = fs.Ops()

		o.DiskFS = nil
		d2 := testenv.Start(t, o)
		e2 := register(t, d2, small, "sweep")
		lr := e2.lookup(t, stored)
		loadAll(t, e2, stored[:lr.Ready])
		if err := d2.Svc.CheckAccounting(); err != nil {
			t.Fatalf("fail at %d: %v", failAt, err)
		}
		d2.Stop(t)
		return ops
	}
	total := run(t, t.TempDir(), -1)
	if total < 10 {
		t.Fatalf("the workload made only %d disk operations", total)
	}
	for n := int64(0); n < total; n++ {
		t.Run(fmt.Sprint(n), func(t *testing.T) { run(t, t.TempDir(), n) })
	}
}
