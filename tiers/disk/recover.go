package disk

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/kvoffloadd/kvoffloadd/index"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// Recovered is a block Recover found intact.
type Recovered struct {
	NS      [32]byte // namespace digest
	Group   uint32
	Hash    [32]byte // the key hash, zero past HashLen
	HashLen int
	// Slot holds the block; PayloadLen is its length, and the slot's
	// class is SlotBytes(PayloadLen).
	Slot       slots.SlotID
	PayloadLen uint64
}

// blockID is a block's identity as a slot header gives it.
type blockID struct {
	ns      [32]byte
	group   uint32
	hashLen uint8
	hash    [32]byte
}

// found is one intact slot seen by the scan.
type found struct {
	id         blockID
	s          slots.SlotID
	slotBytes  uint64
	epoch      uint32
	seq        uint64
	payloadLen uint64
}

func (a *found) newer(b *found) bool {
	if a.epoch != b.epoch {
		return a.epoch > b.epoch
	}
	if a.seq != b.seq {
		return a.seq > b.seq
	}
	return a.s < b.s
}

// scan is what one file's scan found.
type scan struct {
	found              []found
	bad, checksumFails int
	err                error
}

// Recover rebuilds the tier's contents from its files: it reads every
// slot of every chunk the chunk maps name (one goroutine per file, all
// waited for), keeps each slot whose header and payload verify, and for
// each key the newest write ((epoch, seq), see slot.Header.Newer). For
// each such block, in slot order, it calls fn; if fn returns the index key
// the owner filed the block under, the slot is restored in the Space under
// that key (class SlotBytes(PayloadLen), no pins) and Read will serve it;
// if fn returns false, the slot stays free. fn is called before the policy
// learns of the key, so the owner's Evict callback finds its index entry.
// Call Recover once, after Open and before any Alloc or Write. Slots that
// fail verification are free space; their count is logged.
func (t *Tier) Recover(fn func(Recovered) (index.Key, bool)) error {
	if fn == nil {
		return errors.New("disk tier: Recover needs a function to hand blocks to")
	}
	if t.wrote.Load() {
		return errors.New("disk tier: Recover after a Write")
	}
	if !t.recovered.CompareAndSwap(false, true) {
		return errors.New("disk tier: Recover called twice")
	}
	start := time.Now()
	scans := make([]scan, len(t.files))
	var wg sync.WaitGroup
	for i, f := range t.files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			scans[i] = t.scanFile(f)
		}()
	}
	wg.Wait()

	newest := map[blockID]*found{}
	bad, dups := 0, 0
	var errs []error
	for i := range scans {
		sc := &scans[i]
		if sc.err != nil {
			errs = append(errs, sc.err)
		}
		bad += sc.bad
		t.m.checksum.Add(float64(sc.checksumFails))
		for j := range sc.found {
			c := &sc.found[j]
			if o, ok := newest[c.id]; ok {
				dups++
				if !c.newer(o) {
					continue
				}
			}
			newest[c.id] = c
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	keep := make([]*found, 0, len(newest))
	for _, c := range newest {
		keep = append(keep, c)
	}
	sort.Slice(keep, func(i, j int) bool { return keep[i].s < keep[j].s })

	restored, dropped := 0, 0
	for _, c := range keep {
		k, ok := fn(Recovered{NS: c.id.ns, Group: c.id.group, Hash: c.id.hash, HashLen: int(c.id.hashLen), Slot: c.s, PayloadLen: c.payloadLen})
		if !ok {
			dropped++
			continue
		}
		cls, err := t.Class(c.slotBytes)
		if err == nil {
			t.seqs.set(c.s, c.slotBytes, uint64(c.epoch)<<32|c.seq)
			err = cls.Restore(c.s, k)
			// The restored slot keeps the class; its users hold their own
			// references.
			cls.Drop()
		}
		if err != nil {
			return fmt.Errorf("disk tier: recover slot %d: %w", c.s, err)
		}
		restored++
	}
	t.m.recovered.Add(float64(restored))
	t.log.Info("disk tier recovered", "blocks", restored, "bad_slots", bad, "older_copies", dups,
		"dropped_by_owner", dropped, "took", time.Since(start))
	return nil
}

// scanFile reads and verifies every slot of f's mapped chunks into an
// aligned scratch buffer outside the Go heap.
func (t *Tier) scanFile(f *file) (sc scan) {
	f.mapMu.Lock()
	chunks := append([]chunkEntry(nil), f.chunks...)
	f.mapMu.Unlock()
	scratch, err := vfs.AlignedBuffer(int(t.chunkBytes))
	if err != nil {
		sc.err = fmt.Errorf("disk tier: recovery buffer: %w", err)
		return sc
	}
	defer vfs.FreeBuffer(scratch)
	hdr := scratch[:slot.HeaderSize]
	for ci, e := range chunks {
		if e.slotBytes == 0 {
			continue
		}
		for k := uint64(0); k < t.chunkBytes/e.slotBytes; k++ {
			off := uint64(ci)*t.chunkBytes + k*e.slotBytes
			s := slots.SlotID((f.base + off) / layout.SlotAlign)
			c, why := t.checkSlot(f, scratch, hdr, int64(off), s, e)
			switch {
			case why == nil:
				sc.found = append(sc.found, c)
			case errors.Is(why, slot.ErrEmpty):
			default:
				sc.bad++
				if errors.Is(why, slot.ErrHeaderChecksum) || errors.Is(why, slot.ErrPayloadChecksum) {
					sc.checksumFails++
				}
				t.log.Debug("disk tier: slot not recovered", "file", f.f.Name(), "slot", s, "why", why)
			}
		}
	}
	return sc
}

// checkSlot reads the slot s at off, in a chunk of e.slotBytes slots, and
// says why it is not a recoverable block (slot.ErrEmpty: never written).
func (t *Tier) checkSlot(f *file, scratch, hdr []byte, off int64, s slots.SlotID, e chunkEntry) (found, error) {
	if n, err := f.f.ReadAt(hdr, off); n != len(hdr) {
		return found{}, fmt.Errorf("header read: %d bytes: %w", n, err)
	}
	h, err := slot.Decode(hdr)
	if err != nil {
		return found{}, err
	}
	switch {
	case h.Slot != uint64(s):
		return found{}, fmt.Errorf("%w: written for slot %d", slot.ErrMisplaced, h.Slot)
	case SlotBytes(h.PayloadLen) != e.slotBytes:
		return found{}, fmt.Errorf("%w: a %d-byte payload in a chunk of %d-byte slots", slot.ErrLength, h.PayloadLen, e.slotBytes)
	case h.Epoch < e.minEpoch:
		return found{}, fmt.Errorf("%w: written in epoch %d, before the chunk took this slot size in epoch %d", slot.ErrStale, h.Epoch, e.minEpoch)
	case h.Seq == 0 || h.Seq > maxSeq:
		return found{}, fmt.Errorf("%w: sequence number %d out of range", slot.ErrMalformed, h.Seq)
	}
	pay := scratch[slot.HeaderSize : slot.HeaderSize+layout.AlignUp(h.PayloadLen)]
	if n, err := f.f.ReadAt(pay, off+slot.HeaderSize); n != len(pay) {
		return found{}, fmt.Errorf("payload read: %d bytes: %w", n, err)
	}
	if err := slot.VerifyPayload(h, pay[:h.PayloadLen]); err != nil {
		return found{}, err
	}
	return found{id: blockID{ns: h.Namespace, group: h.Group, hashLen: h.HashLen, hash: h.Hash}, s: s,
		slotBytes: e.slotBytes, epoch: h.Epoch, seq: h.Seq, payloadLen: h.PayloadLen}, nil
}
