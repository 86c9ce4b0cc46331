package events

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// BenchmarkChange is the cost the hub adds to a change of a block's tiers
// (a store landing, an eviction), from parallel writers: with nobody
// subscribed, and with a subscriber reading everything; "nohub" is the
// index alone.
func BenchmarkChange(b *testing.B) {
	for _, name := range []string{"nohub", "none", "subscribed"} {
		subscribed := name == "subscribed"
		b.Run(name, func(b *testing.B) {
			ix := index.New()
			h := &Hub{}
			if name != "nohub" {
				h = New(ix, Config{})
			}
			stop := make(chan struct{})
			done := make(chan struct{})
			if subscribed {
				sub, _ := h.Subscribe(nil, false)
				go func() {
					defer close(done)
					defer sub.Close()
					buf := make([]Event, 0, 1024)
					for {
						if _, err := sub.Next(context.Background(), stop, buf); err != nil {
							return
						}
					}
				}()
			} else {
				close(done)
			}
			var next atomic.Uint64
			toCPU := func(e *index.Entry, _ bool) bool { e.State, e.CPU, e.Disk = index.Ready, 1, index.NoSlot; return true }
			drop := func(*index.Entry, bool) bool { return false }
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				k := key(1, next.Add(1)<<32)
				for i := uint64(0); pb.Next(); i++ {
					k.Hash[15] = byte(i)
					if i&1 == 0 {
						ix.Mutate(&k, toCPU)
					} else {
						ix.Mutate(&k, drop)
					}
				}
			})
			b.StopTimer()
			close(stop)
			<-done
		})
	}
}
