package slots

import (
	"slices"
	"testing"

	"github.com/kvoffloadd/kvoffloadd/index"
)

// Held chunks are never handed out; an adopted chunk serves its class
// around the slots it took; an unheld one is free for any class.
func TestHoldAdoptUnhold(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		const chunk = 1 << 20
		sp, o := newSpace(t, 4*chunk, chunk)
		c, _ := sp.Class(256 << 10) // 4 slots per chunk; chunk k starts at slot 256k
		if err := sp.Hold([]uint32{1, 2}); err != nil {
			t.Fatal(err)
		}
		if err := sp.Hold([]uint32{1}); err == nil {
			t.Fatal("held a chunk twice")
		}
		if err := sp.Hold([]uint32{7}); err == nil {
			t.Fatal("held a chunk beyond the space")
		}
		if sp.Held() != 2 {
			t.Fatalf("Held = %d", sp.Held())
		}
		var keys []index.Key
		for i := range 16 {
			keys = append(keys, key(i))
		}
		c.Admit(keys)
		got := allocAll(c)
		for _, s := range got {
			if ch := s / 256; ch == 1 || ch == 2 {
				t.Fatalf("Alloc handed out slot %d of held chunk %d", s, ch)
			}
		}
		if len(got) != 8 {
			t.Fatalf("%d slots outside the held chunks, want 8", len(got))
		}
		if err := c.Adopt(0, nil); err == nil {
			t.Fatal("adopted a chunk that is not held")
		}
		if err := c.Adopt(1, []SlotID{256 + 65}); err == nil {
			t.Fatal("adopted a slot off the slot boundary")
		}
		if err := c.Adopt(1, []SlotID{64}); err == nil {
			t.Fatal("adopted a slot of another chunk")
		}

		// Chunk 1 held one block, in its second slot.
		used, blocks := sp.Usage()
		if err := c.Adopt(1, []SlotID{256 + 64}); err != nil {
			t.Fatal(err)
		}
		if u, b := sp.Usage(); b != blocks+1 || u != used+256<<10 {
			t.Fatalf("Usage after Adopt: %d bytes %d blocks, was %d %d", u, b, used, blocks)
		}
		o.mu.Lock()
		o.slot[key(100)] = 256 + 64
		o.mu.Unlock()
		c.Learn([]index.Key{key(100)})
		var more []SlotID
		for {
			s, ok := c.Alloc()
			if !ok {
				break
			}
			more = append(more, s)
		}
		slices.Sort(more)
		if !slices.Equal(more, []SlotID{256, 256 + 128, 256 + 192}) {
			t.Fatalf("the adopted chunk gave %v, want its three free slots", more)
		}

		// Chunk 2 held nothing to keep: any class may take it.
		if err := sp.Unhold(2); err != nil {
			t.Fatal(err)
		}
		if err := sp.Unhold(2); err == nil {
			t.Fatal("unheld a chunk twice")
		}
		big, _ := sp.Class(512 << 10)
		big.Admit([]index.Key{key(200)})
		if s, ok := big.Alloc(); !ok || s/256 != 2 {
			t.Fatalf("the unheld chunk: Alloc = %d, %v", s, ok)
		}
		if sp.Held() != 0 {
			t.Fatalf("Held = %d", sp.Held())
		}

		// An adopted slot is used like any other: quarantined (its owner
		// forgets it first), it never returns.
		o.mu.Lock()
		delete(o.slot, key(100))
		o.mu.Unlock()
		c.Forget(&[]index.Key{key(100)}[0])
		sp.Quarantine(256 + 64)
		if sp.Quarantined() != 1 {
			t.Fatal("quarantine not counted")
		}
		if ch, size := sp.ChunkOf(256 + 64); ch != 1 || size != 256<<10 {
			t.Fatalf("ChunkOf: %d %d", ch, size)
		}
	})
}

// Learn puts kept blocks under the policy: when the class is over its
// capacity, the policy evicts among them and the owner's Evict sees it.
func TestLearnEvicts(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		const chunk = 1 << 20
		sp, o := newSpace(t, 2*chunk, chunk)
		c, _ := sp.Class(256 << 10)
		if err := sp.Hold([]uint32{0, 1}); err != nil {
			t.Fatal(err)
		}
		var keys []index.Key
		for ch := range uint32(2) {
			var used []SlotID
			for i := range SlotID(4) {
				s := SlotID(ch)*256 + i*64
				used = append(used, s)
				k := key(int(s))
				o.mu.Lock()
				o.slot[k] = s
				o.mu.Unlock()
				keys = append(keys, k)
			}
			if err := c.Adopt(ch, used); err != nil {
				t.Fatal(err)
			}
		}
		c.Learn(keys)
		// Eight slots, all in use, and room for all eight: nothing goes.
		if len(o.evicted) != 0 {
			t.Fatalf("evicted %d of 8 blocks that fit", len(o.evicted))
		}
		// A new block needs room: the policy evicts one of the learned.
		c.Admit([]index.Key{key(1000)})
		o.mu.Lock()
		defer o.mu.Unlock()
		if len(o.evicted) == 0 {
			t.Fatal("the policy never evicted a learned block")
		}
		for _, k := range o.evicted {
			if !slices.Contains(keys, k) {
				t.Fatalf("evicted %v, not a learned block", k)
			}
		}
	})
}

// Learn of a full adopted chunk gives the class a free chunk for its
// reserve instead of evicting blocks just recovered (a persistent arena's
// three full chunks lost an eighth of their blocks at every restart).
func TestLearnGrowsForTheReserve(t *testing.T) {
	bothPolicies(t, func(t *testing.T) {
		const chunk = 1 << 20
		o := &owner{slot: map[index.Key]SlotID{}}
		sp, err := New(Config{Name: "test", Bytes: 4 * chunk, ChunkBytes: chunk, Policy: testPolicy, Reserve: 1.0 / 8, Keys: keysOf,
			Evict: func(k index.Key) {
				o.mu.Lock()
				defer o.mu.Unlock()
				o.evicted = append(o.evicted, k)
			},
			Reject: func(k index.Key) {
				o.mu.Lock()
				defer o.mu.Unlock()
				o.rejected = append(o.rejected, k)
			}})
		if err != nil {
			t.Fatal(err)
		}
		defer sp.Close()
		c, _ := sp.Class(64 << 10) // 16 slots per chunk; chunk k starts at slot 256k
		if err := sp.Hold([]uint32{0, 1, 2, 3}); err != nil {
			t.Fatal(err)
		}
		// Chunk 3 held nothing; 0..2 are full.
		if err := sp.Unhold(3); err != nil {
			t.Fatal(err)
		}
		var all []index.Key
		for ch := range uint32(3) {
			var used []SlotID
			var keys []index.Key
			for i := range SlotID(16) {
				s := SlotID(ch)*256 + i*16
				used = append(used, s)
				keys = append(keys, key(int(s)))
			}
			if err := c.Adopt(ch, used); err != nil {
				t.Fatal(err)
			}
			c.Learn(keys)
			all = append(all, keys...)
		}
		o.mu.Lock()
		defer o.mu.Unlock()
		if len(o.evicted)+len(o.rejected) != 0 {
			t.Fatalf("of 48 blocks in 3 of 4 chunks, %d evicted and %d rejected", len(o.evicted), len(o.rejected))
		}
		for i := range all {
			if !c.Holds(&all[i]) {
				t.Fatalf("the policy does not hold learned block %v", all[i])
			}
		}
	})
}
