package events

import (
	"context"
	"runtime"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// TestSnapshotMemoryPerBlock: reading a snapshot of many blocks allocates
// next to nothing per block (the subscription reuses one chunk's buffer):
// its memory does not grow with the index. Sending a chunk's events moved
// the buffer's start, and every next chunk allocated a new one (111 B a
// block).
func TestSnapshotMemoryPerBlock(t *testing.T) {
	ix := index.New()
	h := New(ix, Config{})
	h.SetHashLen(1, 16)
	const n = 200000
	for i := uint64(0); i < n; i++ {
		set(ix, key(1, i), index.InCPU)
	}
	sub, err := h.Subscribe(nil, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	buf := make([]Event, 0, 1024)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	stored := 0
	for done := false; !done; {
		evs, err := sub.Next(context.Background(), nil, buf)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range evs {
			switch e.Kind {
			case Stored:
				stored++
			case CaughtUp:
				done = true
			}
		}
		buf = evs[:0]
	}
	runtime.ReadMemStats(&after)
	if stored != n {
		t.Fatalf("%d blocks in the snapshot, want %d", stored, n)
	}
	if per := float64(after.TotalAlloc-before.TotalAlloc) / n; per > 4 {
		t.Fatalf("%.1f bytes allocated per block of the snapshot, want next to none", per)
	}
}
