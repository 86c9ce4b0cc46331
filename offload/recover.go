package offload

import (
	"fmt"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
)

// The service's side of the disk tier's recovery. The daemon serves as
// soon as the disk tier is open; recovery brings the blocks of its files
// online in the background, chunk by chunk (tiers/disk/recover.go). A
// recovered block enters the index Ready with its disk slot, exactly as a
// demoted one would, so everything else (Lookup, Load, eviction) treats it
// like any other. Three things happen while recovery runs:
//
//   - A key stored again before recovery reaches its old copy: the index
//     has it already, so the old copy attaches to the entry as its disk
//     copy when the entry has none, or is declined (its slot is free
//     space).
//   - A key invalidated before recovery reaches its old copy: the
//     invalidation leaves a tombstone, and the old copy is erased (its
//     header zeroed) instead of coming back, now or at a later start.
//   - Stores need disk slots: the disk tier never hands out one in a
//     chunk recovery has not scanned.

// recovery is the service's state of the disk tier's recovery.
type recovery struct {
	byDigest map[[32]byte]*Namespace // the catalog's namespaces, fixed at start
	done     chan struct{}           // closed when recovery ends
	epoch    uint32                  // the disk tier's write epoch of this run

	tombs index.Tombstones // what Invalidates dropped while it runs
}

// startRecovery brings back the namespaces of the disk tier's catalog and
// starts the recovery of its blocks. It returns at once.
func (s *Service) startRecovery(t *disk.Tier) error {
	rec := &s.rec
	rec.done = make(chan struct{})
	rec.epoch = uint32(t.WriteClock() >> 32)
	rec.byDigest = map[[32]byte]*Namespace{}
	catalog := s.readCatalog(t.Namespaces(), "disk tier")
	s.mu.Lock()
	for _, ce := range catalog {
		d := ce.digest
		ns, err := s.newNamespaceLocked(ce.fingerprint, ce.layout)
		if err != nil {
			s.log.Error("disk tier: a namespace in the catalog does not fit this daemon; its blocks will not come back", "digest", fmt.Sprintf("%x", d[:8]), "err", err)
			continue
		}
		// Not swept while recovery may still file its blocks.
		ns.recovering = true
		if ns.marks, err = decodeMarks(ce.meta); err != nil {
			// Unreadable marks could let invalidated blocks back:
			// take the namespace as invalidated whole before now.
			s.log.Error("disk tier: a namespace's invalidation marks are unreadable; its blocks on disk are dropped", "namespace", ns.ID, "err", err)
			ns.marks = marks{all: t.WriteClock() + 1}
		}
		rec.byDigest[d] = ns
	}
	s.mu.Unlock()
	rec.tombs.Start()
	return t.Recover(disk.Recoverer{Key: s.recoveredKey, File: s.fileRecovered, Done: s.recoveryDone})
}

// recoveredKey names a block found on disk, if its namespace is in the
// catalog and its shape fits the namespace's layout.
func (s *Service) recoveredKey(r disk.Recovered) (index.Key, bool) {
	ns := s.rec.byDigest[r.NS]
	if ns == nil || r.Group >= ns.Layout.NumGroups() || r.HashLen != ns.Layout.HashBytes || r.PayloadLen != ns.Layout.PayloadBytes(r.Group) {
		return index.Key{}, false
	}
	return makeKey(ns.ID, r.Group, r.Hash[:r.HashLen]), true
}

// fileRecovered files the blocks recovery verified in one chunk: each
// enters the index Ready on disk, attaches to an entry that has no disk
// copy, is erased if its key was invalidated since the start, or is
// declined. The ones kept are then put under the disk policy. A chunk of
// small blocks holds thousands, so the work is done per chunk: one look at
// the marks, one index batch (each shard's lock once), one Learn, one
// index batch to check the kept ones are still there (issue 34, item 6).
func (s *Service) fileRecovered(blocks []disk.Recovered, keys []index.Key) []disk.Verdict {
	verdicts := make([]disk.Verdict, len(blocks))
	// Invalidated in an earlier run, or in this one before now: its mark
	// in the catalog (marks.go). An Invalidate running now is ordered by
	// the tombstone, checked below under the key's lock.
	marked := make([]bool, len(blocks))
	s.marksMu.Lock()
	for i := range blocks {
		if ns := s.rec.byDigest[blocks[i].NS]; ns != nil {
			marked[i] = ns.marks.covers(&keys[i], blocks[i].Write)
		}
	}
	s.marksMu.Unlock()
	// A chunk serves one slot size, so one class, whatever namespaces its
	// blocks belong to. Its Forget count before the blocks are filed
	// tells, after Learn, whether one of them may have gone meanwhile.
	c, err := s.disk.Class(disk.SlotBytes(blocks[0].PayloadLen))
	if err != nil { // cannot happen: the tier adopted the chunk into it
		s.log.Error("disk tier: recovered blocks left out of the disk policy", "err", err)
	} else {
		defer c.Drop() // the blocks' slots keep the class alive
	}
	var forgets uint64
	if c != nil {
		forgets = c.Forgets()
	}
	var cleaned []int
	kept := 0
	s.ix.MutateBatch(keys, func(i int, e *index.Entry, found bool) bool {
		switch {
		case marked[i], s.rec.tombs.Has(&keys[i]):
			verdicts[i] = disk.Erase
		case !found:
			e.State, e.Disk, e.CPU = index.Ready, blocks[i].Slot, index.NoSlot
			verdicts[i] = disk.Keep
			kept++
			return true
		case e.State == index.Ready && e.Disk == index.NoSlot && e.Flags&index.DiskWriting == 0:
			// Stored again before recovery got here (or its CPU copy
			// came back from the arena): this is its disk copy, no
			// demotion needed, and the CPU copy is clean.
			e.Disk = blocks[i].Slot
			verdicts[i] = disk.Keep
			kept++
			if e.CPU != index.NoSlot {
				cleaned = append(cleaned, i)
			}
		default:
			// The key has its disk copy already (stored again and
			// written while recovery ran, or another copy of it came
			// back first), or is being stored: this copy's slot is
			// free space.
			verdicts[i] = disk.Decline
		}
		return found
	})
	for _, i := range cleaned {
		if ns := s.rec.byDigest[blocks[i].NS]; ns != nil {
			s.noteClean(ns.classes[keys[i].Group], keys[i])
		}
	}
	if kept == 0 || c == nil {
		return verdicts
	}
	// Under the policy only now, with the entries in the index (its
	// Evict must find them). An entry that went meanwhile (invalidated,
	// a failed read) was forgotten by whoever dropped it, after it left
	// the index and maybe before Learn: forget it again so the policy
	// counts no slot that is free. Without a Forget of the class since
	// the count above, none went before Learn, and the second look at
	// the index is spared (a Forget that comes later comes after Learn).
	ks := make([]index.Key, 0, kept)
	at := make([]int, 0, kept)
	for i, v := range verdicts {
		if v == disk.Keep {
			ks, at = append(ks, keys[i]), append(at, i)
		}
	}
	c.Learn(ks)
	if c.Forgets() == forgets {
		return verdicts
	}
	var gone []int
	s.ix.MutateBatch(ks, func(j int, e *index.Entry, found bool) bool {
		if !found || e.Disk != blocks[at[j]].Slot {
			gone = append(gone, j)
		}
		return found
	})
	for _, j := range gone {
		s.forgetDisk(c, &ks[j])
	}
	return verdicts
}

// recoveryDone runs when recovery ends: the tombstones go, and the
// namespaces of the catalog may be swept from now on like any other (their
// linger starts now).
func (s *Service) recoveryDone(st disk.RecoveryStats) {
	s.rec.tombs.Stop()
	s.mu.Lock()
	now := time.Now()
	for _, ns := range s.rec.byDigest {
		ns.recovering = false
		ns.idleSince = now
	}
	s.mu.Unlock()
	if st.State == disk.RecoveryDone {
		// Every chunk was looked at. The marks of earlier runs have done
		// their work only if every slot was read, every copy they cover
		// was erased, and the erasures are durable: a slot unreadable
		// now (a transient EIO) may hold an intact copy the next start
		// reads, and an erase still in a volatile cache comes back after
		// a power loss.
		if st.Missed > 0 || st.EraseFailed > 0 {
			s.log.Warn("disk tier: recovery could not read or erase every copy; the invalidation marks stay for the next start",
				"unread_slots", st.Missed, "erases_failed", st.EraseFailed)
		} else if err := s.disk.Sync(); err != nil {
			s.log.Warn("disk tier: recovery's erasures could not be synced; the invalidation marks stay for the next start", "err", err)
		} else {
			s.pruneMarks(s.rec.epoch)
		}
	}
	s.log.Info("disk tier: index rebuilt from the slot files", "state", st.State, "blocks", st.Blocks,
		"namespaces", len(s.rec.byDigest), "took", st.Elapsed)
	close(s.rec.done)
}

// DiskRecovered is closed once the disk tier's recovery has ended (at
// once without a disk tier).
func (s *Service) DiskRecovered() <-chan struct{} { return s.rec.done }

// DiskRecovery reports the disk tier's recovery; ok is false without a
// disk tier.
func (s *Service) DiskRecovery() (st disk.RecoveryStats, ok bool) {
	if s.disk == nil {
		return disk.RecoveryStats{}, false
	}
	return s.disk.Recovery(), true
}
