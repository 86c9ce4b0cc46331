package host

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// BenchmarkStepCopies measures how much of a step's copy time the workers
// sit idle (issue 11 item 4: are copy pieces small enough that no worker
// waits long for the last piece of another?). A step is jobs batches, one
// per job as the service submits them, each of blocks blocks of segs
// segments; idle-% is the share of workers × wall time not spent copying.
// Run with -count and compare split sizes with benchstat, on a machine
// nothing else uses (on a shared one the drift between runs is larger
// than any difference: issue 11's note has a run):
//
//	go test -run=NONE -bench=StepCopies -count=6 ./dma/host
func BenchmarkStepCopies(b *testing.B) {
	shapes := []struct {
		name               string
		jobs, blocks, segs int
		segBytes           uint64
	}{
		// A Llama-8B-like block: 32 layers × K and V of 16 tokens × 8
		// heads × 128 × bf16 = 64 segments of 32 KiB; a step of 8 jobs of
		// 4 blocks (16 MiB).
		{"seg=32KiB", 8, 4, 64, 32 << 10},
		// One big segment per block (MLA-like, or a cross-layer layout):
		// 2 MiB, more than a piece.
		{"seg=2MiB", 8, 4, 1, 2 << 20},
		// A step of one small job: less than a piece.
		{"seg=32KiB,one-job", 1, 2, 64, 32 << 10},
	}
	for _, sh := range shapes {
		for _, split := range []uint64{256 << 10, 1 << 20, 4 << 20} {
			for _, workers := range []int{2, 4} {
				name := fmt.Sprintf("%s/split=%dKiB/workers=%d", sh.name, split>>10, workers)
				b.Run(name, func(b *testing.B) { benchStep(b, workers, split, sh.jobs, sh.blocks, sh.segs, sh.segBytes) })
			}
		}
	}
}

func benchStep(b *testing.B, workers int, split uint64, jobs, blocks, segs int, segBytes uint64) {
	size := uint64(jobs*blocks*segs) * segBytes
	dir := b.TempDir()
	path := filepath.Join(dir, "region")
	if err := os.WriteFile(path, make([]byte, size), 0o600); err != nil {
		b.Fatal(err)
	}
	e := New(Config{ShmDir: dir, Workers: workers})
	defer e.Close()
	e.split = split
	var busy atomic.Int64
	e.onTask = func(d time.Duration) { busy.Add(int64(d)) }
	arena := make([]byte, size)
	if err := e.SetArena(arena); err != nil {
		b.Fatal(err)
	}
	r, err := e.Open(dma.RegionSpec{ShmPath: path, NumBlocks: 1, SegmentBytes: size}, dma.Peer{UID: uint32(os.Getuid()), GID: uint32(os.Getgid())})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	batches := make([][]dma.Copy, jobs)
	off := uint64(0)
	for j := range batches {
		for range blocks * segs {
			batches[j] = append(batches[j], dma.Copy{Region: r, RegionOff: off, ArenaOff: off, Len: segBytes})
			off += segBytes
		}
	}
	var wg sync.WaitGroup
	step := func() {
		wg.Add(jobs)
		for _, cs := range batches {
			e.Submit(&dma.Batch{ToArena: true, Copies: cs, Done: func(error) { wg.Done() }})
		}
		wg.Wait()
	}
	step() // the first touch of the arena's pages is not a copy's cost
	busy.Store(0)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	var wall time.Duration
	for b.Loop() {
		t0 := time.Now()
		step()
		wall += time.Since(t0)
	}
	b.ReportMetric(100*(1-float64(busy.Load())/(float64(workers)*float64(wall))), "idle-%")
}
