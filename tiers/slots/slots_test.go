package slots

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func key(i int) index.Key {
	k := plainKey(i)
	testKeys.Store(index.HashKey(&k), k)
	return k
}

// plainKey is key without filing it in testKeys.
func plainKey(i int) index.Key {
	var k index.Key
	binary.LittleEndian.PutUint64(k.Hash[:], uint64(i)+1)
	return k
}

// testKeys plays the owner's index for Config.Keys: every key a test
// makes (key) is filed under its PolicyKey.
var testKeys sync.Map // uint64 → index.Key

func keysOf(h uint64, into []index.Key) []index.Key {
	if k, ok := testKeys.Load(h); ok {
		into = append(into, k.(index.Key))
	}
	return into
}

// owner plays the offload service: it remembers which key holds which slot
// and releases slots when the policy evicts.
type owner struct {
	mu       sync.Mutex
	sp       *Space
	slot     map[index.Key]SlotID
	evicted  []index.Key
	rejected []index.Key
	ranges   int
}

// testPolicy is the policy newSpace gives its space ("": the default,
// SLRU); bothPolicies runs a test under each.
var testPolicy Policy

func bothPolicies(t *testing.T, test func(t *testing.T)) {
	for _, p := range []Policy{SLRU, TinyLFU} {
		t.Run(string(p), func(t *testing.T) {
			testPolicy = p
			defer func() { testPolicy = "" }()
			test(t)
		})
	}
}

func newSpace(t *testing.T, bytes, chunk uint64) (*Space, *owner) {
	t.Helper()
	o := &owner{slot: map[index.Key]SlotID{}}
	sp, err := New(Config{
		Name: "test", Bytes: bytes, ChunkBytes: chunk, Policy: testPolicy, Keys: keysOf,
		Reject: func(k index.Key) {
			o.mu.Lock()
			defer o.mu.Unlock()
			o.rejected = append(o.rejected, k)
		},
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
	bothPolicies(t, func(t *testing.T) {
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
	})
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

// audit checks the space against the owner's view: every slot the owner
// holds is named, and the owner holds no pins.
func (o *owner) audit(t *testing.T, extraPins map[SlotID]uint32) {
	t.Helper()
	o.mu.Lock()
	named := map[SlotID]*Class{}
	for _, s := range o.slot {
		_, size := o.sp.ChunkOf(s)
		o.sp.mu.Lock()
		named[s] = o.sp.mu.classes[size]
		o.sp.mu.Unlock()
	}
	o.mu.Unlock()
	if err := o.sp.Audit(named, extraPins); err != nil {
		t.Fatal(err)
	}
}

// TestPinsDoNotWrap: 65,536 pins on one slot (a lease per scheduler step
// gets there) used to wrap a 16-bit count to 0, and a released slot was
// then handed to another block while its readers still copied out of it.
func TestPinsDoNotWrap(t *testing.T) {
	sp, _ := newSpace(t, 1<<20, 1<<20)
	c, _ := sp.Class(256 << 10)
	c.Admit([]index.Key{key(1)})
	s, _ := c.Alloc() // the writer's pin
	for i := 0; i < 1<<16-1; i++ {
		sp.Pin(s)
	}
	sp.Release(s)
	for i := 0; i < 3; i++ { // the other three slots
		c.Admit([]index.Key{key(10 + i)})
		if got, ok := c.Alloc(); !ok || got == s {
			t.Fatalf("alloc %d: slot %d %v; slot %d holds 65536 pins", i, got, ok, s)
		}
	}
	if again, ok := c.Alloc(); ok {
		t.Fatalf("slot %d handed out again while pinned 65536 times", again)
	}
	// The count saturates instead of wrapping.
	sp.mu.Lock()
	p, _ := sp.slotLocked(s)
	*p = MaxPins - 1
	sp.mu.Unlock()
	sp.mu.Lock()
	_, st := sp.slotLocked(s)
	*st = slotUsed // Pin wants a slot in use
	sp.mu.Unlock()
	if !sp.Pin(s) {
		t.Fatal("pin below the ceiling refused")
	}
	if sp.Pin(s) {
		t.Fatal("a pin past MaxPins was taken")
	}
}

// TestEvictingPinnedBlocksKeepsRoom: the policy evicting a block whose slot
// is pinned (a lease, a load) used to count that slot as free room; with
// the free list empty it then admitted without evicting, and every store
// found no slot until the pins dropped.
func TestEvictingPinnedBlocksKeepsRoom(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		sp, o := newSpace(t, 1<<20, 1<<20)
		c, _ := sp.Class(64 << 10) // 16 slots
		var pinned []SlotID
		for i := 0; i < 16; i++ {
			s, ok := o.store(t, c, key(i))
			if !ok {
				t.Fatalf("store %d found no slot", i)
			}
			if i%2 == 0 {
				sp.Pin(s) // a lease on half the blocks
				pinned = append(pinned, s)
			}
		}
		failed := 0
		for i := 100; i < 300; i++ {
			if _, ok := o.store(t, c, key(i)); !ok {
				c.Forget(&[]index.Key{key(i)}[0])
				failed++
			}
		}
		// Each pinned block the policy evicts may cost one store its slot,
		// no more.
		if failed > len(pinned) {
			t.Fatalf("%d of 200 stores found no slot with %d slots pinned", failed, len(pinned))
		}
		extra := map[SlotID]uint32{}
		for _, s := range pinned {
			extra[s] = 1
		}
		o.audit(t, extra)
		for _, s := range pinned {
			sp.Unpin(s)
		}
		o.audit(t, nil)
	})
}

// TestReserveKeepsASlot: the reserve used to round to nothing below eight
// slots.
func TestReserveKeepsASlot(t *testing.T) {
	o := &owner{slot: map[index.Key]SlotID{}}
	sp, err := New(Config{Name: "test", Bytes: 1 << 20, ChunkBytes: 1 << 20, Reserve: 1.0 / 8, Keys: keysOf,
		Evict: func(k index.Key) {
			o.mu.Lock()
			defer o.mu.Unlock()
			o.evicted = append(o.evicted, k)
			if s, ok := o.slot[k]; ok {
				delete(o.slot, k)
				o.sp.Release(s)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	o.sp = sp
	defer sp.Close()
	c, _ := sp.Class(256 << 10) // 4 slots
	for i := 0; i < 8; i++ {
		o.store(t, c, key(i))
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.slot) != 3 {
		t.Fatalf("the policy keeps %d blocks in 4 slots with a reserve", len(o.slot))
	}
}

// TestStagingSlotsAreLeftToAllocStaging: Alloc leaves Config.Staging's
// share of free slots (at least one) to AllocStaging, which may take them;
// a slot freed again serves either.
func TestStagingSlotsAreLeftToAllocStaging(t *testing.T) {
	sp, err := New(Config{Name: "test", Bytes: 1 << 20, ChunkBytes: 1 << 20, Reserve: 1.0 / 8, Staging: 1.0 / 32})
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	c, _ := sp.Class(256 << 10) // 4 slots
	c.Grow(4)
	got := allocAll(c)
	if len(got) != 3 {
		t.Fatalf("Alloc took %d of 4 slots, want 3 (one left for staging)", len(got))
	}
	st, ok := c.AllocStaging()
	if !ok {
		t.Fatal("AllocStaging found no slot with one left for it")
	}
	if _, ok := c.AllocStaging(); ok {
		t.Fatal("AllocStaging took a fifth slot")
	}
	sp.Release(st)
	sp.Unpin(st)
	if _, ok := c.Alloc(); ok {
		t.Fatal("Alloc took the slot staging left free again")
	}
	sp.Release(got[0])
	sp.Unpin(got[0])
	if _, ok := c.Alloc(); !ok {
		t.Fatal("Alloc found no slot with two free")
	}
}

// TestAdmitGrowsPastTheStagingSlots: a class grows for an admitted batch
// so that every block of it finds a slot Alloc may take: counting the
// staging slots as room refused the last blocks of a 64-block store into a
// class of exactly 64 free slots.
func TestAdmitGrowsPastTheStagingSlots(t *testing.T) {
	sp, err := New(Config{Name: "test", Bytes: 4 << 20, ChunkBytes: 1 << 20, Reserve: 1.0 / 8, Staging: 1.0 / 32})
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	c, _ := sp.Class(16 << 10) // 64 slots a chunk
	var keys []index.Key
	for i := range 64 {
		keys = append(keys, key(i))
	}
	c.Admit(keys)
	if got := len(allocAll(c)); got < 64 {
		t.Fatalf("Alloc gave %d slots after a 64-block batch was admitted", got)
	}
}

// TestAdmitTwiceInOneBatch: offering a key twice in one batch used to make
// ristretto reject the second offer, which the owner took for a rejection
// of the key.
func TestAdmitTwiceInOneBatch(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		var rejected []index.Key
		var mu sync.Mutex
		sp, err := New(Config{Name: "test", Bytes: 1 << 20, ChunkBytes: 1 << 20, Policy: testPolicy,
			Reject: func(k index.Key) { mu.Lock(); rejected = append(rejected, k); mu.Unlock() }})
		if err != nil {
			t.Fatal(err)
		}
		defer sp.Close()
		c, _ := sp.Class(4096)
		k := key(7)
		c.Admit([]index.Key{k, k})
		mu.Lock()
		defer mu.Unlock()
		if len(rejected) != 0 {
			t.Fatalf("rejected %v", rejected)
		}
		if !c.Holds(&k) {
			t.Fatal("the key is not in the policy")
		}
	})
}

// TestQuarantineDoesNotStrandAChunk: a chunk moving to another slot size
// used to wait for a quarantined slot that never frees; now it moves, and
// the bad bytes stay out of use under the new slot size.
func TestQuarantineDoesNotStrandAChunk(t *testing.T) {
	sp, o := newSpace(t, 2<<20, 1<<20) // 2 chunks
	a, _ := sp.Class(256 << 10)
	var first SlotID
	for i := 0; i < 8; i++ {
		s, ok := o.store(t, a, key(i))
		if !ok {
			t.Fatalf("store %d", i)
		}
		if s == 0 {
			first = s
		}
	}
	// Slot 0 (chunk 0) returns an I/O error: the owner drops it.
	o.mu.Lock()
	for k, s := range o.slot {
		if s == first {
			delete(o.slot, k)
		}
	}
	o.mu.Unlock()
	sp.Quarantine(first)
	o.audit(t, nil)
	b, _ := sp.Class(192 << 10)
	s, ok := o.store(t, b, key(100))
	if !ok {
		t.Fatal("the second slot size got no chunk: the quarantined slot stranded it")
	}
	if ch, size := sp.ChunkOf(s); ch != 0 || size != 192<<10 {
		t.Fatalf("new slot %d in chunk %d of %d-byte slots", s, ch, size)
	}
	// 192 KiB slots 0 and 1 overlap the bad 256 KiB; neither is used.
	if off := Offset(s); off < 256<<10 {
		t.Fatalf("slot at byte %d overlaps the quarantined range", off)
	}
	if q := sp.Quarantined(); q != 2 {
		t.Fatalf("%d slots quarantined, want the 2 over the bad range", q)
	}
	o.audit(t, nil)
}

// TestClassGoesWithLastUser: a class, its policy and its goroutines go
// away with the last reference once its slots are free; slot sizes are
// bounded by the chunks.
func TestClassGoesWithLastUser(t *testing.T) {
	sp, o := newSpace(t, 4<<20, 1<<20) // 4 chunks
	base := runtime.NumGoroutine()
	var cs []*Class
	for i := 1; i <= 4; i++ {
		c, err := sp.Class(uint64(i) * 64 << 10)
		if err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	if _, err := sp.Class(1 << 20); !errors.Is(err, ErrTooManyClasses) {
		t.Fatalf("a fifth block size in 4 chunks: %v", err)
	}
	// A second reference to a size that exists is fine.
	again, err := sp.Class(64 << 10)
	if err != nil || again != cs[0] {
		t.Fatalf("same size: %v", err)
	}
	again.Drop()
	s, ok := o.store(t, cs[0], key(1))
	if !ok {
		t.Fatal("store")
	}
	for _, c := range cs {
		c.Drop()
	}
	// The class holding a block stays until the block goes.
	if n := sp.Classes(); n != 1 {
		t.Fatalf("%d classes left, want the one holding a block", n)
	}
	sp.Release(s)
	o.mu.Lock()
	o.slot = map[index.Key]SlotID{}
	o.mu.Unlock()
	if n := sp.Classes(); n != 0 {
		t.Fatalf("%d classes left", n)
	}
	o.audit(t, nil)
	waitGoroutines(t, base) // 2 per policy, now gone
	if c, err := sp.Class(1 << 20); err != nil {
		t.Fatalf("a new size after the others went: %v", err)
	} else {
		c.Drop()
	}
}

// TestPolicyMemoryIsBounded: the policies' counters of every class
// together stay within the budget set by the space, however many sizes a
// client asks for.
func TestPolicyMemoryIsBounded(t *testing.T) {
	sp, _ := newSpace(t, 64<<20, 1<<20) // 64 chunks
	var cs []*Class
	for i := 1; i <= 64; i++ {
		c, err := sp.Class(uint64(i) * 4096)
		if err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	budget := sp.counterBudget + int64(len(cs))*minCounters
	sp.mu.Lock()
	got := sp.mu.counters
	sp.mu.Unlock()
	if got > budget {
		t.Fatalf("%d policy counters for 64 sizes, budget %d", got, budget)
	}
	for _, c := range cs {
		c.Drop()
	}
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if sp.mu.counters != 0 {
		t.Fatalf("%d counters left with no class", sp.mu.counters)
	}
}

// TestCloseReportsNoEvictions: closing a policy clears it (ristretto
// reported every cleared key as evicted); the owner must not hear of them.
func TestCloseReportsNoEvictions(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		sp, o := newSpace(t, 1<<20, 1<<20)
		c, _ := sp.Class(64 << 10)
		for i := 0; i < 8; i++ {
			o.store(t, c, key(i))
		}
		sp.Close()
		o.mu.Lock()
		defer o.mu.Unlock()
		if len(o.evicted) != 0 {
			t.Fatalf("close evicted %d keys", len(o.evicted))
		}
	})
}

func waitGoroutines(t *testing.T, atMost int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > atMost {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines, want at most %d", runtime.NumGoroutine(), atMost)
		}
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
}

// TestRandomOpsKeepTheBookkeeping drives stores into three slot sizes that
// compete for chunks, pins, unpins, drops, quarantines and class references
// in a seeded random order, and audits the space after every step.
func TestRandomOpsKeepTheBookkeeping(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		for seed := uint64(1); seed <= 4; seed++ {
			t.Run(fmt.Sprint(seed), func(t *testing.T) {
				r := rand.New(rand.NewPCG(seed, 7))
				sp, o := newSpace(t, 4<<20, 1<<20) // 4 chunks
				sizes := []uint64{64 << 10, 192 << 10, 256 << 10}
				classes := map[uint64]*Class{}
				pins := map[SlotID]uint32{}
				// Void slots the eraser holds, each with its pin, until an
				// erase step lets one go.
				var erasing []SlotID
				sp.SetEraser(func(s SlotID) { erasing = append(erasing, s) })
				allPins := func() map[SlotID]uint32 {
					m := maps.Clone(pins)
					for _, s := range erasing {
						m[s]++
					}
					return m
				}
				next := 0
				ownedSlots := func() []SlotID {
					o.mu.Lock()
					defer o.mu.Unlock()
					out := make([]SlotID, 0, len(o.slot))
					for _, s := range o.slot {
						out = append(out, s)
					}
					slices.Sort(out)
					return out
				}
				drop := func(s SlotID) bool { // the owner forgets the key of s
					o.mu.Lock()
					defer o.mu.Unlock()
					for k, ks := range o.slot {
						if ks == s {
							delete(o.slot, k)
							return true
						}
					}
					return false
				}
				for step := 0; step < 600; step++ {
					switch op := r.IntN(11); {
					case op < 4: // store
						size := sizes[r.IntN(len(sizes))]
						c := classes[size]
						if c == nil {
							var err error
							if c, err = sp.Class(size); err != nil {
								t.Fatal(err)
							}
							classes[size] = c
						}
						next++
						o.store(t, c, key(next))
					case op < 6: // pin
						if s := ownedSlots(); len(s) > 0 {
							x := s[r.IntN(len(s))]
							if sp.Pin(x) {
								pins[x]++
							}
						}
					case op < 8: // unpin
						for x := range pins {
							sp.Unpin(x)
							if pins[x]--; pins[x] == 0 {
								delete(pins, x)
							}
							break
						}
					case op < 9: // drop or quarantine a block
						if s := ownedSlots(); len(s) > 0 {
							x := s[r.IntN(len(s))]
							if drop(x) {
								switch r.IntN(4) {
								case 0:
									sp.Quarantine(x)
								case 1:
									sp.Void(x)
								default:
									sp.Release(x)
								}
							}
						}
					case op < 10: // an erase lands
						if len(erasing) > 0 {
							x := erasing[0]
							erasing = erasing[1:]
							sp.Unpin(x)
						}
					default: // a class loses its last user, or comes back
						size := sizes[r.IntN(len(sizes))]
						if c := classes[size]; c != nil {
							c.Drop()
							delete(classes, size)
						}
					}
					o.audit(t, allPins())
				}
				for x, n := range pins {
					for ; n > 0; n-- {
						sp.Unpin(x)
					}
				}
				for len(erasing) > 0 {
					x := erasing[0]
					erasing = erasing[1:]
					sp.Unpin(x)
				}
				o.audit(t, nil)
				for _, c := range classes {
					c.Drop()
				}
			})
		}
	})
}

// allocAll takes every slot Alloc gives.
func allocAll(c *Class) []SlotID {
	var got []SlotID
	for {
		s, ok := c.Alloc()
		if !ok {
			return got
		}
		got = append(got, s)
	}
}

// TestConcurrentAdmitsEvictNothingWhileThereIsRoom: stores in flight at
// once each Admit their keys before any of them takes its slots. Each
// Admit used to count the free slots the others had already been promised,
// so the policy evicted blocks (or declined new ones) while the space had
// free chunks.
func TestConcurrentAdmitsEvictNothingWhileThereIsRoom(t *testing.T) {
	for _, reserve := range []float64{0, 1.0 / 8} {
		t.Run(fmt.Sprintf("reserve=%v", reserve), func(t *testing.T) {
			bothPolicies(t, func(t *testing.T) {
				testConcurrentAdmits(t, reserve)
			})
		})
	}
}

func testConcurrentAdmits(t *testing.T, reserve float64) {
	var mu sync.Mutex
	var evicted, rejected int
	count := func(n *int) func(index.Key) {
		return func(index.Key) { mu.Lock(); *n++; mu.Unlock() }
	}
	// 16 chunks of 256 4 KiB slots: 4,096 slots, of which the stores
	// below take 2,048.
	sp, err := New(Config{Name: "test", Bytes: 16 << 20, ChunkBytes: 1 << 20, Reserve: reserve, Policy: testPolicy,
		Evict: count(&evicted), Reject: count(&rejected), Keys: keysOf})
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	c, err := sp.Class(4 << 10)
	if err != nil {
		t.Fatal(err)
	}
	const stores, batch, rounds = 16, 32, 4
	var admitted, wg sync.WaitGroup
	fails := make(chan string, stores*rounds)
	for r := range rounds {
		admitted.Add(stores)
		wg.Add(stores)
		for g := range stores {
			go func() {
				defer wg.Done()
				keys := make([]index.Key, batch)
				for i := range keys {
					keys[i] = key((r*stores+g)*batch + i)
				}
				c.Admit(keys)
				admitted.Done()
				admitted.Wait() // every store of the round is in flight
				for range keys {
					s, ok := c.Alloc()
					if !ok {
						fails <- fmt.Sprintf("round %d store %d found no slot", r, g)
						return
					}
					sp.Unpin(s)
				}
			}()
		}
		wg.Wait()
	}
	close(fails)
	for f := range fails {
		t.Error(f)
	}
	mu.Lock()
	defer mu.Unlock()
	if evicted != 0 || rejected != 0 {
		t.Fatalf("%d blocks evicted and %d declined with 2,048 of 4,096 slots in use", evicted, rejected)
	}
	if _, blocks := sp.Usage(); blocks != stores*batch*rounds {
		t.Fatalf("%d blocks in use, want %d", blocks, stores*batch*rounds)
	}
}
