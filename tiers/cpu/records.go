package cpu

import (
	"bytes"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/slot"
)

// Slot records of a persistent arena. Record i describes the block in the
// slot that starts at SlotID i (one record per 4 KiB of arena, so a chunk
// may change its slot size without moving records). A record is the first
// RecordBytes of a disk-tier slot header (package tiers/disk/slot, its
// other bytes implied zero, its crc32c computed over all 4096): namespace
// digest, group, key hash, payload length and xxh3-64, epoch and sequence
// number of the write, and the slot it belongs to.
//
// The rules that keep a torn or stale slot from looking valid:
//
//   - A record is written only once the store's copies into the slot have
//     drained, under the block's index lock as it becomes ready (the
//     owner's WriteRecord): a kill -9 mid-copy leaves no record, or the
//     zeros of a cleared one.
//   - A record is cleared when the slot is let go of (slots.Config.Released:
//     Release, ReleaseIdle, Void, Quarantine), before the slot can be
//     handed out again: a slot being written never shows its previous
//     block's record, and a block the index dropped (evicted, invalidated,
//     failed) does not come back.
//   - A record torn by a kill -9 while it was written or cleared fails its
//     crc32c; a payload changed from outside fails its xxh3 at recovery.

// RecordBytes is the size of one slot record.
const RecordBytes = 128

// ErrNotPersistent means the arena has no records: it is private to this
// process.
var ErrNotPersistent = errors.New("cpu tier: the arena is not persistent")

// seqCounter numbers the records of a run.
type seqCounter struct{ n atomic.Uint64 }

func (p *persist) record(s SlotID) []byte {
	off := uint64(s) * RecordBytes
	return p.recs[off : off+RecordBytes : off+RecordBytes]
}

var zeroRecord [RecordBytes]byte

// clearRecord invalidates slot s's record (slots.Config.Released).
func (p *persist) clearRecord(s SlotID) {
	r := p.record(s)
	if !bytes.Equal(r, zeroRecord[:]) {
		clear(r)
	}
}

// Block names a stored block for its record.
type Block struct {
	Namespace  [slot.DigestLen]byte
	Group      uint32
	Hash       []byte
	PayloadLen uint64
	PayloadSum uint64 // Checksum of the payload
}

// Checksum is the payload checksum records carry (xxh3-64, as on disk).
func Checksum(payload []byte) uint64 { return slot.Checksum(payload) }

// WriteRecord writes slot s's record for b, whose payload is in the slot
// and drained. The caller holds the block's index lock and the entry names
// s. Without a persistent arena it does nothing.
func (t *Tier) WriteRecord(s SlotID, b Block) error {
	p := t.persist
	if p == nil {
		return nil
	}
	h := slot.Header{Namespace: b.Namespace, Group: b.Group, PayloadLen: b.PayloadLen, PayloadSum: b.PayloadSum,
		Epoch: p.epoch, Seq: p.seq.n.Add(1), Slot: uint64(s)}
	if err := h.SetHash(b.Hash); err != nil {
		return err
	}
	var buf [slot.HeaderSize]byte
	if err := slot.Encode(h, buf[:]); err != nil {
		return err
	}
	copy(p.record(s), buf[:RecordBytes])
	return nil
}

// Found is a record that decoded: the block its slot held at the last run.
type Found struct {
	Slot SlotID
	slot.Header
}

// scanRecords decodes the records of chunk ch: the ones that name a block,
// and how many were damaged, misplaced or not from an earlier run (these
// are cleared). It reads only the records, not the payloads.
func (t *Tier) scanRecords(ch uint32) (found []Found, bad int) {
	p := t.persist
	if p == nil {
		return nil, 0
	}
	per := SlotID(t.ChunkBytes() / layout.SlotAlign)
	var buf [slot.HeaderSize]byte // past RecordBytes always zero
	for s := SlotID(ch) * per; s < SlotID(ch+1)*per; s++ {
		r := p.record(s)
		if bytes.Equal(r, zeroRecord[:]) {
			continue
		}
		copy(buf[:RecordBytes], r)
		h, err := slot.Decode(buf[:])
		if err == nil && (h.Slot != uint64(s) || h.Epoch >= p.epoch || h.PayloadLen == 0 ||
			Offset(s)+layout.AlignUp(h.PayloadLen) > uint64(SlotID(ch+1)*per)*layout.SlotAlign) {
			err = fmt.Errorf("record of slot %d names slot %d, epoch %d (this run %d), %d payload bytes", s, h.Slot, h.Epoch, p.epoch, h.PayloadLen)
		}
		if err != nil {
			clear(r)
			bad++
			continue
		}
		found = append(found, Found{Slot: s, Header: h})
	}
	return found, bad
}

// verifyRecord checks that f's slot holds the payload its record names.
func (t *Tier) verifyRecord(f Found) error {
	return slot.VerifyPayload(f.Header, t.Slot(f.Slot, f.PayloadLen))
}

// clearRecord invalidates slot s's record: recovery drops what it found
// there (a slot in a held chunk, no longer in use, or one an Invalidate
// named).
func (t *Tier) clearRecord(s SlotID) {
	if t.persist != nil {
		t.persist.clearRecord(s)
	}
}

// RecordOf decodes slot s's record (tests, and a check that one is there).
func (t *Tier) RecordOf(s SlotID) (slot.Header, error) {
	if t.persist == nil {
		return slot.Header{}, ErrNotPersistent
	}
	var buf [slot.HeaderSize]byte
	copy(buf[:RecordBytes], t.persist.record(s))
	return slot.Decode(buf[:])
}
