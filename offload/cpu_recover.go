package offload

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
)

// The service's side of the CPU tier's persistent arena (--cpu-arena-dir,
// tiers/cpu/persist.go). Each store writes its slot's record as the block
// becomes ready (recordStored); every slot the index lets go of loses its
// record (slots.Config.Released). After a restart on the same arena file
// the tier brings the blocks back in the background (tiers/cpu/recover.go)
// and hands each chunk's verified blocks here: fileCPURecovered files
// them in the index Ready in the CPU tier, under the key's lock, and puts
// them under the policies, like the disk tier's recovery (recover.go).
// An Invalidate tells the tier first (cpu.Tier.Invalidating), which clears
// the records of what recovery has not filed before it answers.
//
// A recovered block belongs to its namespace's fingerprint: the
// namespaces of the arena's catalog are created at start (or found, when
// the disk tier's catalog brought them back already) and an engine that
// registers the same fingerprint joins them, as after a disk recovery.

// cpuRecovery is the service's state of the CPU tier's recovery.
type cpuRecovery struct {
	byDigest map[[32]byte]*Namespace // the arena catalog's namespaces, fixed at start
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
// catalog and starts the tier's recovery. Call it after the disk tier is
// open (its catalog's namespaces are the same ones) and before anything
// can take a CPU slot. It returns at once.
func (s *Service) startCPURecovery(reg prometheus.Registerer, hook func()) {
	rec := &s.crec
	rec.byDigest = map[[32]byte]*Namespace{}
	s.registerCPURecoveryGauges(reg)
	if !s.cpu.Persistent() {
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
	s.saveCPUNamespaces()
	if !s.cpu.Attached() {
		return
	}
	if err := s.cpu.Recover(cpu.Recoverer{Key: s.cpuRecoveredKey, File: s.fileCPURecovered, Done: s.cpuRecoveryEnded, Hook: hook}); err != nil {
		s.log.Error("cpu tier: the arena's blocks will not come back", "err", err)
	}
}

// cpuNamespaceMetas is every namespace of the service, as the arena's
// catalog keeps them.
func (s *Service) cpuNamespaceMetas() map[[32]byte][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	metas := make(map[[32]byte][]byte, len(s.mu.byID))
	for _, ns := range s.mu.byID {
		metas[digestOf(ns.Fingerprint)] = cpuMeta(ns)
	}
	return metas
}

// saveCPUNamespaces records the service's namespaces, and only those, in
// the arena's catalog, so the file holds no more entries than the daemon
// keeps namespaces (Limits.MaxNamespacesTotal). A failure costs their
// blocks after a restart, nothing now: logged. The caller does not hold
// s.mu.
func (s *Service) saveCPUNamespaces() {
	if err := s.cpu.SaveNamespaces(s.cpuNamespaceMetas); err != nil {
		s.log.Warn("the CPU tier's blocks will not come back after a restart", "err", err)
	}
}

// saveCPUNamespace records a new namespace in the arena's catalog (after
// a namespace was dropped, the whole catalog, without it). The caller
// does not hold s.mu, and no store of ns has completed yet.
func (s *Service) saveCPUNamespace(ns *Namespace) {
	if err := s.cpu.AddNamespace(digestOf(ns.Fingerprint), cpuMeta(ns), s.cpuNamespaceMetas); err != nil {
		s.log.Warn("a namespace's CPU-tier blocks will not come back after a restart", "namespace", ns.ID, "err", err)
	}
}

// compactCPUCatalog rewrites the arena's catalog without the namespaces
// dropped since its last rewrite (they hold no block, so no record).
func (s *Service) compactCPUCatalog() {
	if err := s.cpu.CompactNamespaces(s.cpuNamespaceMetas); err != nil {
		s.log.Warn("the CPU tier's blocks will not come back after a restart", "err", err)
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

// cpuRecoveredKey names the block of a record, if its namespace is in the
// catalog and its shape fits the namespace's layout.
func (s *Service) cpuRecoveredKey(f cpu.Found) (index.Key, bool) {
	ns := s.crec.byDigest[f.Namespace]
	if ns == nil || f.Group >= ns.Layout.NumGroups() || int(f.HashLen) != ns.Layout.HashBytes || f.PayloadLen != ns.Layout.PayloadBytes(f.Group) {
		return index.Key{}, false
	}
	return makeKey(ns.ID, f.Group, f.Key()), true
}

// fileCPURecovered files the verified blocks of one chunk of the arena
// (their slots adopted into the class of their size): each enters the
// index Ready in the CPU tier, attaches to an entry that has no CPU copy,
// or goes (its slot released, its record with it) when its key was stored
// again or invalidated since the start. The ones kept are then put under
// the policy.
func (s *Service) fileCPURecovered(blocks []cpu.Recovered) int {
	c, err := s.cpu.Class(layout.AlignUp(blocks[0].PayloadLen))
	if err != nil { // cannot happen: the tier adopted the chunk into it
		s.log.Error("cpu tier: recovered blocks left out of the CPU policy", "err", err)
		return 0
	}
	defer c.Drop()
	var kept []index.Key
	var keptSlots []cpu.SlotID
	for _, b := range blocks {
		k := b.Key
		keep := false
		s.ix.Mutate(&k, func(e *index.Entry, found bool) bool {
			// Under the key's lock: an Invalidate that comes after finds
			// the entry (and releases its slot, clearing the record).
			switch {
			case s.cpu.Settle(&k):
			case !found:
				e.State, e.CPU, e.Disk = index.Ready, b.Slot, index.NoSlot
				keep = true
				return true
			case e.State == index.Ready && e.CPU == index.NoSlot && e.Flags&(index.DiskWriting|index.Spill) == 0:
				// Brought back from disk (or stored again and demoted)
				// before recovery got here: this is its CPU copy.
				e.CPU = b.Slot
				keep = true
			}
			if !keep {
				// Stored again meanwhile, or invalidated: the old copy
				// goes, its record with it.
				s.cpu.Release(b.Slot)
			}
			return found
		})
		if keep {
			kept = append(kept, k)
			keptSlots = append(keptSlots, b.Slot)
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
	return len(kept)
}

// cpuRecoveryEnded runs when the tier's recovery ends: the catalog's
// namespaces may be swept from now on, and, once done, the arena's catalog
// keeps the namespaces there are.
func (s *Service) cpuRecoveryEnded(st cpu.RecoveryStats) {
	s.mu.Lock()
	now := time.Now()
	for _, ns := range s.crec.byDigest {
		ns.cpuRecovering = false
		ns.idleSince = now
	}
	s.mu.Unlock()
	if st.State == cpu.RecoveryDone {
		s.saveCPUNamespaces()
	}
	s.log.Info("cpu tier: blocks recovered from the arena", "done", st.State == cpu.RecoveryDone, "blocks", st.Blocks,
		"dropped", st.Dropped, "namespaces", len(s.crec.byDigest), "took", st.Took.Round(time.Microsecond))
}

// CPURecovered is closed once the CPU tier's recovery has ended (at once
// without a persistent arena, or with one that held nothing).
func (s *Service) CPURecovered() <-chan struct{} { return s.cpu.RecoveryDone() }

// CPURecovery reports the CPU tier's recovery.
func (s *Service) CPURecovery() cpu.RecoveryStats { return s.cpu.Recovery() }

func (s *Service) registerCPURecoveryGauges(reg prometheus.Registerer) {
	if reg == nil {
		return
	}
	reg.MustRegister(cpuRecoveryCollector{s.cpu})
}

// cpuRecoveryCollector reports the recovery's gauges from one reading
// (cpu.Tier.Recovery: the state first, then the counts, which are final
// before the state says done). Separate gauge functions are read in any
// order, concurrently: a scrape could say "done" beside the count from
// before the last chunk.
type cpuRecoveryCollector struct{ t *cpu.Tier }

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
	st := c.t.Recovery()
	ch <- prometheus.MustNewConstMetric(cpuRecoveryStateDesc, prometheus.GaugeValue, float64(st.State))
	ch <- prometheus.MustNewConstMetric(cpuRecoveredBlocksDesc, prometheus.GaugeValue, float64(st.Blocks))
	ch <- prometheus.MustNewConstMetric(cpuRecoveryDroppedDesc, prometheus.GaugeValue, float64(st.Dropped))
	ch <- prometheus.MustNewConstMetric(cpuRecoverySecondsDesc, prometheus.GaugeValue, st.Took.Seconds())
}
