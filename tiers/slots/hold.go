package slots

import (
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
)

// Chunks held for the owner's recovery. A tier whose storage outlives the
// daemon (the disk tier) starts serving before it has looked at what its
// chunks hold: it holds those chunks, so no Alloc hands out a slot whose
// old block recovery has not seen yet, and gives each one back as its
// scan ends: to the class of the blocks found there (Adopt), or to the
// free chunks (Unhold).

// Hold takes free chunks out of use until Adopt or Unhold. Call it before
// the first Alloc that could take them.
func (t *Space) Hold(chunks []uint32) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	hold := make(map[uint32]bool, len(chunks))
	for _, ch := range chunks {
		if int(ch) >= len(t.mu.chunkOwner) || t.mu.slotClass[ch] != nil || t.mu.draining[ch] || t.mu.held[ch] || hold[ch] {
			return fmt.Errorf("hold: chunk %d of the %s tier is not a free chunk", ch, t.cfg.Name)
		}
		hold[ch] = true
	}
	kept := t.mu.freeChunks[:0]
	for _, ch := range t.mu.freeChunks {
		if !hold[ch] {
			kept = append(kept, ch)
		}
	}
	if len(t.mu.freeChunks)-len(kept) != len(hold) {
		return fmt.Errorf("hold: %d of %d chunks of the %s tier are not free", len(hold)-(len(t.mu.freeChunks)-len(kept)), len(hold), t.cfg.Name)
	}
	t.mu.freeChunks = kept
	for ch := range hold {
		t.mu.held[ch] = true
	}
	return nil
}

// Unhold gives a held chunk back to the free chunks: its scan found
// nothing to keep there.
func (t *Space) Unhold(ch uint32) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if int(ch) >= len(t.mu.held) || !t.mu.held[ch] {
		return fmt.Errorf("unhold: chunk %d of the %s tier is not held", ch, t.cfg.Name)
	}
	t.mu.held[ch] = false
	t.mu.freeChunks = append(t.mu.freeChunks, ch)
	return nil
}

// Adopt gives held chunk ch to the class with the slots in used in use
// (owned, no pins: the owner files their blocks in its index next, and
// Releases any it does not keep); the chunk's other slots are free. Tell
// the policy about the blocks kept with Learn.
func (c *Class) Adopt(ch uint32, used []SlotID) error {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if int(ch) >= len(t.mu.held) || !t.mu.held[ch] {
		return fmt.Errorf("adopt: chunk %d of the %s tier is not held", ch, t.cfg.Name)
	}
	if c.removed {
		return fmt.Errorf("adopt: the %d-byte class of the %s tier is gone", c.slotBytes, t.cfg.Name)
	}
	base := uint64(ch) * t.slotsPer
	step := c.slotBytes / layout.SlotAlign
	take := make(map[SlotID]bool, len(used))
	for _, s := range used {
		off := uint64(s) - base
		if uint64(s) < base || off%step != 0 || off/step >= c.perChunk || take[s] {
			return fmt.Errorf("adopt: slot %d is not a distinct %d-byte slot of chunk %d", s, c.slotBytes, ch)
		}
		take[s] = true
	}
	t.mu.held[ch] = false
	n := len(c.free)
	c.addChunkLocked(ch)
	kept := c.free[:n]
	for _, s := range c.free[n:] {
		if !take[s] {
			kept = append(kept, s)
			continue
		}
		_, st := t.slotLocked(s)
		*st = slotUsed
		t.mu.chunkLive[ch]++
		c.live++
		t.mu.usedBytes += c.slotBytes
		t.mu.blocks++
	}
	c.free = kept
	return nil
}

// Learn tells the policy about keys whose blocks the owner keeps in slots
// Adopt took, so it evicts them like any other. It waits until the policy
// has them. Call it after the keys are in the owner's index (the policy's
// Evict callback must find them) and without holding any index lock.
//
// Like Admit, it first gives the class free chunks while the policy would
// hold more than the class's capacity less its reserve: a chunk Adopt took
// full of blocks is over its capacity by the reserve, and without a free
// chunk to make up for it the policy evicted that many of the blocks just
// recovered although the tier had room.
func (c *Class) Learn(keys []index.Key) {
	if len(keys) == 0 {
		return
	}
	c.pmu.RLock()
	defer c.pmu.RUnlock()
	if c.retired.Load() {
		return
	}
	hs := make([]uint64, len(keys))
	for i := range keys {
		hs[i] = c.t.PolicyKey(&keys[i])
	}
	c.amu.Lock()
	defer c.amu.Unlock()
	c.growForLearn(len(keys))
	c.policy.learn(keys, hs)
}

// growForLearn is grow for n keys whose blocks already have their slots:
// only the policy's capacity counts, not the free slots. The caller holds
// c.amu.
func (c *Class) growForLearn(n int) {
	held := c.policy.size()
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	for held+int64(n) > c.maxCost && len(t.mu.freeChunks) > 0 && !c.removed {
		c.addChunkLocked(t.popFreeChunkLocked())
	}
}

// Held counts chunks held for recovery.
func (t *Space) Held() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, h := range t.mu.held {
		if h {
			n++
		}
	}
	return n
}
