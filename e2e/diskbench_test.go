package e2e

import (
	"context"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// The disk-tier benchmarks run the daemon's loads from disk and its writes
// to disk beside raw O_DIRECT reads and writes of 2 MiB at the same queue
// depth (8) in the same directory, in the same run. The directory is a
// temporary one on the machine's disk.

const diskQD = 8

func diskBenchDir(b *testing.B) string {
	dir := b.TempDir()
	if err := vfs.ProbeDirect(dir); err != nil {
		b.Skipf("%s: %v", dir, err)
	}
	return dir
}

// diskBench is a daemon whose 64 MiB CPU tier (28 blocks of 2 MiB under
// the policy, 4 kept free) sits in front of 512 MiB of disk holding 160
// blocks.
func diskBench(b *testing.B, dir string) (*engine, [][]byte) {
	o := testenv.Options{CPUBytes: 64 << 20, ChunkBytes: 8 << 20, DiskDirs: []string{dir}, DiskBytes: 512 << 20, DiskChunkBytes: 32 << 20, WriteThrough: true, Quiet: true}
	d := testenv.Start(b, o)
	e := register(b, d, roundTrip, "diskbench")
	var hs [][]byte
	for i := 0; len(hs) < 160; i += 4 {
		part := e.hashes(uint64(100+i), 4)
		res := e.store(b, uint64(i), part, seq(0, 4))
		flush(b, d)
		hs = append(hs, storedOK(res, part)...)
	}
	return e, hs[:160]
}

// BenchmarkDiskLoad loads 4 blocks per job (the CPU slots a step may
// stage into), cycling over 160 blocks on disk with 28 in the CPU tier:
// most blocks are read from disk, verified, and copied into engine memory.
// okMB/s counts the bytes of blocks loaded OK.
func BenchmarkDiskLoad(b *testing.B) {
	e, hs := diskBench(b, diskBenchDir(b))
	ctx := context.Background()
	var ok uint64
	i := 0
	for b.Loop() {
		part := hs[i%160 : i%160+4]
		res, err := e.c.Load(ctx, e.reg.RegistrationId, []*pb.Job{testenv.Job(uint64(1000+i), part, seq(32, 4))}, true)
		if err != nil {
			b.Fatal(err)
		}
		ok += res[0].Bytes
		i += 4
	}
	b.ReportMetric(float64(ok)/b.Elapsed().Seconds()/1e6, "okMB/s")
}

// BenchmarkDiskStore stores 4 new 2 MiB blocks per op with write-through
// and waits until they are on disk (one step's worth of stores for a CPU
// tier that keeps 4 slots free). okMB/s counts blocks stored OK (the
// admission policy may decline some in a full CPU tier).
func BenchmarkDiskStore(b *testing.B) {
	e, _ := diskBench(b, diskBenchDir(b))
	ctx := context.Background()
	var ok uint64
	i := 0
	for b.Loop() {
		hs := e.hashes(uint64(10_000+i), 4)
		e.c.Lookup(ctx, []uint32{e.reg.NamespaceId}, testenv.Keys(hs...), 0)
		res, err := e.c.Store(ctx, e.reg.RegistrationId, []*pb.Job{testenv.Job(uint64(5000+i), hs, seq(0, 4))}, true)
		if err != nil {
			b.Fatal(err)
		}
		ok += res[0].Bytes
		flush(b, e.d)
		i++
	}
	b.ReportMetric(float64(ok)/b.Elapsed().Seconds()/1e6, "okMB/s")
}

// BenchmarkRawODirect is the limit: reads (or writes) of 2 MiB with
// O_DIRECT, 8 in flight, over a 192 MiB file in the same kind of
// directory. Compare its MB/s with the daemon's okMB/s.
func BenchmarkRawODirect(b *testing.B) {
	for _, op := range []string{"read", "write"} {
		b.Run("op="+op, func(b *testing.B) {
			dir := diskBenchDir(b)
			const size = 192 << 20
			f, err := vfs.Default.OpenFile(filepath.Join(dir, "raw"), size, true)
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			bufs := make([][]byte, diskQD)
			for i := range bufs {
				bufs[i], err = vfs.AlignedBuffer(2 << 20)
				if err != nil {
					b.Fatal(err)
				}
				defer vfs.FreeBuffer(bufs[i])
			}
			for off := int64(0); off < size; off += 2 << 20 { // written once: reads reach the device
				if _, err := f.WriteAt(bufs[0], off); err != nil {
					b.Fatal(err)
				}
			}
			b.SetBytes(diskQD * 2 << 20)
			next := int64(0)
			for b.Loop() {
				var wg sync.WaitGroup
				for q := 0; q < diskQD; q++ {
					off := (next + int64(q)) % (size >> 21) << 21
					wg.Add(1)
					go func(buf []byte) {
						defer wg.Done()
						if op == "read" {
							_, err = f.ReadAt(buf, off)
						} else {
							_, err = f.WriteAt(buf, off)
						}
					}(bufs[q])
				}
				wg.Wait()
				next += diskQD
			}
		})
	}
}
