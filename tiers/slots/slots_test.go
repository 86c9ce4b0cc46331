package slots

import (
	"encoding/binary"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvoffloadd/kvoffloadd/index"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func key(i int) index.Key {
	var k index.Key
	binary.LittleEndian.PutUint64(k.Hash[:], uint64(i)+1)
	return k
}

// owner plays the offload service: it remembers which key holds which slot
// and releases slots when the policy evicts.
type owner struct {
	mu      sync.Mutex
	sp      *Space
	slot    map[index.Key]SlotID
	evicted []index.Key
	ranges  int
}

func newSpace(t *testing.T, bytes, chunk uint64) (*Space, *owner) {
	t.Helper()
	o := &owner{slot: map[index.Key]SlotID{}}
	sp, err := New(Config{
		Name: "test", Bytes: bytes, ChunkBytes: chunk,
		Evict: func(k index.Key) {
			o.mu.Lock()
			defer o.mu.Unlock()
			o.evicted = append(o.evicted, k)
			if s, ok := o.slot[k]; ok {
				delete(o.slot, k)
				o.sp.Release(s)
			}
		},
		EvictRange: func(lo, hi SlotID) {
			o.mu.Lock()
			defer o.mu.Unlock()
			o.ranges++
			for k, s := range o.slot {
				if s >= lo && s < hi {
					delete(o.slot, k)
					o.sp.Release(s)
				}
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	o.sp = sp
	t.Cleanup(sp.Close)
	return sp, o
}

func (o *owner) store(t *testing.T, c *Class, k index.Key) (SlotID, bool) {
	t.Helper()
	c.Admit([]index.Key{k})
	s, ok := c.Alloc()
	if !ok {
		return s, false
	}
	o.mu.Lock()
	o.slot[k] = s
	o.mu.Unlock()
	o.sp.Unpin(s) // the write drained
	return s, true
}

func TestAllocPinReleaseOrder(t *testing.T) {
	sp, _ := newSpace(t, 1<<20, 1<<20)
	c, err := sp.Class(256 << 10)
	if err != nil {
		t.Fatal(err)
	}
	c.Admit([]index.Key{key(1), key(2), key(3), key(4)})
	var got []SlotID
	for i := 0; i < 4; i++ {
		s, ok := c.Alloc()
		if !ok {
			t.Fatalf("alloc %d failed", i)
		}
		got = append(got, s)
	}
	if _, ok := c.Alloc(); ok {
		t.Fatal("a fifth 256 KiB slot in a 1 MiB space")
	}
	if used, blocks := sp.Usage(); used != 1<<20 || blocks != 4 {
		t.Fatalf("usage %d bytes %d blocks", used, blocks)
	}
	// Released while pinned (the writer's pin, then a load's): the slot
	// comes back only when the last pin drops.
	s := got[0]
	sp.Pin(s)
	sp.Release(s)
	if _, ok := c.Alloc(); ok {
		t.Fatal("a pinned, released slot was reused")
	}
	sp.Unpin(s)
	if _, ok := c.Alloc(); ok {
		t.Fatal("reused while the load's pin remains")
	}
	sp.Unpin(s)
	if again, ok := c.Alloc(); !ok || again != s {
		t.Fatalf("slot not freed after its last pin: %d %v", again, ok)
	}
	if sp.Pinned() != 4 {
		t.Fatalf("pinned %d, want the 4 writers' pins", sp.Pinned())
	}
}

func TestMisuseIsCaught(t *testing.T) {
	sp, _ := newSpace(t, 1<<20, 1<<20)
	c, _ := sp.Class(4096)
	c.Admit([]index.Key{key(1)})
	s, _ := c.Alloc()
	sp.Unpin(s)
	sp.Release(s)
	for name, f := range map[string]func(){
		"release twice":   func() { sp.Release(s) },
		"unpin unpinned":  func() { sp.Unpin(s) },
		"pin a free slot": func() { sp.Pin(s) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

func TestPolicyEvictsWhenFull(t *testing.T) {
	sp, o := newSpace(t, 1<<20, 1<<20)
	c, _ := sp.Class(64 << 10) // 16 slots
	for i := 0; i < 16; i++ {
		if _, ok := o.store(t, c, key(i)); !ok {
			t.Fatalf("store %d found no slot", i)
		}
	}
	for i := 16; i < 40; i++ {
		o.store(t, c, key(i))
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.evicted) == 0 {
		t.Fatal("the policy never evicted in a full space")
	}
	if _, blocks := sp.Usage(); blocks > 16 || blocks != uint64(len(o.slot)) {
		t.Fatalf("%d blocks in use, owner holds %d", blocks, len(o.slot))
	}
}

func TestSecondSlotSizeTakesAChunk(t *testing.T) {
	sp, o := newSpace(t, 4<<20, 1<<20) // 4 chunks
	a, _ := sp.Class(256 << 10)
	for i := 0; i < 32; i++ {
		o.store(t, a, key(i))
	}
	if _, blocks := sp.Usage(); blocks != 16 {
		t.Fatalf("first size holds %d blocks, want all 16 slots", blocks)
	}
	b, err := sp.Class(192 << 10)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := o.store(t, b, key(1000)); !ok {
		t.Fatal("the second slot size got no room")
	}
	if o.ranges != 1 {
		t.Fatalf("%d chunks drained, want 1", o.ranges)
	}
	if _, err := sp.Class(8 << 20); err == nil {
		t.Fatal("a slot larger than a chunk was accepted")
	}
}

func TestRestoreAndQuarantine(t *testing.T) {
	sp, _ := newSpace(t, 2<<20, 1<<20)
	c, _ := sp.Class(256 << 10)
	// Slot 64 is byte 256 KiB: the second slot of chunk 0.
	if err := c.Restore(64, key(1)); err != nil {
		t.Fatal(err)
	}
	if err := c.Restore(64, key(2)); err == nil {
		t.Fatal("restored one slot twice")
	}
	if err := c.Restore(65, key(3)); err == nil {
		t.Fatal("restored a slot off the slot boundary")
	}
	c.Admit([]index.Key{key(10), key(11), key(12), key(13), key(14), key(15), key(16)})
	for i := 0; i < 7; i++ {
		s, ok := c.Alloc()
		if !ok || s == 64 {
			t.Fatalf("alloc %d: %d %v (64 is restored)", i, s, ok)
		}
	}
	if _, ok := c.Alloc(); ok {
		t.Fatal("8 slots handed out beside a restored one in 2 MiB")
	}
	sp.Quarantine(64)
	if sp.Quarantined() != 1 {
		t.Fatal("quarantine not counted")
	}
	if _, ok := c.Alloc(); ok {
		t.Fatal("a quarantined slot was reused")
	}
	if ch, size := sp.ChunkOf(64); ch != 0 || size != 256<<10 {
		t.Fatalf("ChunkOf: %d %d", ch, size)
	}
}
