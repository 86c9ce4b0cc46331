package disk_test

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// BenchmarkIO measures the tier's Write and Read of 2 MiB blocks at queue
// depth 8 against raw O_DIRECT WriteAt and ReadAt of the same blocks, at
// the same file offsets and depth, in the same run, so the ratio says what
// the tier costs (a header write or read per block, checksums, queueing):
//
//	KVOFFLOAD_BENCH_DIR=/mnt/nvme go test -run '^$' -bench IO -count 6 ./tiers/disk > new.txt
//	benchstat -col /impl new.txt
//
// The directory defaults to a temporary one; it must accept O_DIRECT.
// KVOFFLOAD_BENCH_BYTES sets the size of each file (default 1 GiB). Both
// files are written in full before timing: reads of preallocated space
// that was never written never reach the device, and first writes into it
// pay for converting extents.
func BenchmarkIO(b *testing.B) {
	const block, qd = 2 << 20, 8
	dir := os.Getenv("KVOFFLOAD_BENCH_DIR")
	if dir == "" {
		dir = b.TempDir()
	}
	if err := vfs.ProbeDirect(dir); err != nil {
		b.Skipf("%s: %v", dir, err)
	}
	size := uint64(1 << 30)
	if s := os.Getenv("KVOFFLOAD_BENCH_BYTES"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			b.Fatalf("KVOFFLOAD_BENCH_BYTES: %v", err)
		}
		size = n
	}
	chunkBytes := max(slots.DefaultChunkBytes(size), disk.SlotBytes(block))

	tier, err := disk.Open(disk.Config{Dirs: []string{filepath.Join(dir, "tier")}, BytesPerDir: size, ChunkBytes: chunkBytes,
		Direct: true, Reset: true, QueueDepth: qd, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	defer tier.Close()
	raw, err := vfs.Default.OpenFile(filepath.Join(dir, "raw"), int64(size), true)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		raw.Close()
		os.Remove(filepath.Join(dir, "raw"))
	}()

	// Every slot of the tier, and its payload's offset for the raw file.
	c, err := tier.Class(disk.SlotBytes(block))
	if err != nil {
		b.Fatal(err)
	}
	n := int(tier.Capacity() / chunkBytes * (chunkBytes / disk.SlotBytes(block)))
	keys := make([]index.Key, n)
	for i := range keys {
		keys[i] = newBlock(i, block, 32).key
	}
	c.Admit(keys)
	ss := make([]slots.SlotID, n)
	metas := make([]disk.Meta, n)
	offs := make([]int64, n)
	for i := range ss {
		s, ok := c.Alloc()
		if !ok {
			b.Fatalf("%d slots allocated, want %d", i, n)
		}
		ss[i], metas[i] = s, newBlock(i, block, 32).meta
		offs[i] = int64(slots.Offset(s)) + slot.HeaderSize
	}
	// Any buffer may carry any block, so they all hold the same bytes.
	bufs := make([][]byte, qd)
	for i := range bufs {
		bufs[i] = arena(b, block)
		for j := range bufs[i] {
			bufs[i][j] = byte(j*7 + j>>12)
		}
	}
	sum := slot.Checksum(bufs[0])
	for i := range metas {
		metas[i].PayloadSum = sum // recorded when the block became ready in the CPU tier
	}

	tierWrite := func(i int, buf []byte, done func(error)) { tier.Write(ss[i], metas[i], buf, done) }
	tierRead := func(i int, buf []byte, done func(error)) { tier.Read(ss[i], metas[i], buf, done) }
	rawWrite := func(i int, buf []byte) error { _, err := raw.WriteAt(buf, offs[i]); return err }
	rawRead := func(i int, buf []byte) error { _, err := raw.ReadAt(buf, offs[i]); return err }

	// Fill both files, untimed.
	if err := runTier(n, n, bufs, tierWrite); err != nil {
		b.Fatal(err)
	}
	if err := runRaw(n, n, bufs, rawWrite); err != nil {
		b.Fatal(err)
	}

	for _, op := range []string{"write", "read"} {
		b.Run("op="+op, func(b *testing.B) {
			b.Run("impl=raw", func(b *testing.B) {
				f := rawWrite
				if op == "read" {
					f = rawRead
				}
				b.SetBytes(block)
				b.ReportAllocs()
				if err := runRaw(b.N, n, bufs, f); err != nil {
					b.Fatal(err)
				}
			})
			b.Run("impl=tier", func(b *testing.B) {
				f := tierWrite
				if op == "read" {
					f = tierRead
				}
				b.SetBytes(block)
				b.ReportAllocs()
				if err := runTier(b.N, n, bufs, f); err != nil {
					b.Fatal(err)
				}
			})
		})
	}
}

// runTier submits count requests over n slots keeping len(bufs) in
// flight, and waits for them all (the wait is timed: b.N and not b.Loop,
// whose clock stops before the last requests drain).
func runTier(count, n int, bufs [][]byte, submit func(i int, buf []byte, done func(error))) error {
	free := make(chan []byte, len(bufs))
	for _, buf := range bufs {
		free <- buf
	}
	var wg sync.WaitGroup
	var first atomic.Pointer[error]
	for i := range count {
		buf := <-free
		wg.Add(1)
		submit(i%n, buf, func(err error) {
			if err != nil {
				first.CompareAndSwap(nil, &err)
			}
			free <- buf
			wg.Done()
		})
	}
	wg.Wait()
	if p := first.Load(); p != nil {
		return *p
	}
	return nil
}

// runRaw does count transfers over n offsets from len(bufs) goroutines,
// each with one transfer in flight: the depth of the tier's workers.
func runRaw(count, n int, bufs [][]byte, do func(i int, buf []byte) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, len(bufs))
	for w, buf := range bufs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= count {
					return
				}
				if err := do(i%n, buf); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
