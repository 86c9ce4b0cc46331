package offload

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The disk tier behind the CPU tier. Write-back (the default): a block the
// CPU tier's policy evicts is written to disk first and its CPU slot freed
// when the write has landed; until then the CPU copy stays readable.
// Write-through: every stored block is also written to disk at once. A load
// of a block only on disk reads it into a CPU slot, verified, and keeps it
// there if the CPU tier's policy admits it.

// demotion is one block on its way from a CPU slot to the disk.
type demotion struct {
	key     index.Key
	cpuSlot cpu.SlotID
	keepCPU bool // write-through: the CPU copy stays
	// dslot is the disk slot written (NoSlot until one is taken);
	// released is set when the disk policy evicted the block while it was
	// written: the slot was released then (the writer's pin keeps it), so
	// the policy does not count room that is still taken. Both are guarded
	// by the key's index lock.
	dslot    slots.SlotID
	released bool
	// cleaning: the cleaner's write ahead of an eviction (keepCPU too).
	cleaning bool
	queued   time.Time
}

const demotionQueue = 4096

// demoQueue is the demotions waiting for the demoter: a channel of
// demotionQueue, and past it the write-back evictions that found it full.
// An evicted block reported stored is never dropped for want of room in a
// queue: it waits, readable from its pinned CPU slot, until its write lands.
// The overflow is bounded by the CPU tier's slots (each entry pins one, and
// a key has one current demotion). While blocks wait, their slots are not
// free: stores find fewer slots and are refused NO_SPACE per block (or take
// clean copies), which is the engine's back-pressure from a disk slower than
// its stores. A cleaner's write ahead and a write-through copy keep their
// CPU copy: those are dropped when the channel is full (nothing is lost).
type demoQueue struct {
	ch chan *demotion
	mu sync.Mutex
	// over is the overflow, oldest first; waiting counts it (the
	// demoter reads it without the lock).
	over    []*demotion
	waiting atomic.Int64
}

func newDemoQueue() *demoQueue { return &demoQueue{ch: make(chan *demotion, demotionQueue)} }

// put queues d; it reports false only for a demotion that keeps its CPU copy
// and found the channel full.
func (q *demoQueue) put(d *demotion) bool {
	select {
	case q.ch <- d:
		return true
	default:
	}
	if d.keepCPU {
		return false
	}
	q.mu.Lock()
	q.over = append(q.over, d)
	q.waiting.Store(int64(len(q.over)))
	q.mu.Unlock()
	return true
}

// take appends up to max-len(batch) overflowed demotions to batch.
func (q *demoQueue) take(batch []*demotion, max int) []*demotion {
	if q.waiting.Load() == 0 {
		return batch
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	n := min(max-len(batch), len(q.over))
	batch = append(batch, q.over[:n]...)
	clear(q.over[:n])
	q.over = q.over[n:]
	if len(q.over) == 0 {
		q.over = nil // let the backing array go after a burst
	}
	q.waiting.Store(int64(len(q.over)))
	return batch
}

type diskMetrics struct {
	demotions *prometheus.CounterVec // result=written|rejected|no_space|failed|dropped
	promoted  prometheus.Counter
}

func newDiskMetrics(reg prometheus.Registerer) *diskMetrics {
	m := &diskMetrics{
		demotions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvoffload_disk_demotions_total",
			Help: "Blocks sent from the CPU tier to the disk tier, by result: written, rejected (the disk policy kept hotter blocks), no_space, failed (write error), dropped (a cleaner's write ahead or a write-through copy found the queue full; the CPU copy stays).",
		}, []string{"result"}),
		promoted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvoffload_disk_promotions_total", Help: "Blocks read from disk by a load and kept in the CPU tier.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.demotions, m.promoted)
	}
	return m
}

// namespaceMeta is what the disk tier's catalog keeps of a namespace, so a
// restarted daemon can bring its blocks back.
type namespaceMeta struct {
	Fingerprint []byte      `json:"fingerprint"`
	HashBytes   int         `json:"hash_bytes"`
	Segments    [][2]uint64 `json:"segments"` // (group, bytes)
	marksMeta               // invalidations recovery must honour (marks.go)
}

func digestOf(fingerprint []byte) [32]byte { return sha256.Sum256(fingerprint) }

// encodeMeta is the catalog entry of ns; the caller holds Service.marksMu.
func encodeMeta(ns *Namespace) []byte {
	m := namespaceMeta{Fingerprint: ns.Fingerprint, HashBytes: ns.Layout.HashBytes, marksMeta: ns.marks.meta()}
	for _, sg := range ns.Layout.Segments {
		m.Segments = append(m.Segments, [2]uint64{uint64(sg.Group), sg.Bytes})
	}
	b, _ := json.Marshal(m)
	return b
}

func decodeMeta(b []byte) ([]byte, layout.Layout, error) {
	var m namespaceMeta
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, layout.Layout{}, err
	}
	l := layout.Layout{HashBytes: m.HashBytes}
	for _, sg := range m.Segments {
		if sg[0] >= layout.MaxGroups {
			return nil, layout.Layout{}, fmt.Errorf("group %d", sg[0])
		}
		l.Segments = append(l.Segments, layout.Segment{Group: uint32(sg[0]), Bytes: sg[1]})
	}
	if err := l.Validate(); err != nil {
		return nil, layout.Layout{}, err
	}
	if len(m.Fingerprint) == 0 {
		return nil, layout.Layout{}, errors.New("empty fingerprint")
	}
	return m.Fingerprint, l, nil
}

// catalogEntry is one readable namespace of a tier's catalog.
type catalogEntry struct {
	digest      [32]byte
	fingerprint []byte
	layout      layout.Layout
	meta        []byte // the entry as stored
}

// readCatalog decodes a tier's catalog (digest -> encodeMeta) in digest
// order, logging and leaving out each entry that is unreadable or whose
// fingerprint is not its digest's; tier names the tier in the log.
func (s *Service) readCatalog(catalog map[[32]byte][]byte, tier string) []catalogEntry {
	out := make([]catalogEntry, 0, len(catalog))
	for d, b := range catalog {
		fp, l, err := decodeMeta(b)
		if err == nil && digestOf(fp) != d {
			err = errors.New("fingerprint does not match its digest")
		}
		if err != nil {
			s.log.Error(tier+": a namespace in the catalog is unreadable; its blocks will not come back", "digest", fmt.Sprintf("%x", d[:8]), "err", err)
			continue
		}
		out = append(out, catalogEntry{digest: d, fingerprint: fp, layout: l, meta: b})
	}
	sort.Slice(out, func(i, j int) bool { return string(out[i].digest[:]) < string(out[j].digest[:]) })
	return out
}

// openDisk opens the disk tier, brings back the namespaces of its catalog,
// starts the recovery of the blocks of its files and the demoter.
func (s *Service) openDisk(cfg disk.Config, writeThrough bool, reg prometheus.Registerer) error {
	// With "kvoffloadd serving", this line brackets what the disk tier
	// adds to the start (kvbench's restart scenario reads both).
	s.log.Info("opening the disk tier", "dirs", cfg.Dirs)
	cfg.Logger = s.log
	cfg.Registerer = reg
	cfg.Evict = s.onDiskEvict
	cfg.Keys = s.ix.KeysOf
	cfg.Reject = s.onDiskReject
	cfg.EvictRange = s.onDiskEvictRange
	t, err := disk.Open(cfg)
	if err != nil {
		return err
	}
	s.disk = t
	t.SetEraser(s.eraseDiskSlot)
	s.writeThrough = writeThrough
	s.dm = newDiskMetrics(reg)
	s.demotions = newDemoQueue()

	// Serve at once: the blocks of the files come online in the
	// background (recover.go).
	if err := s.startRecovery(t); err != nil {
		t.Close()
		s.disk = nil
		return fmt.Errorf("disk tier recovery: %w", err)
	}
	s.staging = make(chan stageReq, demotionQueue)
	s.reaper.Add(2)
	go s.demoter()
	go s.stager()
	return nil
}

// saveNamespace records a new namespace in the disk tier's catalog. A
// namespace of the same fingerprint may have been there before (it went
// when it had no registration and no block left): its invalidation marks
// stay, since copies they cover may still lie on disk.
func (s *Service) saveNamespace(ns *Namespace) error {
	if s.disk == nil {
		return nil
	}
	d := digestOf(ns.Fingerprint)
	s.marksMu.Lock()
	defer s.marksMu.Unlock()
	if old, ok := s.disk.Namespaces()[d]; ok {
		if m, err := decodeMarks(old); err == nil {
			ns.marks.merge(m)
		}
	}
	return s.disk.SaveNamespace(d, encodeMeta(ns))
}

func (s *Service) diskMeta(k *index.Key) disk.Meta {
	ns := s.nsByID(k.NS)
	return disk.Meta{
		NS:         digestOf(ns.Fingerprint),
		Group:      k.Group,
		Hash:       k.Hash[:ns.Layout.HashBytes],
		PayloadLen: ns.Layout.PayloadBytes(k.Group),
	}
}

// demote queues a block's CPU copy for the disk. The caller holds the
// entry's index lock, has set DiskWriting and pinned the CPU slot. It
// reports false when the queue is full for a demotion that keeps its CPU
// copy (the caller undoes both); a write-back eviction always waits its turn
// (demoQueue).
//
// The demotion becomes the key's current one. An earlier demotion of the
// key still in flight belongs to an entry since removed (invalidated, or
// dropped after a failed load): when it ends it only gives back its own
// slots, and never touches the entry or the policy of this one.
func (s *Service) demote(d demotion) bool {
	d.dslot = index.NoSlot
	d.queued = time.Now()
	dp := &d
	s.writing.Lock()
	s.writing.byKey[d.key] = dp
	s.writing.peak = max(s.writing.peak, len(s.writing.byKey))
	s.writing.Unlock()
	// Counted before it is queued: its write may land before this
	// returns, and FlushDisk must never see it missing.
	s.diskWrites.Add(1)
	if s.demotions.put(dp) {
		return true
	}
	s.diskWrites.Add(-1)
	s.endDemotion(dp)
	s.dm.demotions.WithLabelValues("dropped").Inc()
	return false
}

// current reports whether d is its key's current demotion.
func (s *Service) current(d *demotion) bool {
	s.writing.Lock()
	defer s.writing.Unlock()
	return s.writing.byKey[d.key] == d
}

// currentOf is the key's current demotion, nil when none.
func (s *Service) currentOf(k index.Key) *demotion {
	s.writing.Lock()
	defer s.writing.Unlock()
	return s.writing.byKey[k]
}

// endDemotion forgets d once it is over. A map keeps the room it grew
// to, so once a burst's demotions are all over (tens of thousands: the
// queue and the batches in flight) it is made again: that room was 5 to
// 16 B per block of a 10^5-block daemon at rest.
func (s *Service) endDemotion(d *demotion) {
	s.writing.Lock()
	if s.writing.byKey[d.key] == d {
		delete(s.writing.byKey, d.key)
		if len(s.writing.byKey) == 0 && s.writing.peak > writingKeep {
			s.writing.byKey, s.writing.peak = make(map[index.Key]*demotion), 0
		}
	}
	s.writing.Unlock()
}

// writingKeep is the most demotions whose room writing.byKey keeps once
// they are over.
const writingKeep = 1024

// demoter writes queued blocks to disk in batches until the service stops.
func (s *Service) demoter() {
	defer s.reaper.Done()
	batch := make([]*demotion, 0, 256)
	q := s.demotions
	for {
		batch = batch[:0]
	fill:
		for len(batch) < cap(batch) {
			select {
			case d := <-q.ch:
				batch = append(batch, d)
			default:
				break fill
			}
		}
		// The overflow grows only while the channel is full: when both
		// are empty, the next demotion comes through the channel.
		batch = q.take(batch, cap(batch))
		if len(batch) == 0 {
			select {
			case d := <-q.ch:
				batch = append(batch, d)
			case <-s.stop:
				return
			}
		}
		s.writeDemotions(batch)
	}
}

func (s *Service) writeDemotions(batch []*demotion) {
	byClass := map[*slots.Class][]index.Key{}
	classes := make([]*slots.Class, len(batch))
	for i, d := range batch {
		if ns := s.nsByID(d.key.NS); ns != nil && s.current(d) {
			c := ns.diskClasses[d.key.Group]
			classes[i] = c
			byClass[c] = append(byClass[c], d.key)
		}
	}
	for c, keys := range byClass {
		c.Admit(keys)
	}
	for i, d := range batch {
		c := classes[i]
		dslot := index.NoSlot
		result := "rejected"
		// Fed on demand: a burst of demotions waits here, not in the
		// files' queues, and before the lock below, which Invalidate
		// (and with it the Lookups that take leases) would wait behind.
		// (At shutdown the write goes in regardless; the tier's Close
		// drains or refuses it.)
		s.disk.WaitWriteRoom(s.writeRoom, s.stop)
		// From the check that its entry is current to the submission of
		// its write, an Invalidate waits: it names the disk's writes so
		// far as invalidated (marks.go), and none of the entry's is left
		// to come after.
		s.inval.RLock()
		s.ix.Mutate(&d.key, func(e *index.Entry, found bool) bool {
			switch {
			case !found:
				return false
			case c == nil || !s.current(d):
				// Its entry was removed while it waited; that entry's
				// remover let go of the CPU copy.
				return true
			case e.Flags&index.DiskWriting == 0:
				// the disk policy declined it
			case e.Flags&index.DiskEvicted != 0:
				// The policy evicted it again before it took a slot
				// (another key of the batch won it): a slot now would
				// be room the policy does not count.
				e.Flags &^= index.DiskWriting | index.DiskEvicted
			default:
				if sl, ok := c.Alloc(); ok {
					dslot = sl
					d.dslot = sl
					return true
				}
				result = "no_space"
				e.Flags &^= index.DiskWriting
			}
			s.dropCPUCopyLocked(e, d)
			return e.Holds()
		})
		if dslot == index.NoSlot {
			s.inval.RUnlock()
			if result == "no_space" {
				s.forgetDisk(c, &d.key)
			}
			s.dm.demotions.WithLabelValues(result).Inc()
			s.endCleaning(d, false)
			s.endDemotion(d)
			s.cpu.Unpin(d.cpuSlot)
			s.diskWrites.Add(-1)
			continue
		}
		m := s.diskMeta(&d.key)
		payload := s.cpu.Slot(d.cpuSlot, layout.AlignUp(m.PayloadLen))
		s.disk.Write(dslot, m, payload, func(err error) { s.demotionDone(d, c, dslot, err) })
		s.inval.RUnlock()
	}
}

// dropCPUCopyLocked lets go of the CPU copy a write-back demotion was for:
// the CPU tier's policy already evicted it.
func (s *Service) dropCPUCopyLocked(e *index.Entry, d *demotion) {
	if !d.keepCPU && e.CPU == d.cpuSlot {
		s.cpu.Release(e.CPU)
		e.CPU = index.NoSlot
	}
}

// demotionDone settles a finished disk write. The key's current demotion
// attaches its slot to the entry, unless the disk policy evicted the block
// meanwhile or the slot's chunk is moving to another slot size. Any slot
// written and not attached is erased: the block must not come back at a
// restart (its entry may have been invalidated).
func (s *Service) demotionDone(d *demotion, c *slots.Class, dslot slots.SlotID, err error) {
	forget, attached, clean := false, false, false
	s.ix.Mutate(&d.key, func(e *index.Entry, found bool) bool {
		if !found || !s.current(d) {
			// Its entry was removed while written; a later entry of the
			// key, if any, is none of this demotion's business.
			return found
		}
		switch {
		case e.Flags&index.DiskWriting == 0:
			// The disk policy declined it while written.
			forget = true
		case err != nil:
			forget = true
		case e.Flags&index.DiskEvicted != 0:
		case s.disk.Draining(dslot):
			forget = true
		default:
			e.Disk = dslot
			attached = true
		}
		e.Flags &^= index.DiskWriting | index.DiskEvicted
		s.dropCPUCopyLocked(e, d)
		clean = attached && e.CPU == d.cpuSlot && e.State == index.Ready
		return e.Holds()
	})
	s.noteWrite(time.Since(d.queued))
	s.endCleaning(d, clean)
	// Forget while the slot still holds the class alive.
	if forget {
		s.forgetDisk(c, &d.key)
	}
	s.endDemotion(d)
	if attached {
		s.disk.Unpin(dslot) // the writer's pin, from Alloc
	} else {
		s.releaseWritten(d, dslot, err)
	}
	s.cpu.Unpin(d.cpuSlot)
	s.diskWrites.Add(-1)
	switch {
	case err != nil:
		s.dm.demotions.WithLabelValues("failed").Inc()
		s.log.Warn("disk write failed; the block's disk copy is dropped", "slot", dslot, "kept_in_cpu", d.keepCPU, "err", err)
	case !attached:
		s.dm.demotions.WithLabelValues("rejected").Inc()
	default:
		s.dm.demotions.WithLabelValues("written").Inc()
	}
}

// releaseWritten lets go of a disk slot a demotion wrote but did not
// attach, and of the writer's pin on it: quarantined if the device failed
// the slot's own write (a bad spot: disk.ShouldQuarantine), erased if the
// write went through (so the block does not come back at a restart), free
// otherwise (ENOSPC, a chunk map that could not be saved, a refused or
// cancelled write: no header was written).
func (s *Service) releaseWritten(d *demotion, dslot slots.SlotID, err error) {
	switch {
	case err != nil && disk.ShouldQuarantine(err):
		s.disk.Quarantine(dslot)
		s.disk.Unpin(dslot)
	case err == nil:
		// Released or not (the policy may have released it while it
		// was written), its header is erased once the writer's pin
		// drops.
		s.disk.Void(dslot)
		s.disk.Unpin(dslot)
	default:
		if !d.released {
			s.disk.Release(dslot)
		}
		s.disk.Unpin(dslot)
	}
}

// onDiskEvict runs on the goroutine of the disk policy's Admit or Learn for
// each key it evicted.
func (s *Service) onDiskEvict(k index.Key) {
	dropped := false
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		if !found {
			return false
		}
		if e.Disk == index.NoSlot {
			if e.Flags&index.DiskWriting != 0 && e.Flags&index.DiskEvicted == 0 {
				e.Flags |= index.DiskEvicted
				// The slot being written is room the policy no longer
				// counts: release it now (the writer's pin keeps it) so
				// the policy's capacity says so.
				if d := s.currentOf(k); d != nil && d.dslot != index.NoSlot && !d.released {
					s.disk.Release(d.dslot)
					d.released = true
				}
			}
			return true
		}
		s.disk.Release(e.Disk)
		e.Disk = index.NoSlot
		dropped = true
		return e.Holds()
	})
	if dropped {
		s.m.evictions.WithLabelValues("disk", "policy").Inc()
		s.c.evictions.Add(1)
	}
}

// onDiskReject runs for a key the disk policy declined: its demotion or
// write-through stops before taking a slot; a block recovery brought back
// (on disk, no write in flight: Learn) leaves the disk, since the policy
// will never evict what it does not track.
func (s *Service) onDiskReject(k index.Key) {
	s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
		switch {
		case !found:
		case e.Disk == index.NoSlot:
			e.Flags &^= index.DiskWriting
		case e.Flags&index.DiskWriting == 0:
			s.disk.Release(e.Disk)
			e.Disk = index.NoSlot
			return e.Holds()
		}
		return found
	})
}

// onDiskEvictRange drops the disk copies in a chunk the disk tier is moving
// to another slot size.
func (s *Service) onDiskEvictRange(lo, hi slots.SlotID) {
	s.evictRange("disk", s.disk.Space, lo, hi, func(e *index.Entry) *uint32 { return &e.Disk },
		func(ns *Namespace) []*slots.Class { return ns.diskClasses })
}

// dropQueuedDemotions undoes demotions still queued when the service stops:
// the CPU tier is about to go, so write-back copies are simply dropped.
func (s *Service) dropQueuedDemotions() {
	for {
		var d *demotion
		select {
		case d = <-s.demotions.ch:
		default:
			if over := s.demotions.take(nil, 1); len(over) > 0 {
				d = over[0]
			}
		}
		if d == nil {
			return
		}
		s.ix.Mutate(&d.key, func(e *index.Entry, found bool) bool {
			if !found || !s.current(d) {
				return found
			}
			e.Flags &^= index.DiskWriting | index.DiskEvicted
			s.dropCPUCopyLocked(e, d)
			return e.Holds()
		})
		s.endCleaning(d, false)
		s.endDemotion(d)
		s.cpu.Unpin(d.cpuSlot)
		s.diskWrites.Add(-1)
	}
}

// FlushDisk waits until every block queued for the disk tier has been
// written (or failed) and every erased slot's header is zeroed, or ctx
// ends. Tests and benchmarks use it to know what the disk holds.
func (s *Service) FlushDisk(ctx context.Context) error {
	for s.diskWrites.Load() > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// stageWait bounds how long a load waits for a CPU slot to read a disk
// block into before it reports the block NO_SPACE (the engine recomputes).
const stageWait = 50 * time.Millisecond

// stageReq is a disk read of a load waiting for a CPU slot.
type stageReq struct {
	lj       *loadJob
	rd       diskRead
	c        *slots.Class
	deadline time.Time
}

// stageLater hands a read to the stager, or fails it NO_SPACE at once when
// the stager's queue is full.
func (s *Service) stageLater(req stageReq) {
	select {
	case s.staging <- req:
	default:
		req.lj.readDone(req.rd, index.NoSlot, nil)
	}
}

// stager gives waiting disk reads CPU slots as they free up, in order,
// each until its deadline. It stops when the service closes (every job has
// drained by then, so nothing waits).
func (s *Service) stager() {
	defer s.reaper.Done()
	for {
		select {
		case req := <-s.staging:
			for {
				if slot, ok := s.allocCPU(req.c, pollTries, true); ok {
					req.lj.read(req.rd, slot)
					break
				}
				if time.Now().After(req.deadline) {
					req.lj.readDone(req.rd, index.NoSlot, nil)
					break
				}
				select {
				case <-time.After(200 * time.Microsecond):
				case <-s.stop:
					req.lj.readDone(req.rd, index.NoSlot, nil)
					return
				}
			}
		case <-s.stop:
			return
		}
	}
}
