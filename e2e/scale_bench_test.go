package e2e

import (
	"context"
	"os"
	"runtime/pprof"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
)

// BenchmarkRecoverSmallBlocks restarts a daemon on a disk tier full of
// 65,536 4 KiB blocks (KVOFFLOAD_BENCH_BLOCKS sets another count) and times its background recovery (issue 34, item
// 6): us/block is the wall time of the scan per block, as Stats reports it,
// cpu-us/block the process's CPU time (user and system, every goroutine and
// the GC) from the start of the restarted daemon to the end of its
// recovery, per recovered block. Profile it with -cpuprofile: the
// restarted daemons' goroutines carry the label phase=recover (pprof
// -tagfocus phase=recover leaves out the fill; the GC's workers carry no
// label).
func BenchmarkRecoverSmallBlocks(b *testing.B) {
	n := 1 << 16
	if v := os.Getenv("KVOFFLOAD_BENCH_BLOCKS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 512 || n%512 != 0 {
			b.Fatalf("KVOFFLOAD_BENCH_BLOCKS=%q: want a multiple of 512", v)
		}
	}
	dir := b.TempDir()
	// Room for the n blocks (8 KiB slots) and a chunk more.
	o := testenv.Options{CPUBytes: 64 << 20, DiskDirs: []string{dir}, DiskBytes: uint64(n)*8<<10 + 64<<20, DiskChunkBytes: 32 << 20, WriteThrough: true, Quiet: true}
	d := testenv.Start(b, o)
	m := testenv.Model{Layers: 1, SegBytes: 4 << 10, Blocks: 512}
	e := register(b, d, m, "recover-small")
	for i := 0; i < n; i += m.Blocks {
		hs := e.hashes(uint64(i), m.Blocks)
		if res := e.store(b, uint64(i+1), hs, seq(0, m.Blocks)); !res.Ok {
			b.Fatalf("fill: %d blocks failed", len(res.Failures))
		}
		flush(b, d)
	}
	d.Stop(b)
	var blocks uint64
	var took, cpu time.Duration
	for b.Loop() {
		pprof.Do(context.Background(), pprof.Labels("phase", "recover"), func(context.Context) {
			c0 := cpuTime(b)
			d := testenv.Start(b, o)
			select {
			case <-d.Svc.DiskRecovered():
			case <-time.After(5 * time.Minute):
				b.Fatal("recovery did not end")
			}
			cpu += cpuTime(b) - c0
			st, _ := d.Svc.DiskRecovery()
			blocks, took = st.Blocks, took+st.Elapsed
			d.Stop(b)
		})
	}
	if blocks < uint64(n)*9/10 {
		b.Fatalf("%d of %d blocks recovered", blocks, n)
	}
	b.ReportMetric(float64(took.Microseconds())/float64(b.N)/float64(blocks), "us/block")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N)/float64(blocks), "cpu-us/block")
	b.ReportMetric(float64(blocks), "blocks")
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
