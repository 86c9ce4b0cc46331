package slots

import (
	"errors"
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/layout"
)

// Audit checks the space's bookkeeping against itself and against what its
// owner expects, walking every slot: it is for tests and invariant checks,
// not for hot paths. named maps each slot the owner's index names to the
// class it was allocated from; pins maps slots to the pins the owner holds
// on them (absent: none). With nothing in flight, a slot is used exactly
// when it is named, released only while pinned, and every count (used
// bytes, blocks, pins, quarantined, per chunk and per class, the free
// lists, the policy capacities) agrees with the slots' states.
func (t *Space) Audit(named map[SlotID]*Class, pins map[SlotID]uint32) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	fail := func(format string, args ...any) {
		if len(errs) < 20 {
			errs = append(errs, fmt.Errorf("%s tier: "+format, append([]any{t.cfg.Name}, args...)...))
		}
	}
	var used, blocks uint64
	quarantined, pinned := 0, 0
	live := map[*Class]int{}
	held := map[*Class]int{}
	chunks := map[*Class]int{}
	freeSlots := map[*Class]map[SlotID]bool{}
	seen := map[SlotID]bool{}
	inFreeList := map[uint32]int{}
	for _, ch := range t.mu.freeChunks {
		inFreeList[ch]++
	}
	for ch := range t.mu.slots {
		c := t.mu.slotClass[ch]
		owner := t.mu.chunkOwner[ch]
		if c == nil {
			// A free chunk is on the free list once; one held for the
			// owner's recovery (Hold) on none.
			want := 1
			if t.mu.held[ch] {
				want = 0
			}
			if owner != nil || t.mu.draining[ch] || t.mu.chunkLive[ch] != 0 || t.mu.chunkHeld[ch] != 0 || inFreeList[uint32(ch)] != want {
				fail("free chunk %d: owner %v, draining %v, live %d, held %d, held for recovery %v, on the free list %d times", ch, owner != nil, t.mu.draining[ch], t.mu.chunkLive[ch], t.mu.chunkHeld[ch], t.mu.held[ch], inFreeList[uint32(ch)])
			}
			continue
		}
		if t.mu.held[ch] {
			fail("chunk %d of %d-byte slots is still held for recovery", ch, c.slotBytes)
		}
		if inFreeList[uint32(ch)] != 0 || (owner == nil) != t.mu.draining[ch] || (owner != nil && owner != c) {
			fail("chunk %d of %d-byte slots: on the free list %d times, draining %v, owned by another class %v", ch, c.slotBytes, inFreeList[uint32(ch)], t.mu.draining[ch], owner != nil && owner != c)
		}
		if c.removed {
			fail("chunk %d belongs to a removed %d-byte class", ch, c.slotBytes)
		}
		if owner != nil {
			chunks[c]++
		}
		cs := t.mu.slots[ch]
		step := c.slotBytes / layout.SlotAlign
		var chLive, chHeld uint32
		for i := range cs.state {
			s := SlotID(uint64(ch)*t.slotsPer + uint64(i)*step)
			seen[s] = true
			st, p := cs.state[i], cs.pins[i]
			if p > 0 {
				pinned++
			}
			if want := pins[s]; p != want {
				fail("slot %d has %d pins, the owner holds %d", s, p, want)
			}
			nc, isNamed := named[s]
			switch st {
			case slotFree:
				if isNamed || p != 0 {
					fail("free slot %d: named %v, %d pins", s, isNamed, p)
				}
				if owner != nil {
					if freeSlots[c] == nil {
						freeSlots[c] = map[SlotID]bool{}
					}
					freeSlots[c][s] = true
				}
			case slotUsed:
				used += c.slotBytes
				blocks++
				chLive++
				if !isNamed {
					fail("slot %d is in use but the owner names it nowhere (a leak)", s)
				} else if nc != c {
					fail("slot %d is a %d-byte slot, named as one of %d bytes", s, c.slotBytes, nc.slotBytes)
				}
			case slotReleased, slotVoid:
				used += c.slotBytes
				blocks++
				chLive++
				chHeld++
				if isNamed || p == 0 {
					fail("released slot %d (void %v): named %v, %d pins", s, st == slotVoid, isNamed, p)
				}
			case slotQuarantined:
				used += c.slotBytes
				blocks++
				quarantined++
				chHeld++
				if p > 0 {
					chLive++
				}
				if isNamed {
					fail("quarantined slot %d is named by the owner", s)
				}
			}
		}
		if chLive != t.mu.chunkLive[ch] || chHeld != t.mu.chunkHeld[ch] {
			fail("chunk %d: %d live and %d held slots, counted %d and %d", ch, chLive, chHeld, t.mu.chunkLive[ch], t.mu.chunkHeld[ch])
		}
		live[c] += int(chLive)
		if owner != nil {
			held[c] += int(chHeld)
		}
	}
	for s := range named {
		if !seen[s] {
			fail("the owner names slot %d, which is no slot of a carved chunk", s)
		}
	}
	for s := range pins {
		if !seen[s] {
			fail("the owner pins slot %d, which is no slot of a carved chunk", s)
		}
	}
	if used != t.mu.usedBytes || blocks != t.mu.blocks || quarantined != t.mu.quarantined || pinned != t.mu.pinned {
		fail("counted %d bytes, %d blocks, %d quarantined, %d pinned; the slots say %d, %d, %d, %d",
			t.mu.usedBytes, t.mu.blocks, t.mu.quarantined, t.mu.pinned, used, blocks, quarantined, pinned)
	}
	var counters int64
	for size, c := range t.mu.classes {
		counters += c.counters
		if c.slotBytes != size || c.removed || c.refs < 0 {
			fail("class of %d-byte slots filed under %d, removed %v, %d refs", c.slotBytes, size, c.removed, c.refs)
		}
		if c.live != live[c] || c.held != held[c] || c.chunks != chunks[c] {
			fail("%d-byte class: %d live, %d held, %d chunks; its chunks say %d, %d, %d", size, c.live, c.held, c.chunks, live[c], held[c], chunks[c])
		}
		if c.refs == 0 && c.live == 0 {
			fail("%d-byte class outlived its last user", size)
		}
		onList := map[SlotID]bool{}
		for _, s := range c.free {
			ch := uint64(s) / t.slotsPer
			if t.mu.chunkOwner[ch] != c {
				fail("%d-byte class lists slot %d of a chunk it does not own", size, s)
				continue
			}
			// A freed slot may be listed again: Alloc checks each.
			onList[s] = true
		}
		for s := range freeSlots[c] {
			if !onList[s] {
				fail("free slot %d is on no free list (lost)", s)
			}
		}
		wantCost := c.maxCost
		c.setMaxCostLocked()
		if c.maxCost != wantCost {
			fail("%d-byte class: policy capacity %d, its slots say %d", size, wantCost, c.maxCost)
		}
	}
	if counters != t.mu.counters {
		fail("policy counters: %d counted, classes hold %d", t.mu.counters, counters)
	}
	return errors.Join(errs...)
}

// Refs reports how many references to the class its users hold.
func (c *Class) Refs() int {
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	return c.refs
}
