package offload

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Clean CPU copies, and the cleaner that keeps a margin of them (write-back
// with a disk tier). A CPU copy is clean when the block is on disk too:
// dropping it frees its slot at once and loses nothing. A store that finds
// no free CPU slot drops the oldest idle clean copy of its slot size rather
// than fail NO_SPACE, and a block the CPU policy evicts while clean needs
// no disk write before its slot is free. The cleaner writes the oldest
// dirty blocks (stored, in the CPU tier only) to disk ahead of their
// eviction, keeping the CPU copy, so that such copies exist when a burst of
// stores comes: as many as the largest recent Store asked for, or as many
// as arrive while a disk write lands, whichever is more, and never more
// than half the CPU tier's blocks (cleanMargin). Its writes go behind the
// demotions and stay within a small backlog, so the disk's reads do not
// queue behind them for long.

// cleanTick is how often the cleaner updates its rates when nothing wakes it.
const cleanTick = 100 * time.Millisecond

// burstDecay is what the largest recent Store counts for after a tick: it
// halves in about two seconds, so a step's burst stays in the margin
// between steps.
const burstDecay = 0.97

// pollTries is how many clean copies a caller that polls for a slot (the
// stager) looks at per try.
const pollTries = 64

// keyRing is a bounded FIFO of keys; pushing onto a full one drops the
// oldest (a key that old is handled by the policy's own eviction anyway).
type keyRing struct {
	keys       []index.Key
	head, size int
}

func newKeyRing(n int) *keyRing { return &keyRing{keys: make([]index.Key, max(n, 1))} }

func (r *keyRing) push(k index.Key) {
	if r.size == len(r.keys) {
		r.head = (r.head + 1) % len(r.keys)
		r.size--
	}
	r.keys[(r.head+r.size)%len(r.keys)] = k
	r.size++
}

func (r *keyRing) pop() (index.Key, bool) {
	if r.size == 0 {
		return index.Key{}, false
	}
	k := r.keys[r.head]
	r.head = (r.head + 1) % len(r.keys)
	r.size--
	return k, true
}

// classRings are one CPU slot size's candidates.
type classRings struct {
	clean, dirty *keyRing
}

// cleaning is the service's state for clean copies and the cleaner.
type cleaning struct {
	// pass is held by a cleaning pass, and by CheckInvariants so that
	// no cleaner write starts while it walks the index.
	pass     sync.Mutex
	paused   atomic.Bool   // PauseCleaner
	wake     chan struct{} // a store completed or a disk write landed
	inflight atomic.Int64  // cleaning writes queued or in flight
	stored   atomic.Int64  // blocks stored since the last tick
	margin   atomic.Int64  // the target, in blocks

	mu struct {
		sync.Mutex
		rings    map[*slots.Class]*classRings
		order    []*slots.Class // round robin over the rings
		next     int
		burst    float64 // the largest recent Store, decaying
		rate     float64 // blocks stored per second, smoothed
		writeSec float64 // seconds from queuing a disk write to its landing, smoothed
		last     time.Time
	}
	m *cleanMetrics
}

type cleanMetrics struct {
	cleaned   prometheus.Counter
	dropped   prometheus.Counter
	looked    prometheus.Counter
	noSpace   *prometheus.CounterVec
	evictable prometheus.Gauge
}

func newCleaning(s *Service, reg prometheus.Registerer) *cleaning {
	cl := &cleaning{wake: make(chan struct{}, 1)}
	cl.mu.rings = map[*slots.Class]*classRings{}
	cl.mu.last = time.Now()
	cl.m = &cleanMetrics{
		cleaned: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvoffload_cpu_cleaned_total",
			Help: "Blocks the cleaner wrote to disk ahead of their eviction from the CPU tier, keeping the CPU copy."}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvoffload_cpu_clean_dropped_total",
			Help: "Clean CPU copies (the block stays on disk) dropped to give a store their slot."}),
		looked: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvoffload_cpu_clean_looked_at_total",
			Help: "Clean CPU copies looked at to find one no pin holds, to give a store or a disk read its slot (a pinned one is passed over)."}),
		noSpace: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvoffload_store_no_space_total",
			Help: "Stored blocks refused NO_SPACE, by what clean CPU copies there were then: none, or only ones pinned (by a load or a lease) or of another block size."},
			[]string{"clean_copies"}),
	}
	if reg != nil {
		reg.MustRegister(cl.m.cleaned, cl.m.dropped, cl.m.looked, cl.m.noSpace,
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_cpu_clean_margin_blocks",
				Help: "Clean CPU copies the cleaner aims to keep: the largest recent Store, or the blocks stored while a disk write lands, whichever is more."},
				func() float64 { return float64(cl.margin.Load()) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_cpu_clean_blocks",
				Help: "Blocks ready in the CPU tier that are also on disk: their CPU slots can be freed at once."},
				func() float64 { c, _ := s.ix.Copies(); return float64(c) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvoffload_cpu_dirty_blocks",
				Help: "Blocks ready in the CPU tier only, with no disk write of them in flight."},
				func() float64 { _, d := s.ix.Copies(); return float64(d) }),
		)
	}
	return cl
}

// ringsLocked returns c's rings, made on first use and sized by the most
// blocks of c the CPU tier holds.
func (cl *cleaning) ringsLocked(s *Service, c *slots.Class) *classRings {
	r := cl.mu.rings[c]
	if r == nil {
		n := int(s.cpu.Capacity() / c.SlotBytes())
		r = &classRings{clean: newKeyRing(n), dirty: newKeyRing(n)}
		cl.mu.rings[c] = r
		cl.mu.order = append(cl.mu.order, c)
	}
	return r
}

func (cl *cleaning) signal() {
	select {
	case cl.wake <- struct{}{}:
	default:
	}
}

// noteStore counts a Store of n new blocks (the burst the margin covers).
func (s *Service) noteStore(n int) {
	if s.cl == nil || n == 0 {
		return
	}
	s.cl.mu.Lock()
	s.cl.mu.burst = max(s.cl.mu.burst, float64(n))
	s.cl.mu.Unlock()
}

// noteDirty records a block that became ready in the CPU tier only: a
// candidate for the cleaner.
func (s *Service) noteDirty(c *slots.Class, k index.Key) {
	if s.cl == nil {
		return
	}
	s.cl.stored.Add(1)
	s.cl.mu.Lock()
	s.cl.ringsLocked(s, c).dirty.push(k)
	s.cl.mu.Unlock()
	s.cl.signal()
}

// noteClean records a block whose CPU copy became clean (written ahead by
// the cleaner, written through, or read from disk and kept).
func (s *Service) noteClean(c *slots.Class, k index.Key) {
	if s.cl == nil {
		return
	}
	s.cl.mu.Lock()
	s.cl.ringsLocked(s, c).clean.push(k)
	s.cl.mu.Unlock()
}

// noteWrite folds a disk write's time, from queuing to landing, into the
// margin's estimate.
func (s *Service) noteWrite(d time.Duration) {
	if s.cl == nil {
		return
	}
	s.cl.mu.Lock()
	if s.cl.mu.writeSec == 0 {
		s.cl.mu.writeSec = d.Seconds()
	} else {
		s.cl.mu.writeSec = 0.9*s.cl.mu.writeSec + 0.1*d.Seconds()
	}
	s.cl.mu.Unlock()
	s.cl.signal()
}

// dropClean frees a CPU slot of class c by dropping the oldest clean copy
// of that size no pin holds, looking at no more than tries of them; the
// block stays on disk. It reports whether it freed one. The caller holds
// no index lock.
func (s *Service) dropClean(c *slots.Class, tries int) bool {
	if s.cl == nil {
		return false
	}
	// Pinned copies (a lease, a load) go back behind the others.
	for tries = min(s.cl.cleanLen(c), tries); tries > 0; tries-- {
		k, ok := s.cl.popClean(c)
		if !ok {
			return false
		}
		s.cl.m.looked.Inc()
		freed, stale := false, true
		s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
			if !found || e.State != index.Ready || e.CPU == index.NoSlot || e.Disk == index.NoSlot || e.Flags&(index.DiskWriting|index.Promoting) != 0 {
				return found // no longer a clean copy: forget it
			}
			stale = false
			if s.cpu.ReleaseIdle(e.CPU) {
				e.CPU = index.NoSlot
				freed = true
			}
			return true
		})
		if freed {
			// The CPU policy no longer holds it; its disk policy still does.
			s.forgetCPU(c, &k)
			s.cl.m.dropped.Inc()
			s.m.evictions.WithLabelValues("cpu", "clean_for_store").Inc()
			s.c.evictions.Add(1)
			return true
		}
		if !stale {
			s.noteClean(c, k)
		}
	}
	return false
}

func (cl *cleaning) cleanLen(c *slots.Class) int {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if r := cl.mu.rings[c]; r != nil {
		return r.clean.size
	}
	return 0
}

func (cl *cleaning) popClean(c *slots.Class) (index.Key, bool) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if r := cl.mu.rings[c]; r != nil {
		return r.clean.pop()
	}
	return index.Key{}, false
}

// allocCPU takes a CPU slot of class c for a store or (staging) a disk
// read: a free one, or one a clean copy gives up (looking at up to tries of
// them each time; a caller that polls looks at a few at a time). A store
// leaves the staging slots (slots.Config.Staging) to the reads.
func (s *Service) allocCPU(c *slots.Class, tries int, staging bool) (slots.SlotID, bool) {
	alloc := c.Alloc
	if staging {
		alloc = c.AllocStaging
	}
	if sl, ok := alloc(); ok {
		return sl, true
	}
	for s.dropClean(c, tries) {
		if sl, ok := alloc(); ok {
			return sl, true
		}
	}
	return 0, false
}

// slotSource gives the blocks of one Store or Load their CPU slots. When
// every clean copy of a class is pinned, the first block that looked at
// them all marks the class dry, and the call's other blocks take only free
// slots: a call of n blocks looks at the clean copies once, not n times
// (each look takes an index shard's lock; leases can pin a million). A
// copy unpinned meanwhile serves the next call.
type slotSource struct {
	s       *Service
	staging bool // blocks read from a lower tier (slots.Config.Staging)
	dry     map[*slots.Class]bool
}

func (a *slotSource) alloc(c *slots.Class) (slots.SlotID, bool) {
	if a.dry[c] {
		if a.staging {
			return c.AllocStaging()
		}
		return c.Alloc()
	}
	sl, ok := a.s.allocCPU(c, math.MaxInt, a.staging)
	if !ok {
		if a.dry == nil {
			a.dry = map[*slots.Class]bool{}
		}
		a.dry[c] = true
	}
	return sl, ok
}

// noSpace counts a store refused for want of a CPU slot, by whether clean
// copies existed (all pinned, or of other sizes) or none did.
func (s *Service) noSpace() {
	if s.cl == nil {
		return
	}
	if clean, _ := s.ix.Copies(); clean > 0 {
		s.cl.m.noSpace.WithLabelValues("pinned_or_other_size").Inc()
	} else {
		s.cl.m.noSpace.WithLabelValues("none").Inc()
	}
}

// endCleaning settles a demotion's part in the clean copies: a cleaning
// write is no longer in flight, and a write that kept the CPU copy (the
// cleaner's, or write-through) made it clean.
func (s *Service) endCleaning(d *demotion, clean bool) {
	if s.cl == nil {
		return
	}
	if d.cleaning {
		s.cl.inflight.Add(-1)
		if clean {
			s.cl.m.cleaned.Inc()
		}
	}
	if clean {
		if ns := s.nsByID(d.key.NS); ns != nil {
			s.noteClean(ns.classes[d.key.Group], d.key)
		}
	}
}

// cleanMargin updates the rates and returns the target number of clean
// copies: the largest recent Store (a step's stores all want a slot at
// once), or twice the blocks stored while one disk write lands (a steady
// stream), at most half the blocks ready in the CPU tier.
func (s *Service) cleanMargin(cleanN, dirtyN int) int {
	cl := s.cl
	now := time.Now()
	cl.mu.Lock()
	if dt := now.Sub(cl.mu.last).Seconds(); dt >= cleanTick.Seconds() {
		r := float64(cl.stored.Swap(0)) / dt
		cl.mu.rate = 0.7*cl.mu.rate + 0.3*r
		cl.mu.burst *= math.Pow(burstDecay, dt/cleanTick.Seconds())
		cl.mu.last = now
	}
	m := int(math.Ceil(max(cl.mu.burst, 2*cl.mu.rate*cl.mu.writeSec)))
	cl.mu.Unlock()
	m = min(m, (cleanN+dirtyN)/2)
	cl.margin.Store(int64(m))
	return m
}

// cleaner runs until the service stops: at every wake-up it writes dirty
// blocks ahead, oldest first, until the clean copies and the writes in
// flight reach the margin or the disk's write backlog is full.
func (s *Service) cleaner() {
	defer s.reaper.Done()
	t := time.NewTicker(cleanTick)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-s.cl.wake:
		case <-t.C:
		}
		s.cleanPass()
	}
}

func (s *Service) cleanPass() {
	cl := s.cl
	cl.pass.Lock()
	defer cl.pass.Unlock()
	if cl.paused.Load() {
		return
	}
	cleanN, dirtyN := s.ix.Copies()
	need := s.cleanMargin(cleanN, dirtyN) - cleanN - int(cl.inflight.Load())
	room := s.cleanBacklog - int(s.diskWrites.Load())
	for n := min(need, room, dirtyN); n > 0; {
		k, ok := cl.nextDirty()
		if !ok {
			return
		}
		if s.writeAhead(k) {
			n--
		}
	}
}

// nextDirty pops the oldest dirty candidate, taking the classes in turn.
func (cl *cleaning) nextDirty() (index.Key, bool) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	for range len(cl.mu.order) {
		c := cl.mu.order[cl.mu.next%len(cl.mu.order)]
		cl.mu.next++
		if k, ok := cl.mu.rings[c].dirty.pop(); ok {
			return k, true
		}
	}
	return index.Key{}, false
}

// writeAhead queues a disk write of k's CPU copy that keeps the copy, if
// k is still dirty.
func (s *Service) writeAhead(k index.Key) bool {
	queued := false
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		if !found || e.State != index.Ready || e.CPU == index.NoSlot || e.Disk != index.NoSlot || e.Flags&(index.DiskWriting|index.Spill|index.Promoting) != 0 {
			return found
		}
		if !s.cpu.Pin(e.CPU) {
			return true
		}
		if s.demote(demotion{key: k, cpuSlot: e.CPU, keepCPU: true, cleaning: true}) {
			e.Flags |= index.DiskWriting
			queued = true
			return true
		}
		s.cpu.Unpin(e.CPU)
		return true
	})
	if queued {
		s.cl.inflight.Add(1)
	}
	return queued
}

// CPUCopies counts the blocks ready in the CPU tier that are clean (also
// on disk) and dirty (only there, no disk write in flight).
func (s *Service) CPUCopies() (clean, dirty int) { return s.ix.Copies() }

// PauseCleaner stops the cleaner's passes until resume is called, once the
// pass in progress (if any) has queued its writes: for tests that need the
// tiers to change only through their own calls and the policies'
// evictions. FlushDisk still waits for the writes queued before.
func (s *Service) PauseCleaner() (resume func()) {
	if s.cl == nil {
		return func() {}
	}
	s.cl.paused.Store(true)
	s.cl.pass.Lock()
	s.cl.pass.Unlock()
	return func() {
		s.cl.paused.Store(false)
		s.cl.signal()
	}
}
