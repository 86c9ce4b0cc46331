// Package slots owns the bookkeeping both tiers share: a space of bytes cut
// into chunks, each chunk serving one slot size (a chunk moves to another
// size when that size has none), pins that keep a slot alive while a copy
// uses it, and the admission and eviction policy (a segmented LRU, or
// TinyLFU after ristretto's; policy.go, tinylfu.go) that decides which
// blocks to keep. It never decides what is cached: that is the index's job.
// It tells its owner, through callbacks, which keys the policy wants gone.
//
// Everything a client can make it hold is bounded by the space: slot sizes
// (classes) by the number of chunks, each class's policy by a share of a
// budget sized from the space, pins per slot by MaxPins. A class lives while
// its owner holds a reference (Class, Drop) or any of its slots is in use.
package slots

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
)

// SlotID names a slot by its byte offset in the space, in layout.SlotAlign
// units.
type SlotID = uint32

// Offset is the byte offset of slot s in the space.
func Offset(s SlotID) uint64 { return uint64(s) * layout.SlotAlign }

// MaxPins is the most pins one slot takes; Pin refuses the next. The
// owner's own bounds (leases, jobs) keep real counts far below it: this
// makes a wrapped count impossible rather than unlikely.
const MaxPins = math.MaxUint32

var (
	// ErrSlotTooLarge means a block does not fit in one chunk.
	ErrSlotTooLarge = errors.New("block larger than a chunk")
	// ErrTooManyClasses means the space already serves as many slot sizes
	// as it has chunks (or Config.MaxClasses): a new size could get no
	// chunk of its own, and each size costs a policy.
	ErrTooManyClasses = errors.New("too many block sizes")
	// ErrClosed means the space was closed.
	ErrClosed = errors.New("slot space closed")
)

// Config sizes the space and names its owner's callbacks.
type Config struct {
	Name       string // the tier's name, for logs and errors
	Bytes      uint64 // size of the space; rounded down to whole chunks
	ChunkBytes uint64 // 0 picks a default from Bytes
	// Reserve is the fraction of each slot size's slots the policy keeps
	// free, so stores find room while evicted blocks are still being
	// written elsewhere (write-back). 0 in a CPU-only daemon. Any
	// fraction above 0 keeps at least one slot.
	Reserve float64
	// Staging is the fraction of each slot size's slots (part of the
	// reserve) that Alloc leaves free and only AllocStaging takes: disk
	// reads and remote fetches stage blocks there, so a burst of stores
	// that takes every other free slot does not fail the loads that need
	// one. 0 keeps none; any fraction above 0 keeps at least one slot.
	Staging float64
	// MaxClasses bounds the slot sizes served at once; 0 (or more than
	// the chunks) means one per chunk.
	MaxClasses int
	Logger     *slog.Logger
	// Policy is each class's admission and eviction policy (SLRU or
	// TinyLFU; empty means SLRU).
	Policy Policy
	// Evict is called with each key the policy evicted, before the Admit
	// (or Learn) that made room returns, on its goroutine, holding no lock
	// of the policy's. The owner removes the key from the index and calls
	// Release on its slot; it must not call Forget or Admit from here. It
	// is not called once the space or the class is closing.
	Evict func(index.Key)
	// Keys appends to into the keys of the owner's index whose PolicyKey
	// is h (index.Index.KeysOf): one, or none once the owner dropped it,
	// or more for a collision of 64-bit hashes, which the policy counts
	// as one block. The policies keep only the 8-byte PolicyKey of a
	// block, not its 40-byte key: Evict gets the keys Keys finds.
	// Required with Evict. Called without any lock of the space's.
	Keys func(h uint64, into []index.Key) []index.Key
	// Reject is called with each key the policy declined to admit.
	Reject func(index.Key)
	// EvictRange asks the owner to drop every block whose slot lies in
	// [lo, hi): the tier is giving that chunk to another slot size. The
	// owner releases each slot and forgets each key.
	EvictRange func(lo, hi SlotID)
	// Released, when set, is called with each slot its owner lets go of
	// (Release, a ReleaseIdle that released, Void, Quarantine of a slot
	// in use), under the space's lock and before the slot can be handed
	// out again: a tier whose slots outlive the daemon (the CPU tier's
	// persistent arena) invalidates the slot's record there. It must not
	// block or call back into the space.
	Released func(SlotID)
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
	slotQuarantined // never reused while the chunk keeps this slot size; counts as used space
	slotVoid        // owner let go and its bytes must be erased: erased, then freed, when the last pin drops (void.go)
)

// Policy sizing. TinyLFU wants about ten counters per block the class can
// hold; the counters of all classes together stay within
// countersPerSlot × (the space's bytes / SlotAlign), what one class of the
// smallest blocks would need, and no class gets fewer than minCounters.
const (
	countersPerSlot = 10
	minCounters     = 1 << 14
)

// chunkSlots is the state of a chunk's slots, kept per slot (not per 4 KiB
// of space: a 4 TiB disk of 2 MiB slots costs 10 MiB of it, not 3 GiB).
type chunkSlots struct {
	pins  []uint32
	state []uint8
}

// span is a byte range within a chunk.
type span struct{ lo, hi uint64 }

// Space is a tier's slots. Its methods are safe for concurrent use.
type Space struct {
	capacity      uint64
	chunkBytes    uint64
	slotsPer      uint64 // SlotIDs per chunk
	maxClasses    int
	counterBudget int64
	cfg           Config

	touches        chan touchBatch
	touchesDropped atomic.Uint64
	retire         chan struct{} // wakes the worker: classes to close
	stop           chan struct{}
	closing        atomic.Bool
	wg             sync.WaitGroup

	mu struct {
		sync.Mutex
		classes    map[uint64]*Class
		retired    []*Class // removed; their policies wait for the worker
		freeChunks []uint32
		chunkOwner []*Class // nil: free or draining
		draining   []bool
		held       []bool // for the owner's recovery (Hold)
		// chunkLive counts the chunk's slots someone may still name:
		// used, released (pinned), quarantined while pinned. A draining
		// chunk is freed when it reaches 0.
		chunkLive []uint32
		// chunkHeld counts slots that take room without holding a block
		// the policy knows: released but pinned, and quarantined.
		chunkHeld   []uint32
		slots       []chunkSlots // per chunk; empty while the chunk is free
		slotClass   []*Class
		bad         [][]span // per chunk: quarantined byte ranges, kept across slot sizes
		usedBytes   uint64
		blocks      uint64
		quarantined int
		pinned      int // slots with at least one pin
		counters    int64
		closed      bool
		eraser      func(SlotID) // see SetEraser
	}
}

// Class is the set of chunks serving one slot size, with its own policy.
type Class struct {
	t         *Space
	slotBytes uint64
	perChunk  uint64
	counters  int64
	policy    policy
	// retired is set when the class is removed: its policy's callbacks
	// stop reaching the owner, and the worker closes it.
	retired atomic.Bool
	// pmu orders every use of the policy (read-locked) with closing it:
	// a policy must not be used while it closes. A user that lost the
	// race to a removal finds retired set and does nothing.
	pmu sync.RWMutex
	// amu orders the class's admissions (Admit, Grow, Learn): each one
	// grows the class for the keys the policy holds already, those of
	// the admissions before it whose stores have not taken their slots
	// yet included.
	amu sync.Mutex
	// forgets counts Forget calls (Forgets).
	forgets atomic.Uint64

	// guarded by t.mu
	free    []SlotID
	chunks  int
	live    int // slots of its chunks (draining ones too) someone may name
	held    int // chunkHeld of the chunks it owns
	refs    int
	maxCost int64
	keep    int // free slots Alloc leaves for AllocStaging
	removed bool
}

// New returns an empty space. Use Chunks to learn its size before New when
// the memory must be mapped first.
func New(cfg Config) (*Space, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Evict != nil && cfg.Keys == nil {
		return nil, fmt.Errorf("%s tier: an Evict callback needs Keys", cfg.Name)
	}
	if cfg.Policy != "" {
		if _, err := ParsePolicy(string(cfg.Policy)); err != nil {
			return nil, err
		}
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
	maxClasses := int(nChunks)
	if cfg.MaxClasses > 0 && cfg.MaxClasses < maxClasses {
		maxClasses = cfg.MaxClasses
	}
	t := &Space{capacity: nChunks * chunk, chunkBytes: chunk, slotsPer: chunk / layout.SlotAlign, maxClasses: maxClasses, cfg: cfg,
		touches: make(chan touchBatch, 1024), retire: make(chan struct{}, 1), stop: make(chan struct{})}
	t.counterBudget = countersPerSlot * int64(t.capacity/layout.SlotAlign)
	t.mu.classes = map[uint64]*Class{}
	t.mu.chunkOwner = make([]*Class, nChunks)
	t.mu.draining = make([]bool, nChunks)
	t.mu.held = make([]bool, nChunks)
	t.mu.chunkLive = make([]uint32, nChunks)
	t.mu.chunkHeld = make([]uint32, nChunks)
	t.mu.slots = make([]chunkSlots, nChunks)
	t.mu.slotClass = make([]*Class, nChunks)
	t.mu.bad = make([][]span, nChunks)
	for c := int(nChunks) - 1; c >= 0; c-- {
		t.mu.freeChunks = append(t.mu.freeChunks, uint32(c))
	}
	t.wg.Add(1)
	go t.worker()
	return t, nil
}

// ChunkBytes is the size of one chunk: the largest slot the tier takes.
func (t *Space) ChunkBytes() uint64 { return t.chunkBytes }

// Capacity is the size of the space in bytes (whole chunks).
func (t *Space) Capacity() uint64 { return t.capacity }

// MaxClasses is how many slot sizes the space serves at once.
func (t *Space) MaxClasses() int { return t.maxClasses }

// Usage reports bytes and blocks held in slots (quarantined slots count).
func (t *Space) Usage() (usedBytes, blocks uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.usedBytes, t.mu.blocks
}

// Classes counts the slot sizes the space serves now.
func (t *Space) Classes() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.mu.classes)
}

// PolicyKey is the 64-bit key the policy tracks for k: the index's hash.
func (t *Space) PolicyKey(k *index.Key) uint64 { return index.HashKey(k) }

// slotLocked finds slot s in its chunk. The chunk has a slot size.
func (t *Space) slotLocked(s SlotID) (pins *uint32, state *uint8) {
	ch := uint64(s) / t.slotsPer
	c := t.mu.slotClass[ch]
	if c == nil {
		panic(fmt.Sprintf("slots: slot %d lies in a free chunk of the %s tier", s, t.cfg.Name))
	}
	i := (uint64(s) - ch*t.slotsPer) / (c.slotBytes / layout.SlotAlign)
	cs := &t.mu.slots[ch]
	return &cs.pins[i], &cs.state[i]
}

// Class returns the class for slots of slotBytes (a multiple of
// layout.SlotAlign), creating it on first use, and takes a reference to it:
// call Drop when done with it. It refuses a new size past MaxClasses.
func (t *Space) Class(slotBytes uint64) (*Class, error) {
	if slotBytes == 0 || slotBytes%layout.SlotAlign != 0 {
		return nil, fmt.Errorf("slot size %d is not a positive multiple of %d", slotBytes, layout.SlotAlign)
	}
	if slotBytes > t.chunkBytes {
		return nil, fmt.Errorf("%w: block slot is %d bytes, chunk is %d bytes (raise --%s-chunk-bytes)", ErrSlotTooLarge, slotBytes, t.chunkBytes, t.cfg.Name)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		return nil, ErrClosed
	}
	if c, ok := t.mu.classes[slotBytes]; ok {
		c.refs++
		return c, nil
	}
	if len(t.mu.classes) >= t.maxClasses {
		return nil, fmt.Errorf("%w: the %s tier serves %d block sizes already, as many as it has chunks for", ErrTooManyClasses, t.cfg.Name, len(t.mu.classes))
	}
	counters := countersPerSlot * int64(t.capacity/slotBytes)
	counters = max(min(counters, t.counterBudget-t.mu.counters), minCounters)
	c := &Class{t: t, slotBytes: slotBytes, perChunk: t.chunkBytes / slotBytes, counters: counters, refs: 1}
	// The callbacks reach the owner only while the class and the space
	// are open.
	live := func() bool { return !c.retired.Load() && !t.closing.Load() }
	cb := callbacks{
		evict: func(hs []uint64) {
			if t.cfg.Evict == nil {
				return
			}
			var ks []index.Key
			for _, h := range hs {
				ks = t.cfg.Keys(h, ks[:0])
				for _, k := range ks {
					if live() {
						t.cfg.Evict(k)
					}
				}
			}
		},
		reject: func(ks []index.Key) {
			for _, k := range ks {
				if t.cfg.Reject != nil && live() {
					t.cfg.Reject(k)
				}
			}
		},
	}
	var p policy = newSLRU(cb)
	if t.cfg.Policy == TinyLFU {
		p = newTinyLFU(counters, cb)
	}
	c.policy = p
	t.mu.counters += counters
	t.mu.classes[slotBytes] = c
	return c, nil
}

// SlotBytes is the slot size of the class.
func (c *Class) SlotBytes() uint64 { return c.slotBytes }

// Drop gives back a reference Class returned. The class goes (its chunks
// back to the space, its policy and its goroutines stopped) once no
// reference is left and none of its slots is in use.
func (c *Class) Drop() {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if c.refs <= 0 {
		panic(fmt.Sprintf("slots: drop of a %d-byte class with no reference", c.slotBytes))
	}
	c.refs--
	t.maybeRetireLocked(c)
}

// maybeRetireLocked removes c when nothing holds it: its chunks go back to
// the free list and the worker closes its policy.
func (t *Space) maybeRetireLocked(c *Class) {
	if c.refs > 0 || c.live > 0 || c.removed || t.mu.closed {
		return
	}
	c.removed = true
	c.retired.Store(true)
	delete(t.mu.classes, c.slotBytes)
	for ch, o := range t.mu.chunkOwner {
		if o == c {
			t.freeChunkLocked(uint32(ch))
		}
	}
	c.free, c.chunks, c.held = nil, 0, 0
	t.mu.counters -= c.counters
	t.mu.retired = append(t.mu.retired, c)
	select {
	case t.retire <- struct{}{}:
	default:
	}
}

// Touch records accesses (lookups, hit or miss) to the keys whose
// PolicyKeys are hs, for the policy's frequency estimate. It does not wait:
// the accesses reach the policy from the space's worker goroutine, and are
// dropped (and counted) if it falls behind: this keeps its cost off the
// Lookup's latency. Touch takes ownership of hs.
func (c *Class) Touch(hs []uint64) {
	if len(hs) == 0 {
		return
	}
	select {
	case c.t.touches <- touchBatch{c: c, hs: hs, seq: admits.Load()}:
	default:
		c.t.touchesDropped.Add(uint64(len(hs)))
	}
}

type touchBatch struct {
	c  *Class
	hs []uint64
	// seq is the last admit when the accesses were made: a block the
	// policy took after them was not held when they looked, and a late
	// batch does not count as its reuse.
	seq uint64
}

// worker feeds accesses to the policies and closes the policies of removed
// classes, until the space closes.
func (t *Space) worker() {
	defer t.wg.Done()
	for {
		select {
		case b := <-t.touches:
			t.record(b)
		case <-t.retire:
			t.closeRetired()
		case <-t.stop:
			return
		}
	}
}

// record hands a batch's accesses to the class's policy.
func (t *Space) record(b touchBatch) {
	b.c.pmu.RLock()
	defer b.c.pmu.RUnlock()
	if b.c.retired.Load() {
		return
	}
	b.c.policy.access(b.hs, b.seq)
}

// closeRetired closes the policies of removed classes (their goroutines
// stop).
func (t *Space) closeRetired() {
	t.mu.Lock()
	rs := t.mu.retired
	t.mu.retired = nil
	t.mu.Unlock()
	for _, c := range rs {
		c.closePolicy()
	}
}

// closePolicy stops the class's policy and its goroutines, once no one
// uses it.
func (c *Class) closePolicy() {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	c.retired.Store(true)
	c.policy.close()
}

// drainTouches records the queued accesses on the caller's goroutine.
func (t *Space) drainTouches() {
	for {
		select {
		case b := <-t.touches:
			t.record(b)
		default:
			return
		}
	}
}

// TouchesDropped counts accesses not recorded because the worker lagged.
func (t *Space) TouchesDropped() uint64 { return t.touchesDropped.Load() }

// Admit offers new keys to the policy, which may evict others (Evict) or
// decline some (Reject) before Admit returns. A key given twice is offered
// once. Call it without holding any index lock.
func (c *Class) Admit(keys []index.Key) {
	if len(keys) == 0 {
		return
	}
	// Accesses still queued count before the admission decision: a
	// block looked up just before its store must not look colder than it is.
	c.t.drainTouches()
	c.pmu.RLock()
	defer c.pmu.RUnlock()
	if c.retired.Load() {
		return
	}
	if len(keys) > 1 {
		// The policies take distinct keys: a second offer of a key
		// would count as a use of it (SLRU) and its decline would
		// reach the owner twice.
		seen := make(map[uint64]struct{}, len(keys))
		uniq := make([]index.Key, 0, len(keys))
		for i := range keys {
			h := c.t.PolicyKey(&keys[i])
			if _, dup := seen[h]; !dup {
				seen[h] = struct{}{}
				uniq = append(uniq, keys[i])
			}
		}
		keys = uniq
	}
	hs := make([]uint64, len(keys))
	for i := range keys {
		hs[i] = c.t.PolicyKey(&keys[i])
	}
	c.amu.Lock()
	defer c.amu.Unlock()
	c.grow(len(keys))
	c.policy.admit(keys, hs)
}

// Forget removes k from the policy after its owner dropped it for a reason
// of its own (failure, invalidation). Call it without holding any index lock.
func (c *Class) Forget(k *index.Key) {
	c.forgets.Add(1)
	c.pmu.RLock()
	defer c.pmu.RUnlock()
	if !c.retired.Load() {
		c.policy.forget(c.t.PolicyKey(k))
	}
}

// Forgets counts the Forget calls so far, each counted before it reaches
// the policy: an owner that files keys and then Learns them, and reads the
// same count before filing and after Learn, knows that no Forget of them
// came before the Learn (recovery, offload/recover.go).
func (c *Class) Forgets() uint64 { return c.forgets.Load() }

// Holds reports whether the policy counts k among the blocks it keeps. It
// records no access; it is for invariant checks.
func (c *Class) Holds(k *index.Key) bool {
	c.pmu.RLock()
	defer c.pmu.RUnlock()
	if c.retired.Load() {
		return false
	}
	return c.policy.holds(c.t.PolicyKey(k))
}

// Alloc takes a free slot for a block being written, leaving the free
// slots Config.Staging keeps for AllocStaging. The slot starts with one
// pin, the writer's; Unpin it when the write has drained.
func (c *Class) Alloc() (SlotID, bool) { return c.alloc(false) }

// AllocStaging is Alloc for a block read from a lower tier: it may take
// the free slots Alloc leaves (Config.Staging).
func (c *Class) AllocStaging() (SlotID, bool) { return c.alloc(true) }

func (c *Class) alloc(staging bool) (SlotID, bool) {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	var s SlotID
	if c.removed {
		return 0, false
	}
	keep := c.keep
	if staging {
		keep = 0
	}
	for {
		n := len(c.free)
		if n <= keep {
			return 0, false
		}
		s = c.free[n-1]
		c.free = c.free[:n-1]
		// Every slot on a free list is free (Adopt keeps the slots it
		// takes off it); the check costs nothing.
		if _, st := t.slotLocked(s); *st == slotFree {
			break
		}
	}
	pins, st := t.slotLocked(s)
	*st = slotUsed
	*pins = 1
	t.mu.pinned++
	t.mu.chunkLive[uint64(s)/t.slotsPer]++
	c.live++
	t.mu.usedBytes += c.slotBytes
	t.mu.blocks++
	return s, true
}

// grow gives the class chunks until it has n free slots besides those Alloc
// leaves for staging and the policy may keep n blocks more than it holds,
// or no chunk is left, taking one from another slot size when the class has
// none at all. The caller holds c.amu: the policy holds the keys of every
// admission before this one, whether or not their stores have taken their
// slots yet, so concurrent stores do not count the same free slots (which
// evicted blocks while the tier had room).
func (c *Class) grow(n int) {
	t := c.t
	var held int64
	if c.policy != nil && !c.retired.Load() {
		held = c.policy.size()
	}
	t.mu.Lock()
	// n beyond the slots Alloc leaves for staging (Config.Staging), and
	// beyond the reserve the policy keeps free (Config.Reserve).
	for (len(c.free) < n+c.keep || held+int64(n) > c.maxCost) && len(t.mu.freeChunks) > 0 {
		c.addChunkLocked(t.popFreeChunkLocked())
	}
	var steal = -1
	if c.chunks == 0 {
		steal = t.pickDonorLocked(c)
	}
	t.mu.Unlock()
	if steal >= 0 {
		t.drainChunk(uint32(steal))
		t.mu.Lock()
		if len(t.mu.freeChunks) > 0 && c.chunks == 0 && !c.removed {
			c.addChunkLocked(t.popFreeChunkLocked())
		}
		t.mu.Unlock()
	}
}

func (t *Space) popFreeChunkLocked() uint32 {
	k := len(t.mu.freeChunks) - 1
	ch := t.mu.freeChunks[k]
	t.mu.freeChunks = t.mu.freeChunks[:k]
	return ch
}

// addChunkLocked cuts chunk ch into c's slots. A slot over a byte range
// quarantined under an earlier slot size starts quarantined.
func (c *Class) addChunkLocked(ch uint32) {
	t := c.t
	t.mu.chunkOwner[ch] = c
	t.mu.slotClass[ch] = c
	cs := chunkSlots{pins: make([]uint32, c.perChunk), state: make([]uint8, c.perChunk)}
	t.mu.slots[ch] = cs
	base := uint64(ch) * t.slotsPer
	step := c.slotBytes / layout.SlotAlign
	for i := int(c.perChunk) - 1; i >= 0; i-- {
		lo := uint64(i) * c.slotBytes
		if overlaps(t.mu.bad[ch], lo, lo+c.slotBytes) {
			cs.state[i] = slotQuarantined
			t.mu.quarantined++
			t.mu.usedBytes += c.slotBytes
			t.mu.blocks++
			t.mu.chunkHeld[ch]++
			continue
		}
		c.free = append(c.free, SlotID(base+uint64(i)*step))
	}
	c.chunks++
	c.held += int(t.mu.chunkHeld[ch])
	c.setMaxCostLocked()
}

func overlaps(bad []span, lo, hi uint64) bool {
	for _, b := range bad {
		if lo < b.hi && b.lo < hi {
			return true
		}
	}
	return false
}

// setMaxCostLocked tells the policy how many blocks the class can keep:
// its slots less those taken without a block the policy knows of (released
// while pinned, quarantined) and less the reserve. Counting the taken ones
// is what keeps the policy evicting while a pinned block it evicted still
// holds its slot: otherwise it would admit into room that does not exist,
// and every store would find no slot until the pin dropped.
func (c *Class) setMaxCostLocked() {
	usable := int64(uint64(c.chunks)*c.perChunk) - int64(c.held)
	usable = max(usable, 0)
	reserve := int64(math.Ceil(float64(usable) * c.t.cfg.Reserve))
	c.maxCost = max(usable-reserve, min(usable, 1))
	// The staging share counts every slot of the class, held ones too: a
	// tier whose blocks the policy evicted while leases pin them is the
	// one where a load most needs its slot.
	c.keep = 0
	if all := int64(uint64(c.chunks) * c.perChunk); c.t.cfg.Staging > 0 && all > 1 {
		c.keep = int(min(max(int64(math.Ceil(float64(all)*c.t.cfg.Staging)), 1), all-1))
	}
	if c.policy != nil {
		// An atomic store; it takes effect at the next Admit.
		c.policy.setCapacity(c.maxCost)
	}
}

// heldLocked changes the count of held slots in chunk ch by d.
func (t *Space) heldLocked(ch uint64, d int) {
	t.mu.chunkHeld[ch] = uint32(int(t.mu.chunkHeld[ch]) + d)
	if c := t.mu.chunkOwner[ch]; c != nil {
		c.held += d
		c.setMaxCostLocked()
	}
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
	donor.held -= int(t.mu.chunkHeld[best])
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
	lo, hi := SlotID(uint64(ch)*t.slotsPer), SlotID(uint64(ch+1)*t.slotsPer)
	if t.cfg.EvictRange != nil {
		t.cfg.EvictRange(lo, hi)
	}
	t.mu.Lock()
	t.maybeFreeChunkLocked(ch)
	t.mu.Unlock()
}

func (t *Space) maybeFreeChunkLocked(ch uint32) {
	if t.mu.draining[ch] && t.mu.chunkLive[ch] == 0 {
		t.freeChunkLocked(ch)
	}
}

// freeChunkLocked returns chunk ch, whose slots nobody names, to the free
// list. Its quarantined slots stop counting; their byte ranges stay bad.
func (t *Space) freeChunkLocked(ch uint32) {
	c := t.mu.slotClass[ch]
	for _, st := range t.mu.slots[ch].state {
		if st == slotQuarantined {
			t.mu.quarantined--
			t.mu.usedBytes -= c.slotBytes
			t.mu.blocks--
		}
	}
	t.mu.draining[ch] = false
	t.mu.chunkOwner[ch] = nil
	t.mu.slotClass[ch] = nil
	t.mu.slots[ch] = chunkSlots{}
	t.mu.chunkHeld[ch] = 0
	t.mu.freeChunks = append(t.mu.freeChunks, ch)
}

// ChunkOf reports the chunk of slot s and the slot size that chunk serves
// (0 when free).
func (t *Space) ChunkOf(s SlotID) (chunk uint32, slotBytes uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ch := uint64(s) / t.slotsPer
	if ch >= uint64(len(t.mu.slotClass)) {
		return uint32(ch), 0
	}
	if c := t.mu.slotClass[ch]; c != nil {
		return uint32(ch), c.slotBytes
	}
	return uint32(ch), 0
}

// Quarantine takes slot s out of use (its storage returned an I/O error):
// its bytes are never handed out again, under this slot size or any later
// one the chunk serves. The caller removed the index entry naming s (or
// released s, and holds a pin on it); the slot's pins still drop as usual,
// and the chunk can move to another slot size once they have.
func (t *Space) Quarantine(s SlotID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	pins, st := t.slotLocked(s)
	ch := uint64(s) / t.slotsPer
	switch *st {
	case slotUsed:
		t.released(s)
		t.heldLocked(ch, 1)
	case slotReleased, slotVoid: // held already, and pinned
	default:
		panic(fmt.Sprintf("slots: quarantine of slot %d in state %d", s, *st))
	}
	*st = slotQuarantined
	t.mu.quarantined++
	c := t.mu.slotClass[ch]
	lo := (uint64(s) - ch*t.slotsPer) * layout.SlotAlign
	t.mu.bad[ch] = append(t.mu.bad[ch], span{lo, lo + c.slotBytes})
	if *pins == 0 {
		t.unliveLocked(ch, c)
	}
}

// unliveLocked notes that a slot of chunk ch (class c) can no longer be
// named: a draining chunk may be free now, an unreferenced class gone.
func (t *Space) unliveLocked(ch uint64, c *Class) {
	t.mu.chunkLive[ch]--
	c.live--
	t.maybeFreeChunkLocked(uint32(ch))
	t.maybeRetireLocked(c)
}

// Draining reports whether slot s lies in a chunk moving to another slot
// size: a block written there is not to be kept.
func (t *Space) Draining(s SlotID) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ch := uint64(s) / t.slotsPer
	return ch < uint64(len(t.mu.draining)) && t.mu.draining[ch]
}

// Quarantined counts slots taken out of use.
func (t *Space) Quarantined() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.quarantined
}

// Pin keeps slot s from being reused until Unpin. The caller holds the
// index entry that names s, so s is in use. It reports false, and takes no
// pin, when s already has MaxPins.
func (t *Space) Pin(s SlotID) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	pins, st := t.slotLocked(s)
	if *st != slotUsed {
		panic(fmt.Sprintf("slots: pin of slot %d in state %d", s, *st))
	}
	if *pins == MaxPins {
		return false
	}
	if *pins == 0 {
		t.mu.pinned++
	}
	*pins++
	return true
}

// Unpin drops a pin; the slot is freed if its owner already released it
// (a void slot goes to the eraser first).
func (t *Space) Unpin(s SlotID) {
	t.mu.Lock()
	pins, st := t.slotLocked(s)
	if *pins == 0 {
		t.mu.Unlock()
		panic(fmt.Sprintf("slots: unpin of unpinned slot %d", s))
	}
	*pins--
	if *pins > 0 {
		t.mu.Unlock()
		return
	}
	t.mu.pinned--
	ch := uint64(s) / t.slotsPer
	var erase func(SlotID)
	switch *st {
	case slotReleased:
		t.heldLocked(ch, -1)
		t.freeLocked(s)
	case slotQuarantined:
		t.unliveLocked(ch, t.mu.slotClass[ch])
	case slotVoid:
		erase = t.eraseLocked(s)
	}
	t.mu.Unlock()
	if erase != nil {
		erase(s)
	}
}

// Release is called once by whoever removed the index entry naming s. The
// slot is freed now, or when its last pin drops.
func (t *Space) Release(s SlotID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	pins, st := t.slotLocked(s)
	if *st != slotUsed {
		panic(fmt.Sprintf("slots: release of slot %d in state %d", s, *st))
	}
	t.released(s)
	if *pins > 0 {
		*st = slotReleased
		t.heldLocked(uint64(s)/t.slotsPer, 1)
		return
	}
	t.freeLocked(s)
}

// released tells the owner's Released hook that s was let go of; the
// caller holds t.mu.
func (t *Space) released(s SlotID) {
	if t.cfg.Released != nil {
		t.cfg.Released(s)
	}
}

func (t *Space) freeLocked(s SlotID) {
	ch := uint64(s) / t.slotsPer
	c := t.mu.slotClass[ch]
	_, st := t.slotLocked(s)
	*st = slotFree
	t.mu.usedBytes -= c.slotBytes
	t.mu.blocks--
	if !t.mu.draining[ch] {
		c.free = append(c.free, s)
	}
	t.unliveLocked(ch, c)
}

// Pinned counts slots with pins, for leak checks and metrics.
func (t *Space) Pinned() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.pinned
}

// Close stops the worker and the policies; no callback reaches the owner
// from then on (closing a policy would report every key it holds as
// evicted). No copy may be in flight.
func (t *Space) Close() {
	if !t.closing.CompareAndSwap(false, true) {
		return
	}
	close(t.stop)
	t.wg.Wait()
	t.mu.Lock()
	t.mu.closed = true
	policies := make([]*Class, 0, len(t.mu.classes)+len(t.mu.retired))
	for _, c := range t.mu.classes {
		policies = append(policies, c)
	}
	policies = append(policies, t.mu.retired...)
	t.mu.retired = nil
	t.mu.Unlock()
	for _, c := range policies {
		c.closePolicy()
	}
}
