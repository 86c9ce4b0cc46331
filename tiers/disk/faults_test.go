package disk_test

import (
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

func onlySlotFiles(path string) bool { return strings.HasSuffix(path, ".slots") }

// Each injected fault ends as the error class the offload service acts
// on, never as wrong bytes reported good; what was reported written comes
// back after a restart on a healthy disk, and nothing else does.
func TestFaultKinds(t *testing.T) {
	cases := []struct {
		kind  errorfs.Kind
		plan  errorfs.Plan
		write bool  // the fault hits writes, not reads
		want  error // the class of the failures it causes
		cause error // what the failure wraps
		// quarantine: the slot is to blame (disk.ShouldQuarantine)
		quarantine bool
	}{
		{errorfs.ReadEIO, errorfs.Plan{ReadEIO: 0.4}, false, disk.ErrIO, syscall.EIO, true},
		{errorfs.ShortRead, errorfs.Plan{ShortRead: 0.4}, false, disk.ErrIO, nil, true},
		{errorfs.BitFlip, errorfs.Plan{BitFlip: 0.4}, false, disk.ErrCorrupt, nil, false},
		{errorfs.WriteEIO, errorfs.Plan{WriteEIO: 0.3}, true, disk.ErrIO, syscall.EIO, true},
		{errorfs.TornWrite, errorfs.Plan{TornWrite: 0.3}, true, disk.ErrIO, syscall.EIO, true},
		{errorfs.ENOSPC, errorfs.Plan{ENOSPC: 0.3}, true, disk.ErrIO, syscall.ENOSPC, false},
	}
	const size = 6 * 4096 // several 4 KiB units, so torn writes and short reads can keep some
	for _, c := range cases {
		t.Run("kind="+c.kind.String(), func(t *testing.T) {
			inner := vfs.NewMem()
			var efs *errorfs.FS
			var tier *disk.Tier
			cfg := disk.Config{Dirs: []string{"/disk/a"}, BytesPerDir: 2 * chunk, ChunkBytes: chunk, Direct: true, Logger: quiet()}
			// ENOSPC also hits the preallocation at Open: try seeds until
			// one lets the file be created (a rate of 0.3 leaves most).
			for seed := uint64(1); tier == nil; seed++ {
				plan := c.plan
				plan.Seed = seed
				var err error
				if efs, err = errorfs.New(inner, errorfs.Options{Plan: plan, Match: onlySlotFiles}); err != nil {
					t.Fatal(err)
				}
				cfg.FS = efs
				if tier, err = disk.Open(cfg); err != nil {
					if !errors.Is(err, errorfs.ErrInjected) || seed > 50 {
						t.Fatalf("Open: %v", err)
					}
				}
			}
			var bs []block
			for i := range 40 {
				bs = append(bs, newBlock(i, size, 32))
			}
			ss := alloc(t, tier, size, bs)
			written := map[slots.SlotID]block{}
			failures := 0
			for i, s := range ss {
				err := writeBlock(t, tier, s, bs[i])
				tier.Unpin(s)
				if err == nil {
					written[s] = bs[i]
					continue
				}
				failures++
				if !c.write || !errors.Is(err, c.want) || !errors.Is(err, errorfs.ErrInjected) || (c.cause != nil && !errors.Is(err, c.cause)) {
					t.Errorf("write: %v; want %v from an injected %v", err, c.want, c.cause)
				}
				if disk.ShouldQuarantine(err) != c.quarantine {
					t.Errorf("write: %v: ShouldQuarantine = %v", err, !c.quarantine)
				}
			}
			for i, s := range ss {
				err := readBlock(t, tier, s, bs[i])
				_, ok := written[s]
				switch {
				case err == nil && !ok:
					t.Errorf("slot %d: a failed write reads back as good", s)
				case err != nil && !ok:
					if !errors.Is(err, disk.ErrCorrupt) {
						t.Errorf("slot %d: after a failed write, Read = %v; want ErrCorrupt", s, err)
					}
				case err != nil:
					failures++
					if c.write || !errors.Is(err, c.want) || (c.cause != nil && !errors.Is(err, c.cause)) {
						t.Errorf("slot %d: Read = %v; want %v", s, err, c.want)
					}
					if disk.ShouldQuarantine(err) != c.quarantine {
						t.Errorf("slot %d: Read = %v: ShouldQuarantine = %v", s, err, !c.quarantine)
					}
				}
			}
			if n := efs.Counts()[c.kind]; n == 0 || failures == 0 {
				t.Fatalf("%d faults injected, %d failures: the test tests nothing", n, failures)
			}
			tier.Close()

			// Restart on a healthy disk.
			cfg.FS = inner
			tier = open(t, cfg)
			got := recovered(t, tier)
			if len(got) != len(written) {
				t.Errorf("recovered %d blocks, %d were written", len(got), len(written))
			}
			for s := range got {
				b, ok := written[s]
				if !ok {
					t.Errorf("slot %d came back, its write had failed", s)
					continue
				}
				if err := readBlock(t, tier, s, b); err != nil {
					t.Errorf("slot %d: %v", s, err)
				}
			}
		})
	}
}

// sweepResult is what a workload run saw.
type sweepResult struct {
	opened    bool // the second Open succeeded
	recovered int
}

// workload writes blocks of two sizes over two files, reads them, closes,
// reopens, recovers and reads again, acting on each failure as the
// offload service does. It fails t if a read reports wrong bytes as good,
// if an error has the wrong class, or if the Space's accounting drifts
// from what the workload holds.
func workload(t *testing.T, fsys vfs.FS) sweepResult {
	var res sweepResult
	cfg := disk.Config{Dirs: []string{"/disk/a", "/disk/b"}, BytesPerDir: 2 * chunk, ChunkBytes: chunk,
		FS: fsys, Direct: true, QueueDepth: 2, Logger: quiet()}
	tier, err := disk.Open(cfg)
	if err != nil {
		return res
	}
	if err := tier.SaveNamespace(testNS, []byte("meta")); err != nil && !errors.Is(err, errorfs.ErrInjected) {
		t.Errorf("SaveNamespace: %v", err)
	}
	_, err = recoverSync(t, tier, func(r disk.Recovered) (index.Key, bool) {
		t.Errorf("a new tier recovered %+v", r)
		return index.Key{}, false
	})
	if err != nil {
		t.Errorf("Recover of a new tier: %v", err)
	}
	everWritten := map[slots.SlotID]block{}
	held := map[slots.SlotID]block{} // in the Space, by this workload
	quarantined := 0
	var all []block
	for _, size := range []uint64{5000, 40 << 10} {
		bs := []block{newBlock(len(all), size, 32), newBlock(len(all)+1, size, 16), newBlock(len(all)+2, size, 32)}
		all = append(all, bs...)
		for i, s := range alloc(t, tier, size, bs) {
			err := writeBlock(t, tier, s, bs[i])
			tier.Unpin(s)
			if err != nil {
				if !errors.Is(err, disk.ErrIO) {
					t.Errorf("write: %v; want ErrIO", err)
				}
				tier.Release(s)
				continue
			}
			everWritten[s] = bs[i]
			held[s] = bs[i]
		}
	}
	readAll := func() {
		for s, b := range held {
			switch err := readBlock(t, tier, s, b); {
			case err == nil:
			case errors.Is(err, disk.ErrIO):
				tier.Quarantine(s)
				delete(held, s)
				quarantined++
			default:
				tier.Release(s)
				delete(held, s)
			}
		}
	}
	readAll()
	for s := range held {
		tier.Discard(s, nil)
		tier.Release(s)
		delete(held, s)
		delete(everWritten, s)
		break
	}
	checkSpace(t, tier, len(held)+quarantined)
	tier.Close()

	tier, err = disk.Open(cfg)
	if err != nil {
		return res
	}
	defer tier.Close()
	res.opened = true
	held, quarantined = map[slots.SlotID]block{}, 0
	var mu sync.Mutex
	_, err = recoverSync(t, tier, func(r disk.Recovered) (index.Key, bool) {
		mu.Lock()
		defer mu.Unlock()
		b, ok := everWritten[r.Slot]
		if !ok || keyOf(r) != b.key || r.PayloadLen != b.meta.PayloadLen {
			// A discard that failed may bring its block back.
			t.Logf("slot %d came back holding %x: not written there, or discarded", r.Slot, r.Hash[:4])
			for _, a := range all {
				if a.key == keyOf(r) && a.meta.PayloadLen == r.PayloadLen {
					b, ok = a, true
				}
			}
			if !ok {
				t.Errorf("slot %d came back holding a block never written: %+v", r.Slot, r)
				return index.Key{}, false
			}
		}
		held[r.Slot] = b
		return b.key, true
	})
	if err != nil {
		t.Errorf("Recover: %v", err)
	}
	res.recovered = len(held)
	readAll()
	checkSpace(t, tier, len(held)+quarantined)
	return res
}

func checkSpace(t *testing.T, tier *disk.Tier, blocks int) {
	t.Helper()
	if _, n := tier.Usage(); n != uint64(blocks) || tier.Pinned() != 0 || tier.Quarantined() > blocks {
		t.Errorf("Space holds %d blocks (%d pinned, %d quarantined); the workload holds %d", n, tier.Pinned(), tier.Quarantined(), blocks)
	}
}

// Fail the n-th filesystem operation of a fixed workload, for every n:
// no wrong bytes are ever reported good, nothing panics, no slot leaks.
func TestFailAtIndexSweep(t *testing.T) {
	clean, err := errorfs.New(vfs.NewMem(), errorfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	res := workload(t, clean)
	ops := clean.Ops()
	if !res.opened || res.recovered != 5 {
		t.Fatalf("clean run: %+v; want 5 blocks back", res)
	}
	t.Logf("workload: %d operations", ops)
	if t.Failed() {
		return
	}
	for n := range ops {
		efs, err := errorfs.New(vfs.NewMem(), errorfs.Options{})
		if err != nil {
			t.Fatal(err)
		}
		efs.FailAtIndex(n)
		workload(t, efs)
		if got := efs.Counts()[errorfs.Index]; got != 1 {
			t.Errorf("n=%d: %d faults injected, want 1", n, got)
		}
		if t.Failed() {
			t.Fatalf("failed with operation %d of %d failing", n, ops)
		}
	}
}
