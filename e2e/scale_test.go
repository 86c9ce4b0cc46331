package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"

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
	errs := make(chan error, ranks)
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
