package disk_test

import (
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// BenchmarkRecover measures the recovery of a slot file full of 2 MiB
// blocks (read, verify, bring every block online) against a raw O_DIRECT
// sequential read of the same file, 4 MiB reads, 4 in flight, in the same
// run: the ratio of the two MB/s is what recovery costs over the disk's
// limit.
//
//	KVOFFLOAD_BENCH_DIR=/mnt/nvme go test -run '^$' -bench Recover -count 6 ./tiers/disk > new.txt
//	benchstat -col /impl new.txt
//
// KVOFFLOAD_BENCH_BYTES sets the file's size (default 1 GiB) and
// KVOFFLOAD_BENCH_BLOCK the payload of a block (default 2 MiB; 4096 for the
// small blocks of issue 34); the file is written once, before timing.
func BenchmarkRecover(b *testing.B) {
	block := uint64(2 << 20)
	if s := os.Getenv("KVOFFLOAD_BENCH_BLOCK"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil || n == 0 {
			b.Fatalf("KVOFFLOAD_BENCH_BLOCK: %q", s)
		}
		block = n
	}
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
	cfg := disk.Config{Dirs: []string{filepath.Join(dir, "tier")}, BytesPerDir: size,
		ChunkBytes: max(slots.DefaultChunkBytes(size), disk.SlotBytes(block)), Direct: true, Logger: quiet()}
	fillForBench(b, cfg, block)
	path := filepath.Join(cfg.Dirs[0], "kvoffload-0.slots")

	b.Run("impl=raw", func(b *testing.B) {
		b.SetBytes(int64(size / cfg.ChunkBytes * cfg.ChunkBytes))
		for b.Loop() {
			if _, err := baseline.SequentialRead(path, int64(size/cfg.ChunkBytes*cfg.ChunkBytes), 4<<20, 4); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("impl=recover", func(b *testing.B) {
		var scanned, blocks uint64
		var took float64
		for b.Loop() {
			tier, err := disk.Open(cfg)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := recoverSync(b, tier, func(r disk.Recovered) (index.Key, bool) { return keyOf(r), true }); err != nil {
				b.Fatal(err)
			}
			st := tier.Recovery()
			scanned, blocks = st.BytesScanned, st.Blocks
			took += st.Elapsed.Seconds()
			tier.Close()
		}
		// MB/s counts Open and Close too; recoverMB/s only the
		// background scan, as Stats reports it.
		b.SetBytes(int64(scanned))
		b.ReportMetric(float64(scanned)*float64(b.N)/took/1e6, "recoverMB/s")
		b.ReportMetric(float64(blocks), "blocks")
	})
}

// fillForBench fills every slot of a fresh tier with blocks of payload
// bytes, 8 writes in flight.
func fillForBench(b *testing.B, cfg disk.Config, payload uint64) {
	b.Helper()
	c := cfg
	c.Reset = true
	tier, err := disk.Open(c)
	if err != nil {
		b.Fatal(err)
	}
	defer tier.Close()
	n := int(tier.Capacity() / c.ChunkBytes * (c.ChunkBytes / disk.SlotBytes(payload)))
	var bs []block
	for i := range n {
		bs = append(bs, newBlock(i, payload, 32))
	}
	ss := alloc(b, tier, payload, bs)
	sem := make(chan []byte, 8)
	for range 8 {
		sem <- arena(b, layout.AlignUp(payload))
	}
	var wg sync.WaitGroup
	for i, s := range ss {
		buf := <-sem
		bs[i].fill(buf)
		wg.Add(1)
		tier.Write(s, bs[i].meta, buf, func(err error) {
			if err != nil {
				b.Error(err)
			}
			tier.Unpin(s)
			sem <- buf
			wg.Done()
		})
	}
	wg.Wait()
}
