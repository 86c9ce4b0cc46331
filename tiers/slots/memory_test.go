package slots

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// BenchmarkMemoryPerBlock measures what the daemon's structures hold per
// block (issue 34, item 4): n 4 KiB blocks filed in an index and held by a
// class of each policy (SLRU: the CPU tier's default; TinyLFU: the disk
// tier's), with their slots, read from runtime.MemStats after a GC. Run it
// with -benchtime=1x: go test -run X -bench MemoryPerBlock -benchtime=1x.
func BenchmarkMemoryPerBlock(b *testing.B) {
	for _, n := range []int{1 << 17, 1 << 20} {
		for _, p := range []Policy{SLRU, TinyLFU} {
			b.Run(fmt.Sprintf("%s/%d", p, n), func(b *testing.B) {
				for b.Loop() {
					idx, pol := memoryPerBlock(b, p, n)
					b.ReportMetric(idx, "index-B/block")
					b.ReportMetric(pol, "policy+slots-B/block")
				}
			})
		}
	}
}

func heap() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

func memoryPerBlock(b *testing.B, p Policy, n int) (indexB, policyB float64) {
	keys := make([]index.Key, n)
	for i := range keys {
		keys[i] = key(i)
	}
	h0 := heap()
	ix := index.New()
	for i := range keys {
		ix.Mutate(&keys[i], func(e *index.Entry, _ bool) bool { e.State, e.CPU = index.Ready, uint32(i); return true })
	}
	h1 := heap()
	// Room for every block: the policy never evicts.
	sp, err := New(Config{Name: "mem", Bytes: uint64(n) * 4 << 10, Policy: p})
	if err != nil {
		b.Fatal(err)
	}
	defer sp.Close()
	c, err := sp.Class(4 << 10)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < n; i += 512 {
		batch := keys[i:min(i+512, n)]
		c.Admit(batch)
		for range batch {
			s, ok := c.Alloc()
			if !ok {
				b.Fatalf("no slot for block %d", i)
			}
			sp.Unpin(s)
		}
	}
	h2 := heap()
	if !c.Holds(&keys[n-1]) {
		b.Fatal("the policy does not hold the last block")
	}
	runtime.KeepAlive(ix)
	return float64(h1-h0) / float64(n), float64(h2-h1) / float64(n)
}
