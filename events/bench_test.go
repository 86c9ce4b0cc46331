package events

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// BenchmarkChange is the cost the hub adds to a change of a block's tiers
// (a store landing, an eviction), from parallel writers: with nobody
// subscribed, with a subscriber reading everything, and with that one and
// 63 more that each follow 64 other namespaces (MaxSubscribers, as many
// routers or connectors of other engines); "nohub" is the index alone.
func BenchmarkChange(b *testing.B) {
	for _, name := range []string{"nohub", "none", "subscribed", "64x64"} {
		b.Run(name, func(b *testing.B) {
			ix := index.New()
			h := &Hub{}
			if name != "nohub" {
				h = New(ix, Config{})
			}
			stop := make(chan struct{})
			var readers sync.WaitGroup
			read := func(nss []uint32) {
				sub, err := h.Subscribe(nss, false)
				if err != nil {
					b.Fatal(err)
				}
				readers.Add(1)
				go func() {
					defer readers.Done()
					defer sub.Close()
					buf := make([]Event, 0, 1024)
					for {
						if _, err := sub.Next(context.Background(), stop, buf); err != nil {
							return
						}
					}
				}()
			}
			if name == "subscribed" || name == "64x64" {
				read(nil)
			}
			if name == "64x64" {
				for i := range 63 {
					nss := make([]uint32, 64)
					for j := range nss {
						nss[j] = uint32(1000 + i*64 + j)
					}
					read(nss)
				}
			}
			var next atomic.Uint64
			toCPU := func(e *index.Entry, _ bool) bool { e.State, e.CPU, e.Disk = index.Ready, 1, index.NoSlot; return true }
			drop := func(*index.Entry, bool) bool { return false }
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				k := key(1, next.Add(1)<<32)
				for i := uint64(0); pb.Next(); i++ {
					// Each key is stored, then dropped: every op is a change.
					k.Hash[15] = byte(i >> 1)
					if i&1 == 0 {
						ix.Mutate(&k, toCPU)
					} else {
						ix.Mutate(&k, drop)
					}
				}
			})
			b.StopTimer()
			close(stop)
			readers.Wait()
		})
	}
}

// BenchmarkSnapshot is what a snapshot costs per block (issue 34, item 3):
// "read" is reading it through a subscription, as the WatchEvents handler
// does (1024 events a reply), "locked" is the part of it spent under the
// shards' locks (index.ScanChunk with the hub's callback), where a Lookup
// of that shard waits. ns/op and allocs/op are per block.
func BenchmarkSnapshot(b *testing.B) {
	const n = 1 << 18
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	for i := uint64(0); i < n; i++ {
		set(ix, key(1, i), index.InCPU)
	}
	b.Run("read", func(b *testing.B) {
		buf := make([]Event, 0, 1024)
		b.ReportAllocs()
		for b.Loop() {
			sub, err := h.Subscribe(nil, true)
			if err != nil {
				b.Fatal(err)
			}
			for done := false; !done; {
				evs, err := sub.Next(context.Background(), nil, buf)
				if err != nil {
					b.Fatal(err)
				}
				done = evs[len(evs)-1].Kind == CaughtUp
				buf = evs[:0]
			}
			sub.Close()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n, "ns/block")
	})
	b.Run("locked", func(b *testing.B) {
		sub, err := h.Subscribe(nil, true)
		if err != nil {
			b.Fatal(err)
		}
		defer sub.Close()
		b.ReportAllocs()
		for b.Loop() {
			for i := range index.Shards {
				for pos, more := 0, true; more; {
					sub.snap = sub.snapBuf[:0]
					pos, more = ix.ScanChunk(i, pos, snapChunk, sub.take, sub.taken)
					sub.snapBuf = sub.snap[:0]
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n, "ns/block")
	})
}
