package offload

import (
	"encoding/json"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The service's side of the CPU tier's persistent arena (--cpu-arena-dir,
// tiers/cpu/persist.go). Each store writes its slot's record as the block
// becomes ready (recordStored); every slot the index lets go of loses its
// record (slots.Config.Released). After a restart on the same arena file
// the daemon serves at once, every chunk held, and recoverCPU brings the
// blocks back in the background, like the disk tier's recovery
// (recover.go):
//
//  1. It reads every record (not the payloads): chunks with none go back
//     to the free chunks at once, so stores find room; for a key named by
//     more than one record the newest wins.
//  2. Chunk by chunk it verifies each block's payload against its
//     record's xxh3, gives the chunk to the class of its slot size
//     (Adopt) and files each verified block in the index Ready in the CPU
//     tier, under the key's lock. Nothing reaches the index, and so no
//     Lookup offers it, before its payload has verified.
//
// A block stored again before recovery reaches its old copy keeps the new
// copy (the old slot is released); one invalidated since the start has
// its record cleared before the Invalidate answers and is released
// instead of filed (the ledger, cpu_ledger.go); one
// invalidated before the restart has no record (Invalidate released its slot, which cleared
// it), so it cannot come back. A recovered block belongs to its
// namespace's fingerprint: the namespaces of the arena's catalog are
// created at start (or found, when the disk tier's catalog brought them
// back already) and an engine that registers the same fingerprint joins
// them, as after a disk recovery.

// CPU recovery states, as kvoffload_cpu_recovery_state reports them.
const (
	cpuRecoveryNone    = 0 // no persistent arena, or nothing to recover
	cpuRecoveryRunning = 1
	cpuRecoveryDone    = 2
	cpuRecoveryStopped = 3 // the daemon stopped before it was done
)

// cpuRecovery is the state of the CPU tier's recovery.
type cpuRecovery struct {
	done     chan struct{}
	byDigest map[[32]byte]*Namespace // the arena catalog's namespaces, fixed at start
	state    atomic.Int32
	blocks   atomic.Uint64 // filed in the index
	bad      atomic.Uint64 // records dropped: damaged, torn, stale, failed verification
	took     atomic.Int64  // nanoseconds, once done
	hook     func()        // Config.CPURecoveryHook

	cpuLedger // the records not filed yet, and what Invalidates dropped while it runs (cpu_ledger.go)

	// The arena's namespace catalog: catMu orders its writes (taken
	// before s.mu, never under it, so no Lookup waits for the file);
	// stale says a namespace was dropped since the last whole rewrite.
	catMu sync.Mutex
	stale atomic.Bool
}

// newCPUTier maps the CPU tier's arena: private, or in dir's arena file.
func newCPUTier(cc cpu.Config, dir string) (*cpu.Tier, error) {
	if dir == "" {
		return cpu.New(cc)
	}
	return cpu.NewPersistent(cc, dir)
}

// startCPURecovery records the service's namespaces in the arena's catalog
// and, when the arena was re-attached, creates the namespaces of its
// catalog, holds every chunk and starts recoverCPU. Call it after the disk
// tier is open (its catalog's namespaces are the same ones) and before
// anything can take a CPU slot. It returns at once.
func (s *Service) startCPURecovery(reg prometheus.Registerer, hook func()) {
	rec := &s.crec
	rec.hook = hook
	rec.done = make(chan struct{})
	rec.byDigest = map[[32]byte]*Namespace{}
	s.registerCPURecoveryGauges(reg)
	if !s.cpu.Persistent() {
		close(rec.done)
		return
	}
	catalog := s.readCatalog(s.cpu.Namespaces(), "cpu tier (arena)")
	s.mu.Lock()
	for _, ce := range catalog {
		d, fp, l := ce.digest, ce.fingerprint, ce.layout
		ns, ok := s.mu.byPrint[string(fp)]
		switch {
		case ok && !ns.Layout.Equal(l):
			s.log.Error("cpu tier: a namespace in the arena's catalog has another layout than the disk tier's; its blocks in the arena will not come back", "namespace", ns.ID)
			continue
		case !ok:
			var err error
			if ns, err = s.newNamespaceLocked(fp, l); err != nil {
				s.log.Error("cpu tier: a namespace in the arena's catalog does not fit this daemon; its blocks will not come back", "digest", fmt.Sprintf("%x", d[:8]), "err", err)
				continue
			}
			// Its blocks may go to disk: the disk tier must be able to
			// name it after a restart too.
			if err := s.saveNamespace(ns); err != nil {
				s.log.Warn("cpu tier: a namespace brought back from the arena could not be recorded in the disk tier's catalog", "namespace", ns.ID, "err", err)
			}
		}
		// Not swept while recovery may still file its blocks.
		ns.cpuRecovering = true
		rec.byDigest[d] = ns
	}
	s.mu.Unlock()
	// Every namespace the service knows now (the disk tier's too): a
	// record names its namespace by digest, and the next start must find
	// it in this catalog.
	s.saveCPUNamespaces(true)
	if !s.cpu.Attached() {
		close(rec.done)
		return
	}
	chunks := make([]uint32, s.cpu.Capacity()/s.cpu.ChunkBytes())
	for i := range chunks {
		chunks[i] = uint32(i)
	}
	if err := s.cpu.Hold(chunks); err != nil { // cannot happen: nothing is allocated yet
		s.log.Error("cpu tier: the arena's blocks will not come back", "err", err)
		s.cpuRecoveryEnded(cpuRecoveryStopped, time.Now())
		return
	}
	rec.state.Store(cpuRecoveryRunning)
	rec.cpuLedger.begin(s.cpu.ClearRecord)
	s.log.Info("cpu tier: recovering the arena's blocks in the background", "dir", s.cpu.ArenaDir(), "namespaces", len(rec.byDigest))
	s.reaper.Add(1)
	go s.recoverCPU()
}

// saveCPUNamespaces records the service's namespaces in the arena's
// catalog (keepOnly: only those, so the file holds no more entries than
// the daemon keeps namespaces, Limits.MaxNamespacesTotal). A failure costs
// their blocks after a restart, nothing now: logged.
func (s *Service) saveCPUNamespaces(keepOnly bool) {
	if !s.cpu.Persistent() {
		return
	}
	// The file is written under catMu, not s.mu: a namespace made after
	// the snapshot is saved after this write (saveCPUNamespace waits for
	// catMu), one made before is in it.
	s.crec.catMu.Lock()
	defer s.crec.catMu.Unlock()
	if keepOnly {
		s.crec.stale.Store(false)
	}
	s.mu.Lock()
	metas := make(map[[32]byte][]byte, len(s.mu.byID))
	for _, ns := range s.mu.byID {
		metas[digestOf(ns.Fingerprint)] = cpuMeta(ns)
	}
	s.mu.Unlock()
	if err := s.cpu.SaveNamespaces(metas, keepOnly); err != nil {
		s.log.Warn("the CPU tier's blocks will not come back after a restart", "err", err)
	}
}

// saveCPUNamespace records a new namespace in the arena's catalog (after
// a namespace was dropped, the whole catalog, without it). The caller
// does not hold s.mu, and no store of ns has completed yet.
func (s *Service) saveCPUNamespace(ns *Namespace) {
	if !s.cpu.Persistent() {
		return
	}
	if s.crec.stale.Load() {
		s.saveCPUNamespaces(true)
		return
	}
	s.crec.catMu.Lock()
	defer s.crec.catMu.Unlock()
	if err := s.cpu.SaveNamespaces(map[[32]byte][]byte{digestOf(ns.Fingerprint): cpuMeta(ns)}, false); err != nil {
		s.log.Warn("a namespace's CPU-tier blocks will not come back after a restart", "namespace", ns.ID, "err", err)
	}
}

// compactCPUCatalog rewrites the arena's catalog without the namespaces
// dropped since its last rewrite (they hold no block, so no record).
func (s *Service) compactCPUCatalog() {
	if s.cpu.Persistent() && s.crec.stale.Load() {
		s.saveCPUNamespaces(true)
	}
}

// cpuMeta is ns's catalog entry, in the disk tier's encoding, without its
// invalidation marks (no use to the arena: an invalidated block's record
// is gone), so an entry stays within its fingerprint and layout.
func cpuMeta(ns *Namespace) []byte {
	m := namespaceMeta{Fingerprint: ns.Fingerprint, HashBytes: ns.Layout.HashBytes}
	for _, sg := range ns.Layout.Segments {
		m.Segments = append(m.Segments, [2]uint64{uint64(sg.Group), sg.Bytes})
	}
	b, _ := json.Marshal(m)
	return b
}

// storedSum is the checksum of a stored block's payload in slot, for its
// record (0, false without a persistent arena). The store's copies have
// drained and it holds the slot's pin, so the bytes cannot change.
func (s *Service) storedSum(ns *Namespace, group uint32, slot cpu.SlotID) (uint64, bool) {
	if !s.cpu.Persistent() {
		return 0, false
	}
	return cpu.Checksum(s.cpu.Slot(slot, ns.Layout.PayloadBytes(group))), true
}

// recordStored writes the record of a block that just became ready in
// slot; the caller holds the key's index lock.
func (s *Service) recordStored(ns *Namespace, k *index.Key, slot cpu.SlotID, sum uint64) {
	b := cpu.Block{Namespace: digestOf(ns.Fingerprint), Group: k.Group, Hash: k.Hash[:ns.Layout.HashBytes],
		PayloadLen: ns.Layout.PayloadBytes(k.Group), PayloadSum: sum}
	if err := s.cpu.WriteRecord(slot, b); err != nil { // cannot happen: the layout bounds both
		s.log.Warn("cpu tier: a block's record could not be written; it will not come back after a restart", "err", err)
	}
}

// cpuFound is a record recovery found, with its key.
type cpuFound struct {
	cpu.Found
	key index.Key
	ns  *Namespace
}

// recoverCPU brings the arena's blocks back (see above) until done or the
// service stops.
func (s *Service) recoverCPU() {
	defer s.reaper.Done()
	start := time.Now()
	rec := &s.crec
	chunks := uint32(s.cpu.Capacity() / s.cpu.ChunkBytes())
	byChunk := make([][]cpuFound, chunks)
	newest := map[index.Key]cpuFound{}
	for ch := range chunks {
		found, bad := s.cpu.ScanRecords(ch)
		rec.bad.Add(uint64(bad))
		for _, f := range found {
			cf, ok := s.cpuRecoveredKey(f)
			if !ok {
				s.cpu.ClearRecord(f.Slot)
				rec.bad.Add(1)
				continue
			}
			if o, dup := newest[cf.key]; dup {
				loser := cf
				if cf.Newer(o.Header) {
					loser = o
					newest[cf.key] = cf
				}
				s.cpu.ClearRecord(loser.Slot)
				continue
			}
			newest[cf.key] = cf
		}
	}
	for _, cf := range newest {
		ch, _ := s.cpu.ChunkOf(cf.Slot)
		byChunk[ch] = append(byChunk[ch], cf)
	}
	// From here an Invalidate clears the records it names itself.
	rec.scanDone(newest)
	newest = nil
	// Empty chunks first: stores get room at once.
	for ch := range chunks {
		if len(byChunk[ch]) == 0 {
			s.unholdCPU(ch)
		}
	}
	// Chunks are independent (each its own slots, records and keys: a
	// key is in one chunk after the newest-wins pass): verifiers take
	// them in order, so hashing runs on several cores where the daemon
	// has them and leaves the rest to serving.
	next := make(chan uint32)
	var stopped atomic.Bool
	var wg sync.WaitGroup
	for range cpuVerifiers() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ch := range next {
				if rec.hook != nil {
					rec.hook()
				}
				s.recoverCPUChunk(ch, byChunk[ch])
				byChunk[ch] = nil
			}
		}()
	}
feed:
	for ch := range chunks {
		if len(byChunk[ch]) == 0 {
			continue
		}
		select {
		case next <- ch:
		case <-s.stop:
			stopped.Store(true)
			break feed
		}
	}
	close(next)
	wg.Wait()
	if stopped.Load() {
		s.cpuRecoveryEnded(cpuRecoveryStopped, start)
		return
	}
	s.cpuRecoveryEnded(cpuRecoveryDone, start)
}

// cpuVerifiers is how many chunks recovery verifies at once: half the
// daemon's Go processors, at least one, at most four.
func cpuVerifiers() int { return min(4, max(1, runtime.GOMAXPROCS(0)/2)) }

// cpuRecoveredKey names the block of a record, if its namespace is in the
// catalog and its shape fits the namespace's layout.
func (s *Service) cpuRecoveredKey(f cpu.Found) (cpuFound, bool) {
	ns := s.crec.byDigest[f.Namespace]
	if ns == nil || f.Group >= ns.Layout.NumGroups() || int(f.HashLen) != ns.Layout.HashBytes || f.PayloadLen != ns.Layout.PayloadBytes(f.Group) {
		return cpuFound{}, false
	}
	return cpuFound{Found: f, key: makeKey(ns.ID, f.Group, f.Key()), ns: ns}, true
}

// unholdCPU gives a held chunk recovery keeps nothing of back to the free
// chunks, its records cleared.
func (s *Service) unholdCPU(ch uint32) {
	per := cpu.SlotID(s.cpu.ChunkBytes() / layout.SlotAlign)
	for sl := cpu.SlotID(ch) * per; sl < cpu.SlotID(ch+1)*per; sl++ {
		s.cpu.ClearRecord(sl)
	}
	if err := s.cpu.Unhold(ch); err != nil {
		s.log.Error("cpu tier: a chunk recovery held stays out of use", "chunk", ch, "err", err)
	}
}

// recoverCPUChunk verifies the blocks found in chunk ch and files them.
func (s *Service) recoverCPUChunk(ch uint32, found []cpuFound) {
	rec := &s.crec
	// The chunk's slot size: every record in it names one (a slot's
	// record is cleared before its chunk can change size); should they
	// disagree, the size most of them name.
	bySize := map[uint64]int{}
	slotBytes := uint64(0)
	for _, f := range found {
		sz := f.ns.Layout.SlotBytes(f.Group)
		if bySize[sz]++; bySize[sz] > bySize[slotBytes] {
			slotBytes = sz
		}
	}
	base := cpu.SlotID(uint64(ch) * s.cpu.ChunkBytes() / layout.SlotAlign)
	step := cpu.SlotID(slotBytes / layout.SlotAlign)
	good := found[:0]
	for _, f := range found {
		// One slot size per chunk, at its stride: a record that does
		// not fit the chunk's slots is not one of them.
		if f.ns.Layout.SlotBytes(f.Group) != slotBytes || (f.Slot-base)%step != 0 {
			rec.settled(&f.key)
			s.cpu.ClearRecord(f.Slot)
			rec.bad.Add(1)
			continue
		}
		if err := s.cpu.VerifyRecord(f.Found); err != nil {
			s.log.Warn("cpu tier: a block in the arena failed verification; it is dropped", "slot", f.Slot, "err", err)
			rec.settled(&f.key)
			s.cpu.ClearRecord(f.Slot)
			rec.bad.Add(1)
			continue
		}
		good = append(good, f)
	}
	if len(good) == 0 {
		s.unholdCPU(ch)
		return
	}
	c, err := s.cpu.Class(slotBytes)
	if err != nil {
		s.log.Error("cpu tier: the arena's blocks of a chunk will not come back", "chunk", ch, "slot_bytes", slotBytes, "err", err)
		rec.settledAll(good)
		s.unholdCPU(ch)
		return
	}
	defer c.Drop() // the blocks' slots keep the class alive
	used := make([]slots.SlotID, len(good))
	for i, f := range good {
		used[i] = f.Slot
	}
	// Slots other than these are free from here on: their records go.
	keep := make(map[cpu.SlotID]bool, len(used))
	for _, sl := range used {
		keep[sl] = true
	}
	for sl := base; sl < base+cpu.SlotID(s.cpu.ChunkBytes()/layout.SlotAlign); sl++ {
		if !keep[sl] {
			s.cpu.ClearRecord(sl)
		}
	}
	if err := c.Adopt(ch, used); err != nil {
		s.log.Error("cpu tier: the arena's blocks of a chunk will not come back", "chunk", ch, "err", err)
		rec.settledAll(good)
		s.unholdCPU(ch)
		return
	}
	var kept []index.Key
	var keptSlots []cpu.SlotID
	for _, f := range good {
		k := f.key
		keep := false
		s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
			// Under the key's lock: an Invalidate that comes after finds
			// the entry (and releases its slot, clearing the record).
			rec.settled(&k)
			switch {
			case rec.invalidated(&k):
			case !found:
				e.State, e.CPU, e.Disk = index.Ready, f.Slot, index.NoSlot
				keep = true
				return true
			case e.State == index.Ready && e.CPU == index.NoSlot && e.Flags&(index.DiskWriting|index.Spill) == 0:
				// Brought back from disk (or stored again and demoted)
				// before recovery got here: this is its CPU copy.
				e.CPU = f.Slot
				keep = true
			}
			if !keep {
				// Stored again meanwhile, or invalidated: the old copy
				// goes, its record with it.
				s.cpu.Release(f.Slot)
			}
			return found
		})
		if keep {
			kept = append(kept, k)
			keptSlots = append(keptSlots, f.Slot)
		}
	}
	// Under the policy only now, with the entries in the index (its
	// Evict must find them); an entry that went meanwhile is forgotten
	// again, as after a disk recovery.
	c.Learn(kept)
	for i := range kept {
		if e, ok := s.ix.Get(&kept[i]); !ok || e.CPU != keptSlots[i] {
			c.Forget(&kept[i])
		} else if s.disk != nil && e.Disk == index.NoSlot {
			s.noteDirty(c, kept[i])
		} else if e.Disk != index.NoSlot {
			// On disk too (the disk tier's recovery got there first):
			// a clean copy a store may drop for its slot.
			s.noteClean(c, kept[i])
		}
	}
	rec.blocks.Add(uint64(len(kept)))
}

// cpuRecoveryEnded ends the recovery: the ledger goes (once done), the catalog's
// namespaces may be swept from now on, and the arena's catalog keeps the
// namespaces there are.
func (s *Service) cpuRecoveryEnded(state int32, start time.Time) {
	rec := &s.crec
	if state == cpuRecoveryDone {
		rec.cpuLedger.end()
	}
	took := time.Since(start)
	rec.took.Store(int64(took))
	s.mu.Lock()
	now := time.Now()
	for _, ns := range rec.byDigest {
		ns.cpuRecovering = false
		ns.idleSince = now
	}
	s.mu.Unlock()
	if state == cpuRecoveryDone {
		s.saveCPUNamespaces(true)
	}
	rec.state.Store(state)
	s.log.Info("cpu tier: blocks recovered from the arena", "done", state == cpuRecoveryDone, "blocks", rec.blocks.Load(),
		"dropped", rec.bad.Load(), "namespaces", len(rec.byDigest), "took", took.Round(time.Microsecond))
	close(rec.done)
}

// CPURecovered is closed once the CPU tier's recovery has ended (at once
// without a persistent arena, or with one that held nothing).
func (s *Service) CPURecovered() <-chan struct{} { return s.crec.done }

// CPURecoveryStats are the CPU tier's recovery's counts so far.
type CPURecoveryStats struct {
	State   int32 // 0 none, 1 running, 2 done, 3 stopped
	Blocks  uint64
	Dropped uint64
	Took    time.Duration
}

// CPURecovery reports the CPU tier's recovery.
func (s *Service) CPURecovery() CPURecoveryStats {
	r := &s.crec
	return CPURecoveryStats{State: r.state.Load(), Blocks: r.blocks.Load(), Dropped: r.bad.Load(), Took: time.Duration(r.took.Load())}
}

func (s *Service) registerCPURecoveryGauges(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	reg.MustRegister(cpuRecoveryCollector{&s.crec})
}

// cpuRecoveryCollector reports the recovery's gauges from one reading:
// the state first, then the counts, which are final before the state says
// done. (Separate gauge functions are read in any order, concurrently: a
// scrape could say "done" beside the count from before the last chunk.)
type cpuRecoveryCollector struct{ r *cpuRecovery }

var (
	cpuRecoveryStateDesc = prometheus.NewDesc("kvoffload_cpu_recovery_state",
		"The CPU tier's recovery from a persistent arena (--cpu-arena-dir): 0 none, 1 running, 2 done, 3 stopped by shutdown.", nil, nil)
	cpuRecoveredBlocksDesc = prometheus.NewDesc("kvoffload_cpu_recovered_blocks",
		"Blocks the CPU tier's recovery verified and brought back from the persistent arena.", nil, nil)
	cpuRecoveryDroppedDesc = prometheus.NewDesc("kvoffload_cpu_recovery_dropped_blocks",
		"Records the CPU tier's recovery dropped: damaged or torn, stale, of an unknown namespace, or whose payload failed its checksum.", nil, nil)
	cpuRecoverySecondsDesc = prometheus.NewDesc("kvoffload_cpu_recovery_seconds",
		"How long the CPU tier's recovery took, once it ended.", nil, nil)
)

func (c cpuRecoveryCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- cpuRecoveryStateDesc
	ch <- cpuRecoveredBlocksDesc
	ch <- cpuRecoveryDroppedDesc
	ch <- cpuRecoverySecondsDesc
}

func (c cpuRecoveryCollector) Collect(ch chan<- prometheus.Metric) {
	state := c.r.state.Load()
	blocks, bad, took := c.r.blocks.Load(), c.r.bad.Load(), c.r.took.Load()
	ch <- prometheus.MustNewConstMetric(cpuRecoveryStateDesc, prometheus.GaugeValue, float64(state))
	ch <- prometheus.MustNewConstMetric(cpuRecoveredBlocksDesc, prometheus.GaugeValue, float64(blocks))
	ch <- prometheus.MustNewConstMetric(cpuRecoveryDroppedDesc, prometheus.GaugeValue, float64(bad))
	ch <- prometheus.MustNewConstMetric(cpuRecoverySecondsDesc, prometheus.GaugeValue, time.Duration(took).Seconds())
}
