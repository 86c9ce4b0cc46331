package disk

import (
	"sync"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// seqTable remembers, per slot, the write (epoch<<32 | seq) the tier last
// completed there, so a Read can tell the slot's current block from an
// older one with the same key. 0 means no good write: never written, or
// the last write failed or is in flight. It lives here and not in the
// index so the index stays tier-agnostic. Slots are counted per chunk at
// the chunk's slot size, so a table costs 8 bytes per slot, not per 4 KiB,
// and a chunk's table is only allocated once the chunk is written.
type seqTable struct {
	mu         sync.Mutex
	chunkUnits uint64 // SlotIDs per chunk
	chunkBytes uint64
	chunks     []seqChunk
}

type seqChunk struct {
	slotBytes uint64
	w         []uint64
}

func (st *seqTable) init(capacity, chunkBytes uint64) {
	st.chunkBytes = chunkBytes
	st.chunkUnits = chunkBytes / layout.SlotAlign
	st.chunks = make([]seqChunk, capacity/chunkBytes)
}

// ordinal is the index of slot s among the slotBytes slots of its chunk.
// ok is false when s is not the start of such a slot.
func (st *seqTable) ordinal(s slots.SlotID, slotBytes uint64) (ch, ord uint64, ok bool) {
	ch = uint64(s) / st.chunkUnits
	within := (uint64(s) - ch*st.chunkUnits) * layout.SlotAlign
	if slotBytes == 0 || ch >= uint64(len(st.chunks)) || within%slotBytes != 0 || within/slotBytes >= st.chunkBytes/slotBytes {
		return 0, 0, false
	}
	return ch, within / slotBytes, true
}

// set records w for slot s, a slot of a chunk of slotBytes slots.
func (st *seqTable) set(s slots.SlotID, slotBytes, w uint64) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.setLocked(s, slotBytes, w)
}

func (st *seqTable) setLocked(s slots.SlotID, slotBytes, w uint64) {
	ch, ord, ok := st.ordinal(s, slotBytes)
	if !ok {
		return
	}
	c := &st.chunks[ch]
	if c.slotBytes != slotBytes {
		if w == 0 {
			return
		}
		*c = seqChunk{slotBytes: slotBytes, w: make([]uint64, st.chunkBytes/slotBytes)}
	}
	c.w[ord] = w
}

// setMany is set for each of ss with ws, under one lock (recovery sets a
// chunk's worth at once).
func (st *seqTable) setMany(ss []slots.SlotID, slotBytes uint64, ws []uint64) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for i, s := range ss {
		st.setLocked(s, slotBytes, ws[i])
	}
}

// get returns what set recorded for s at slotBytes, 0 if nothing.
func (st *seqTable) get(s slots.SlotID, slotBytes uint64) uint64 {
	ch, ord, ok := st.ordinal(s, slotBytes)
	if !ok {
		return 0
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if c := &st.chunks[ch]; c.slotBytes == slotBytes {
		return c.w[ord]
	}
	return 0
}

// clearAny forgets s whatever the slot size of its chunk.
func (st *seqTable) clearAny(s slots.SlotID) {
	ch := uint64(s) / st.chunkUnits
	st.mu.Lock()
	defer st.mu.Unlock()
	if ch >= uint64(len(st.chunks)) || st.chunks[ch].slotBytes == 0 {
		return
	}
	sb := st.chunks[ch].slotBytes
	if within := (uint64(s) - ch*st.chunkUnits) * layout.SlotAlign; within%sb == 0 && within/sb < uint64(len(st.chunks[ch].w)) {
		st.chunks[ch].w[within/sb] = 0
	}
}
