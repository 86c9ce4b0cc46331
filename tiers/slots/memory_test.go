package slots

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// BenchmarkMemoryPerBlock measures what the daemon's structures hold per
// block (issue 34, item 4, goal ≤ 150 B): n 4 KiB blocks filed in an index
// and held by a class of each policy (SLRU: the CPU tier's default;
// TinyLFU: the disk tier's), with their slots; then the two
// configurations whole: a CPU tier holding every block (cpu-only), and a
// CPU tier holding an eighth of them over a disk tier holding all
// (cpu-over-disk, kvbench's scale shape). Read from runtime.MemStats after
// a GC. Run it with -benchtime=1x: go test -run X -bench MemoryPerBlock
// -benchtime=1x.
func BenchmarkMemoryPerBlock(b *testing.B) {
	for _, n := range []int{1 << 17, 1 << 20} {
		for _, p := range []Policy{SLRU, TinyLFU} {
			b.Run(fmt.Sprintf("%s/%d", p, n), func(b *testing.B) {
				for b.Loop() {
					idx, pol := memoryPerBlock(b, n, tierHolds{p, 0})
					b.ReportMetric(idx, "index-B/block")
					b.ReportMetric(pol, "policy+slots-B/block")
				}
			})
		}
		for _, cfg := range []struct {
			name  string
			tiers []tierHolds
		}{
			{"cpu-only", []tierHolds{{SLRU, 0}}},
			{"cpu-over-disk", []tierHolds{{SLRU, n - n/8}, {TinyLFU, 0}}},
		} {
			b.Run(fmt.Sprintf("%s/%d", cfg.name, n), func(b *testing.B) {
				for b.Loop() {
					idx, tiers := memoryPerBlock(b, n, cfg.tiers...)
					b.ReportMetric(idx+tiers, "B/block")
				}
			})
		}
	}
}

// tierHolds is a tier of one class of the policy, holding the blocks from
// the from-th on.
type tierHolds struct {
	policy Policy
	from   int
}

func heap() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// memoryPerBlock files n blocks in an index, then has each tier hold its
// share of them, and returns the heap per block the index took and the
// heap per block the tiers (their classes' policies and slots) took.
func memoryPerBlock(b *testing.B, n int, tiers ...tierHolds) (indexB, tiersB float64) {
	keys := make([]index.Key, n)
	for i := range keys {
		keys[i] = plainKey(i)
	}
	h0 := heap()
	ix := index.New()
	for i := range keys {
		ix.Mutate(&keys[i], func(e *index.Entry, _ bool) bool { e.State, e.CPU = index.Ready, uint32(i); return true })
	}
	h1 := heap()
	for _, th := range tiers {
		held := keys[th.from:]
		// Room for every block it holds: the policy never evicts.
		sp, err := New(Config{Name: "mem", Bytes: uint64(len(held)) * 4 << 10, Policy: th.policy})
		if err != nil {
			b.Fatal(err)
		}
		defer sp.Close()
		c, err := sp.Class(4 << 10)
		if err != nil {
			b.Fatal(err)
		}
		for i := 0; i < len(held); i += 512 {
			batch := held[i:min(i+512, len(held))]
			c.Admit(batch)
			for range batch {
				s, ok := c.Alloc()
				if !ok {
					b.Fatalf("no slot for block %d", i)
				}
				sp.Unpin(s)
			}
		}
		if !c.Holds(&keys[n-1]) {
			b.Fatal("the policy does not hold the last block")
		}
	}
	h2 := heap()
	runtime.KeepAlive(ix)
	runtime.KeepAlive(keys)
	return float64(h1-h0) / float64(n), float64(h2-h1) / float64(n)
}
