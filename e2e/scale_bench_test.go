package e2e

import (
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

// BenchmarkRecoverSmallBlocks restarts a daemon on a disk tier full of
// 65,536 4 KiB blocks and times its background recovery (issue 34, item
// 6): us/block is the wall time of the scan per block, as Stats reports it.
// Profile it with -cpuprofile.
func BenchmarkRecoverSmallBlocks(b *testing.B) {
	dir := b.TempDir()
	o := testenv.Options{CPUBytes: 64 << 20, DiskDirs: []string{dir}, DiskBytes: 576 << 20, DiskChunkBytes: 32 << 20, WriteThrough: true, Quiet: true}
	d := testenv.Start(b, o)
	m := testenv.Model{Layers: 1, SegBytes: 4 << 10, Blocks: 512}
	e := register(b, d, m, "recover-small")
	const n = 1 << 16
	for i := 0; i < n; i += m.Blocks {
		hs := e.hashes(uint64(i), m.Blocks)
		if res := e.store(b, uint64(i+1), hs, seq(0, m.Blocks)); !res.Ok {
			b.Fatalf("fill: %d blocks failed", len(res.Failures))
		}
		flush(b, d)
	}
	d.Stop(b)
	var blocks uint64
	var took time.Duration
	for b.Loop() {
		d := testenv.Start(b, o)
		select {
		case <-d.Svc.DiskRecovered():
		case <-time.After(5 * time.Minute):
			b.Fatal("recovery did not end")
		}
		st, _ := d.Svc.DiskRecovery()
		blocks, took = st.Blocks, took+st.Elapsed
		d.Stop(b)
	}
	if blocks < n*9/10 {
		b.Fatalf("%d of %d blocks recovered", blocks, n)
	}
	b.ReportMetric(float64(took.Microseconds())/float64(b.N)/float64(blocks), "us/block")
	b.ReportMetric(float64(blocks), "blocks")
}
