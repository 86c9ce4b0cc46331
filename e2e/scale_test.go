package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// TestConcurrentStoresEvictNothingWhileThereIsRoom: many engines (ranks of
// one model) store small blocks at once into a CPU tier with room for twice
// what they store. Each store's admission used to count the free slots the
// other stores in flight had been promised already, so the policy evicted
// blocks (lost, without a disk tier) although the tier had free chunks
// (issue 34, item 1).
func TestConcurrentStoresEvictNothingWhileThereIsRoom(t *testing.T) {
	// 64 MiB of 4 KiB slots in chunks of 32: 16,384 slots, 512 chunks.
	// Each store takes a chunk's worth of slots: the class grows at
	// almost every admission, and the ranks' admissions overlap.
	d := testenv.Start(t, testenv.Options{CPUBytes: 64 << 20, ChunkBytes: 128 << 10, Quiet: true})
	m := testenv.Model{Layers: 1, SegBytes: 4 << 10, Blocks: 32}
	const ranks, rounds, batch = 32, 8, 32 // 8,192 blocks
	es := make([]*engine, ranks)
	for i := range es {
		es[i] = register(t, d, m, "tp16")
	}
	stored := make([][][]byte, ranks)
	// The ranks start each round together, as a model's ranks store the
	// same step's blocks.
	var round [rounds]sync.WaitGroup
	for r := range round {
		round[r].Add(ranks)
	}
	var wg sync.WaitGroup
	errs := make(chan error, ranks*rounds)
	for i, e := range es {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				hs := e.hashes(uint64(i*rounds+r), batch)
				for b, h := range hs {
					m.Fill(e.r, b, h)
				}
				round[r].Done()
				round[r].Wait()
				res, err := e.c.Store(context.Background(), e.reg.RegistrationId, []*pb.Job{testenv.Job(uint64(r), hs, seq(0, batch))}, true)
				if err != nil {
					errs <- err
					for ; r+1 < rounds; r++ {
						round[r+1].Done() // the others' rounds go on
					}
					return
				}
				if !res[0].Ok {
					errs <- fmt.Errorf("rank %d round %d: store failed with the tier half empty: %v", i, r, res[0].Failures)
				}
				stored[i] = append(stored[i], storedOK(res[0], hs)...)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	var all [][]byte
	for _, hs := range stored {
		all = append(all, hs...)
	}
	lr := es[0].lookup(t, all)
	st := d.Svc.Stats()
	if int(lr.Ready) != len(all) || st.Namespaces[0].Blocks != uint64(len(all)) || st.Evictions != 0 {
		t.Fatalf("%d of %d stored blocks held, %d evicted, with %d of %d bytes of the CPU tier in use", st.Namespaces[0].Blocks, len(all), st.Evictions, st.Tiers[0].UsedBytes, st.Tiers[0].CapacityBytes)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// TestStoresFasterThanTheDiskLoseNothing: a CPU tier full of stored
// blocks, half of them clean (on disk too: the cleaner wrote them ahead),
// then a burst of stores while every disk I/O is slow. Each store takes a
// clean copy's slot and the policy evicts a dirty block, which waits in its
// CPU slot for its disk write. The demotion queue (4,096 entries) used to
// drop the blocks past it, blocks reported stored, from every tier (issue
// 34, item 2). Now every block reported stored stays readable until its
// write lands; a store that finds no CPU slot is refused NO_SPACE, per block
// (or REJECTED, evicted before its copy drained).
func TestStoresFasterThanTheDiskLoseNothing(t *testing.T) {
	fs := faultFS(t, "latency=20ms@1")
	fs.Pause() // a fast disk until the burst
	// 64 MiB of 4 KiB slots (16,384) over a disk with room for 65,536.
	o := testenv.Options{CPUBytes: 64 << 20, ChunkBytes: 1 << 20, DiskDirs: []string{t.TempDir()}, DiskBytes: 256 << 20,
		DiskChunkBytes: 1 << 20, DiskFS: fs, Quiet: true}
	d := testenv.Start(t, o)
	m := testenv.Model{Layers: 1, SegBytes: 4 << 10, Blocks: 4096}
	const ranks = 4
	es := make([]*engine, ranks)
	for i := range es {
		es[i] = register(t, d, m, "burst")
	}
	var mu sync.Mutex
	var all [][]byte
	refused := 0
	// storeAll stores rounds steps of 4,096 blocks on the first n ranks at
	// once.
	storeAll := func(seed uint64, n, rounds int) {
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i, e := range es[:n] {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for r := range rounds {
					hs := e.hashes(seed+uint64(i*rounds+r), m.Blocks)
					for b, h := range hs {
						m.Fill(e.r, b, h)
					}
					res, err := e.c.Store(context.Background(), e.reg.RegistrationId, []*pb.Job{testenv.Job(seed+uint64(r), hs, seq(0, m.Blocks))}, true)
					if err != nil {
						errs <- err
						return
					}
					for _, f := range res[0].Failures {
						// Refused for want of a slot, or evicted by the
						// policy before its copy drained: not stored,
						// and reported so.
						if f.Status != pb.BlockStatus_BLOCK_STATUS_NO_SPACE && f.Status != pb.BlockStatus_BLOCK_STATUS_REJECTED {
							errs <- fmt.Errorf("rank %d: block %d failed %v", i, f.Index, f.Status)
							return
						}
					}
					mu.Lock()
					refused += len(res[0].Failures)
					all = append(all, storedOK(res[0], hs)...)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	// Fill most of the CPU tier (14,336 blocks past the write-back
	// reserve), and let the cleaner write a Store's worth ahead.
	storeAll(0, 3, 1)
	// 3,072 clean copies make the burst below overflow the old queue
	// (10,489 blocks dropped). The cleaner aims for the largest recent
	// Store, a margin that decays: on a slow machine (-race) it may settle
	// lower, and the burst then shows less.
	waitFor(t, "the cleaner to write blocks ahead", func() bool {
		c, _ := d.Svc.CPUCopies()
		return c >= 3072 || c > 0 && float64(c) >= gauge(t, d.Registry, "kvoffload_cpu_clean_margin_blocks")
	})
	clean, _ := d.Svc.CPUCopies()
	fs.Resume() // 20 ms per disk I/O: about 400 writes a second
	storeAll(1000, ranks, 2)
	fs.Pause()
	flush(t, d)
	dm := demotions(t, d.Registry)
	st := d.Svc.Stats()
	t.Logf("%d clean copies before the burst; %d blocks stored, %d refused; demotions %v", clean, len(all), refused, dm)
	if dm["dropped"] != 0 || st.Namespaces[0].Blocks != uint64(len(all)) {
		t.Fatalf("%d of %d blocks reported stored are held; %v blocks dropped from the demotion queue", st.Namespaces[0].Blocks, len(all), dm["dropped"])
	}
	// Every stored block is readable, intact (a sample: one in 64).
	var sample [][]byte
	for i := 0; i < len(all); i += 64 {
		sample = append(sample, all[i])
	}
	if failed := loadAll(t, es[0], sample); len(failed) != 0 {
		t.Fatalf("loads of blocks reported stored failed: %v", failed)
	}
	if err := d.Svc.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// gauge is a gauge's value (its first series).
func gauge(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}
