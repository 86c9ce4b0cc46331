// Package slots owns the bookkeeping both tiers share: a space of bytes cut
// into chunks, each chunk serving one slot size (a chunk moves to another
// size when that size has none), pins that keep a slot alive while a copy
// uses it, and the admission and eviction policy (ristretto's TinyLFU) that
// decides which blocks to keep. It never decides what is cached: that is the
// index's job. It tells its owner, through callbacks, which keys the policy
// wants gone.
package slots

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
)

// SlotID names a slot by its byte offset in the space, in layout.SlotAlign
// units.
type SlotID = uint32

// Offset is the byte offset of slot s in the space.
func Offset(s SlotID) uint64 { return uint64(s) * layout.SlotAlign }

// ErrSlotTooLarge means a block does not fit in one chunk.
var ErrSlotTooLarge = errors.New("block larger than a chunk")

// Config sizes the space and names its owner's callbacks.
type Config struct {
	Name       string // the tier's name, for logs and errors
	Bytes      uint64 // size of the space; rounded down to whole chunks
	ChunkBytes uint64 // 0 picks a default from Bytes
	// Reserve is the fraction of each slot size's slots the policy keeps
	// free, so stores find room while evicted blocks are still being
	// written elsewhere (write-back). 0 in a CPU-only daemon.
	Reserve float64
	Logger  *slog.Logger
	// Evict is called with each key the policy evicted, on the policy's
	// goroutine. The owner removes the key from the index and calls Release
	// on its slot; it must not call Forget or Admit from here.
	Evict func(index.Key)
	// Reject is called with each key the policy declined to admit.
	Reject func(index.Key)
	// EvictRange asks the owner to drop every block whose slot lies in
	// [lo, hi): the tier is giving that chunk to another slot size. The
	// owner releases each slot and forgets each key.
	EvictRange func(lo, hi SlotID)
}

// DefaultChunkBytes is the chunk size for a space of n bytes.
func DefaultChunkBytes(n uint64) uint64 {
	c := min(max(n/16, 4<<20), 256<<20)
	return layout.AlignUp(c)
}

const (
	slotFree uint8 = iota
	slotUsed
	slotReleased    // owner let go; freed when the last pin drops
	slotQuarantined // never reused; counts as used space
)

// chunkSlots is the state of a chunk's slots, kept per slot (not per 4 KiB
// of space: a 4 TiB disk of 2 MiB slots costs 6 MiB of it, not 3 GiB).
type chunkSlots struct {
	pins  []uint16
	state []uint8
}

// slotRef points at one slot's pins and state.
type slotRef struct {
	pins  *uint16
	state *uint8
}

// slotLocked finds slot s in its chunk. The chunk has a slot size.
func (t *Space) slotLocked(s SlotID) slotRef {
	ch := uint64(s) / t.slotsPer
	i := (uint64(s) - ch*t.slotsPer) / (t.mu.slotClass[ch].slotBytes / layout.SlotAlign)
	cs := &t.mu.slots[ch]
	return slotRef{pins: &cs.pins[i], state: &cs.state[i]}
}

// Space is a tier's slots. Its methods are safe for concurrent use.
type Space struct {
	capacity   uint64
	chunkBytes uint64
	slotsPer   uint64 // SlotIDs per chunk
	cfg        Config

	touches        chan touchBatch
	touchesDropped atomic.Uint64
	stop           chan struct{}
	wg             sync.WaitGroup

	mu struct {
		sync.Mutex
		classes     map[uint64]*Class
		freeChunks  []uint32
		chunkOwner  []*Class // nil: free
		draining    []bool
		chunkLive   []uint32
		slots       []chunkSlots // per chunk; empty while the chunk is free
		slotClass   []*Class
		usedBytes   uint64
		blocks      uint64
		quarantined int
	}
}

// Class is the set of chunks serving one slot size, with its own policy.
type Class struct {
	t         *Space
	slotBytes uint64
	perChunk  uint64
	policy    *ristretto.Cache[uint64, index.Key]
	// guarded by t.mu
	free    []SlotID
	chunks  int
	maxCost int64
}

// New returns an empty space. Use Chunks to learn its size before New when
// the memory must be mapped first.
func New(cfg Config) (*Space, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	chunk := cfg.ChunkBytes
	if chunk == 0 {
		chunk = DefaultChunkBytes(cfg.Bytes)
	}
	if chunk%layout.SlotAlign != 0 {
		return nil, fmt.Errorf("chunk size %d is not a multiple of %d", chunk, layout.SlotAlign)
	}
	nChunks := cfg.Bytes / chunk
	if nChunks == 0 {
		return nil, fmt.Errorf("%s tier of %d bytes holds no %d-byte chunk", cfg.Name, cfg.Bytes, chunk)
	}
	if nChunks*chunk/layout.SlotAlign > uint64(^uint32(0)) {
		return nil, fmt.Errorf("%s tier of %d bytes is too large (at most 16TiB)", cfg.Name, cfg.Bytes)
	}
	t := &Space{capacity: nChunks * chunk, chunkBytes: chunk, slotsPer: chunk / layout.SlotAlign, cfg: cfg,
		touches: make(chan touchBatch, 1024), stop: make(chan struct{})}
	t.mu.classes = map[uint64]*Class{}
	t.mu.chunkOwner = make([]*Class, nChunks)
	t.mu.draining = make([]bool, nChunks)
	t.mu.chunkLive = make([]uint32, nChunks)
	t.mu.slots = make([]chunkSlots, nChunks)
	t.mu.slotClass = make([]*Class, nChunks)
	for c := int(nChunks) - 1; c >= 0; c-- {
		t.mu.freeChunks = append(t.mu.freeChunks, uint32(c))
	}
	t.wg.Add(1)
	go t.toucher()
	return t, nil
}

// ChunkBytes is the size of one chunk: the largest slot the tier takes.
func (t *Space) ChunkBytes() uint64 { return t.chunkBytes }

// Capacity is the size of the space in bytes (whole chunks).
func (t *Space) Capacity() uint64 { return t.capacity }

// Usage reports bytes and blocks held in slots.
func (t *Space) Usage() (usedBytes, blocks uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.usedBytes, t.mu.blocks
}

// PolicyKey is the 64-bit key the policy tracks for k: the index's hash.
func (t *Space) PolicyKey(k *index.Key) uint64 { return index.HashKey(k) }

// Class returns the class for slots of slotBytes (a multiple of
// layout.SlotAlign), creating it on first use.
func (t *Space) Class(slotBytes uint64) (*Class, error) {
	if slotBytes == 0 || slotBytes%layout.SlotAlign != 0 {
		return nil, fmt.Errorf("slot size %d is not a positive multiple of %d", slotBytes, layout.SlotAlign)
	}
	if slotBytes > t.chunkBytes {
		return nil, fmt.Errorf("%w: block slot is %d bytes, chunk is %d bytes (raise --%s-chunk-bytes)", ErrSlotTooLarge, slotBytes, t.chunkBytes, t.cfg.Name)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if c, ok := t.mu.classes[slotBytes]; ok {
		return c, nil
	}
	// ristretto refuses a zero capacity; the first grow sets the real one.
	c := &Class{t: t, slotBytes: slotBytes, perChunk: t.chunkBytes / slotBytes, maxCost: 1}
	maxSlots := int64(t.capacity / slotBytes)
	p, err := ristretto.NewCache(&ristretto.Config[uint64, index.Key]{
		// TinyLFU's frequency window: ten times the blocks the class can
		// hold, and never so small that a burst of one-off keys ages the
		// hot set away.
		NumCounters: max(10*maxSlots, 1<<14),
		MaxCost:     1,
		// ristretto gathers accesses in pooled buffers of this many
		// before they reach its sketch; the toucher pads each batch to
		// whole buffers (see record) so a block looked up just before
		// its store does not look colder than the blocks looked up
		// before it. The frequency stays an estimate: ristretto drops a
		// buffer when its policy goroutine lags.
		BufferItems:        touchBuffer,
		IgnoreInternalCost: true,
		OnEvict: func(it *ristretto.Item[index.Key]) {
			if t.cfg.Evict != nil {
				t.cfg.Evict(it.Value)
			}
		},
		OnReject: func(it *ristretto.Item[index.Key]) {
			if t.cfg.Reject != nil {
				t.cfg.Reject(it.Value)
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("admission policy: %w", err)
	}
	c.policy = p
	t.mu.classes[slotBytes] = c
	return c, nil
}

// SlotBytes is the slot size of the class.
func (c *Class) SlotBytes() uint64 { return c.slotBytes }

// Touch records accesses (lookups, hit or miss) to the keys whose
// PolicyKeys are hs, for the policy's frequency estimate. It does not wait:
// the accesses reach the policy from the space's toucher goroutine, and are
// dropped (and counted) if it falls behind. Recording accesses is lossy in
// ristretto too; this keeps its cost off the Lookup's latency. Touch takes
// ownership of hs.
func (c *Class) Touch(hs []uint64) {
	if len(hs) == 0 {
		return
	}
	select {
	case c.t.touches <- touchBatch{c: c, hs: hs}:
	default:
		c.t.touchesDropped.Add(uint64(len(hs)))
	}
}

type touchBatch struct {
	c  *Class
	hs []uint64
}

// touchBuffer is ristretto's BufferItems for every class.
const touchBuffer = 16

// touchPad is the policy key the toucher pads batches with. It is never a
// block's (a block key hashing to it only shares a frequency counter).
const touchPad = 0x9e3779b97f4a7c15

// toucher feeds accesses to the policies until the space closes.
func (t *Space) toucher() {
	defer t.wg.Done()
	for {
		select {
		case b := <-t.touches:
			b.record()
		case <-t.stop:
			return
		}
	}
}

// record hands a batch's accesses to the class's policy, padded to a whole
// number of ristretto's buffers so the last ones are not left waiting in a
// half-full buffer (they would miss the next admission decision).
func (b touchBatch) record() {
	for _, h := range b.hs {
		b.c.policy.Get(h)
	}
	for i := len(b.hs) % touchBuffer; i != 0 && i < touchBuffer; i++ {
		b.c.policy.Get(touchPad)
	}
}

// drainTouches records the queued accesses on the caller's goroutine.
func (t *Space) drainTouches() {
	for {
		select {
		case b := <-t.touches:
			b.record()
		default:
			return
		}
	}
}

// TouchesDropped counts accesses not recorded because the toucher lagged.
func (t *Space) TouchesDropped() uint64 { return t.touchesDropped.Load() }

// Admit offers new keys to the policy, which may evict others (Evict) or
// decline some (Reject) before Admit returns. Call it without holding any
// index lock.
func (c *Class) Admit(keys []index.Key) {
	if len(keys) == 0 {
		return
	}
	// Accesses still queued count before the admission decision: a
	// block looked up just before its store must not look colder than it is.
	c.t.drainTouches()
	c.grow(len(keys))
	for i := range keys {
		if !c.policy.Set(c.t.PolicyKey(&keys[i]), keys[i], 1) && c.t.cfg.Reject != nil {
			c.t.cfg.Reject(keys[i])
		}
	}
	c.policy.Wait()
}

// Forget removes k from the policy after its owner dropped it for a reason
// of its own (failure, invalidation). Call it without holding any index lock.
func (c *Class) Forget(k *index.Key) { c.policy.Del(c.t.PolicyKey(k)) }

// Alloc takes a free slot for a block being written. The slot starts with
// one pin, the writer's; Unpin it when the write has drained.
func (c *Class) Alloc() (SlotID, bool) {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	var s SlotID
	for {
		n := len(c.free)
		if n == 0 {
			return index.NoSlot, false
		}
		s = c.free[n-1]
		c.free = c.free[:n-1]
		// Restore may have taken a slot still on the free list.
		if *t.slotLocked(s).state == slotFree {
			break
		}
	}
	*t.slotLocked(s).state = slotUsed
	*t.slotLocked(s).pins = 1
	t.mu.chunkLive[uint64(s)/t.slotsPer]++
	t.mu.usedBytes += c.slotBytes
	t.mu.blocks++
	return s, true
}

// grow gives the class chunks until it has n free slots or no chunk is left,
// taking one from another slot size when the class has none at all.
func (c *Class) grow(n int) {
	t := c.t
	t.mu.Lock()
	before := c.maxCost
	for len(c.free) < n && len(t.mu.freeChunks) > 0 {
		k := len(t.mu.freeChunks) - 1
		ch := t.mu.freeChunks[k]
		t.mu.freeChunks = t.mu.freeChunks[:k]
		c.addChunkLocked(ch)
	}
	var steal = -1
	if c.chunks == 0 {
		steal = t.pickDonorLocked(c)
	}
	after := c.maxCost
	t.mu.Unlock()
	if after != before {
		c.policy.UpdateMaxCost(after)
	}
	if steal >= 0 {
		t.drainChunk(uint32(steal))
		t.mu.Lock()
		if len(t.mu.freeChunks) > 0 && c.chunks == 0 {
			k := len(t.mu.freeChunks) - 1
			ch := t.mu.freeChunks[k]
			t.mu.freeChunks = t.mu.freeChunks[:k]
			c.addChunkLocked(ch)
		}
		after = c.maxCost
		t.mu.Unlock()
		c.policy.UpdateMaxCost(after)
	}
}

func (c *Class) addChunkLocked(ch uint32) {
	t := c.t
	t.mu.chunkOwner[ch] = c
	t.mu.slotClass[ch] = c
	t.mu.slots[ch] = chunkSlots{pins: make([]uint16, c.perChunk), state: make([]uint8, c.perChunk)}
	base := uint64(ch) * t.slotsPer
	step := c.slotBytes / layout.SlotAlign
	for i := int(c.perChunk) - 1; i >= 0; i-- {
		c.free = append(c.free, SlotID(base+uint64(i)*step))
	}
	c.chunks++
	c.setMaxCostLocked()
}

func (c *Class) setMaxCostLocked() {
	slots := int64(uint64(c.chunks) * c.perChunk)
	reserve := int64(float64(slots) * c.t.cfg.Reserve)
	c.maxCost = max(slots-reserve, min(slots, 1))
}

// pickDonorLocked chooses a chunk to take from the class with the most
// chunks (it keeps at least one), preferring the chunk with fewest live slots.
func (t *Space) pickDonorLocked(needy *Class) int {
	var donor *Class
	for _, c := range t.mu.classes {
		if c != needy && c.chunks > 1 && (donor == nil || c.chunks > donor.chunks) {
			donor = c
		}
	}
	if donor == nil {
		return -1
	}
	best := -1
	for ch, o := range t.mu.chunkOwner {
		if o == donor && !t.mu.draining[ch] && (best < 0 || t.mu.chunkLive[ch] < t.mu.chunkLive[best]) {
			best = ch
		}
	}
	if best < 0 {
		return -1
	}
	t.mu.draining[best] = true
	t.mu.chunkOwner[best] = nil
	donor.chunks--
	donor.setMaxCostLocked()
	lo, hi := SlotID(uint64(best)*t.slotsPer), SlotID(uint64(best+1)*t.slotsPer)
	kept := donor.free[:0]
	for _, s := range donor.free {
		if s < lo || s >= hi {
			kept = append(kept, s)
		}
	}
	donor.free = kept
	t.cfg.Logger.Info("moving a chunk between block sizes", "tier", t.cfg.Name, "chunk", best, "from_slot_bytes", donor.slotBytes)
	return best
}

func (t *Space) drainChunk(ch uint32) {
	t.mu.Lock()
	donor := t.mu.slotClass[ch]
	t.mu.Unlock()
	donor.policy.UpdateMaxCost(donor.maxCostSnapshot())
	lo, hi := SlotID(uint64(ch)*t.slotsPer), SlotID(uint64(ch+1)*t.slotsPer)
	if t.cfg.EvictRange != nil {
		t.cfg.EvictRange(lo, hi)
	}
	t.mu.Lock()
	t.maybeFreeChunkLocked(ch)
	t.mu.Unlock()
}

func (c *Class) maxCostSnapshot() int64 {
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	return c.maxCost
}

func (t *Space) maybeFreeChunkLocked(ch uint32) {
	if t.mu.draining[ch] && t.mu.chunkLive[ch] == 0 {
		t.mu.draining[ch] = false
		t.mu.slotClass[ch] = nil
		t.mu.slots[ch] = chunkSlots{}
		t.mu.freeChunks = append(t.mu.freeChunks, ch)
	}
}

// Restore marks slot s, found holding key k when the tier's storage was
// scanned at start, as in use by this class, and tells the policy about k.
// Call it before the first Alloc. The slot has no pins.
func (c *Class) Restore(s SlotID, k index.Key) error {
	t := c.t
	t.mu.Lock()
	ch := uint64(s) / t.slotsPer
	if ch >= uint64(len(t.mu.chunkOwner)) {
		t.mu.Unlock()
		return fmt.Errorf("restore: slot %d is beyond the %s tier", s, t.cfg.Name)
	}
	base := ch * t.slotsPer
	step := c.slotBytes / layout.SlotAlign
	if (uint64(s)-base)%step != 0 || (uint64(s)-base)/step >= c.perChunk {
		t.mu.Unlock()
		return fmt.Errorf("restore: slot %d is not a %d-byte slot boundary", s, c.slotBytes)
	}
	switch owner := t.mu.chunkOwner[ch]; {
	case owner == nil:
		for i, f := range t.mu.freeChunks {
			if uint64(f) == ch {
				t.mu.freeChunks = append(t.mu.freeChunks[:i], t.mu.freeChunks[i+1:]...)
				break
			}
		}
		c.addChunkLocked(uint32(ch))
	case owner != c:
		t.mu.Unlock()
		return fmt.Errorf("restore: slot %d lies in a chunk of %d-byte slots, not %d", s, owner.slotBytes, c.slotBytes)
	}
	if *t.slotLocked(s).state != slotFree {
		t.mu.Unlock()
		return fmt.Errorf("restore: slot %d restored twice", s)
	}
	*t.slotLocked(s).state = slotUsed
	t.mu.chunkLive[ch]++
	t.mu.usedBytes += c.slotBytes
	t.mu.blocks++
	maxCost := c.maxCost
	t.mu.Unlock()
	c.policy.UpdateMaxCost(maxCost)
	c.policy.Set(t.PolicyKey(&k), k, 1)
	c.policy.Wait()
	return nil
}

// ChunkOf reports the chunk of slot s and the slot size that chunk serves
// (0 when free).
func (t *Space) ChunkOf(s SlotID) (chunk uint32, slotBytes uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ch := uint64(s) / t.slotsPer
	if c := t.mu.slotClass[ch]; c != nil {
		return uint32(ch), c.slotBytes
	}
	return uint32(ch), 0
}

// Quarantine takes slot s out of use for good (its storage returned an I/O
// error). The caller removed the index entry naming s; the slot's pins
// still drop as usual but it never returns to a free list.
func (t *Space) Quarantine(s SlotID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if *t.slotLocked(s).state != slotUsed {
		panic(fmt.Sprintf("slots: quarantine of slot %d in state %d", s, *t.slotLocked(s).state))
	}
	*t.slotLocked(s).state = slotQuarantined
	t.mu.quarantined++
}

// Quarantined counts slots taken out of use.
func (t *Space) Quarantined() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.quarantined
}

// Pin keeps slot s from being reused until Unpin. The caller holds the
// index entry that names s, so s is in use.
func (t *Space) Pin(s SlotID) {
	t.mu.Lock()
	if *t.slotLocked(s).state != slotUsed {
		t.mu.Unlock()
		panic(fmt.Sprintf("slots: pin of slot %d in state %d", s, *t.slotLocked(s).state))
	}
	*t.slotLocked(s).pins++
	t.mu.Unlock()
}

// Unpin drops a pin; the slot is freed if its owner already released it.
func (t *Space) Unpin(s SlotID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if *t.slotLocked(s).pins == 0 {
		panic(fmt.Sprintf("slots: unpin of unpinned slot %d", s))
	}
	*t.slotLocked(s).pins--
	if *t.slotLocked(s).pins == 0 && *t.slotLocked(s).state == slotReleased {
		t.freeLocked(s)
	}
}

// Release is called once by whoever removed the index entry naming s. The
// slot is freed now, or when its last pin drops.
func (t *Space) Release(s SlotID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if *t.slotLocked(s).state != slotUsed {
		panic(fmt.Sprintf("slots: release of slot %d in state %d", s, *t.slotLocked(s).state))
	}
	if *t.slotLocked(s).pins > 0 {
		*t.slotLocked(s).state = slotReleased
		return
	}
	t.freeLocked(s)
}

func (t *Space) freeLocked(s SlotID) {
	ch := uint64(s) / t.slotsPer
	c := t.mu.slotClass[ch]
	*t.slotLocked(s).state = slotFree
	t.mu.chunkLive[ch]--
	t.mu.usedBytes -= c.slotBytes
	t.mu.blocks--
	if t.mu.draining[ch] {
		t.maybeFreeChunkLocked(uint32(ch))
		return
	}
	c.free = append(c.free, s)
}

// Pinned counts slots with pins, for leak checks and metrics.
func (t *Space) Pinned() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, cs := range t.mu.slots {
		for _, p := range cs.pins {
			if p > 0 {
				n++
			}
		}
	}
	return n
}

// Close stops the toucher and the policies. No copy may be in flight.
func (t *Space) Close() {
	select {
	case <-t.stop:
		return
	default:
	}
	close(t.stop)
	t.wg.Wait()
	t.mu.Lock()
	classes := t.mu.classes
	t.mu.classes = nil
	t.mu.Unlock()
	for _, c := range classes {
		c.policy.Close()
	}
}
